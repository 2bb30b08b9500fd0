"""Exercise 00: where does a rank sit in the 3D mesh, and who are its partners?

Ranks are numbered with TP varying fastest, then DP, then PP (Megatron's ``tp-dp-pp`` order):

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

Fill in the two functions below, then run the checks in ``exercises/00_ranks.ipynb``.
Do not import :mod:`edu3d.distributed.mesh`: the point is to work the arithmetic out yourself.
"""


def coords_of(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    """The coordinates ``(pp_rank, dp_rank, tp_rank)`` of ``rank`` in a dp x tp x pp mesh.

    Example: dp=2, tp=2, pp=2 -> rank 5 is (1, 0, 1).
    """
    raise NotImplementedError(
        "hint: tp_rank is the remainder of rank divided by tp; divide rank by tp and take "
        "the remainder by dp for dp_rank; what is left after dividing by tp*dp is pp_rank")


def group_members(rank: int, dim: str, dp: int, tp: int, pp: int) -> list[int]:
    """The global ranks of ``rank``'s group along ``dim`` ('tp', 'dp' or 'pp'), increasing.

    A group along a dimension is every rank that has the same coordinates as ``rank`` in
    the *other* two dimensions. Example: dp=2, tp=2, pp=2 -> the DP group of rank 5 is [5, 7].
    """
    raise NotImplementedError(
        "hint: take coords_of(rank, ...), let the coordinate of `dim` run over its whole "
        "range while keeping the other two fixed, and turn each coordinate triple back into a "
        "rank with rank = tp_rank + tp * (dp_rank + dp * pp_rank)")
