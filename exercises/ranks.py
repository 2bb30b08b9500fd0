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
        "hint: turn the rank number back into its three coordinates. The numbering is a "
        "mixed-radix number whose fastest digit is tp: which arithmetic recovers the "
        "digits of a number?")


def group_members(rank: int, dim: str, dp: int, tp: int, pp: int) -> list[int]:
    """The global ranks of ``rank``'s group along ``dim`` ('tp', 'dp' or 'pp'), increasing.

    A group along a dimension is every rank that has the same coordinates as ``rank`` in
    the *other* two dimensions. Example: dp=2, tp=2, pp=2 -> the DP group of rank 5 is [5, 7].
    """
    raise NotImplementedError(
        "hint: a group along one axis is every rank that agrees with yours on the other "
        "two axes; list them in increasing order")
