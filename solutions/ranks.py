"""Solution to exercise 00: rank <-> (pp, dp, tp) coordinates and the groups along each axis.

Ranks are numbered with TP varying fastest, then DP, then PP (Megatron's ``tp-dp-pp`` order):

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)
"""


def coords_of(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    """The coordinates ``(pp_rank, dp_rank, tp_rank)`` of ``rank`` in a dp x tp x pp mesh."""
    if not 0 <= rank < dp * tp * pp:
        raise ValueError(f"rank {rank} is outside 0..{dp * tp * pp - 1}")
    tp_rank = rank % tp
    dp_rank = (rank // tp) % dp
    pp_rank = rank // (tp * dp)
    return pp_rank, dp_rank, tp_rank


def group_members(rank: int, dim: str, dp: int, tp: int, pp: int) -> list[int]:
    """The global ranks of ``rank``'s group along ``dim`` ('tp', 'dp' or 'pp'), increasing."""
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    if dim not in sizes:
        raise ValueError(f"dim {dim!r} must be 'tp', 'dp' or 'pp'")
    coords = dict(zip(("pp", "dp", "tp"), coords_of(rank, dp, tp, pp)))
    members = []
    for i in range(sizes[dim]):
        c = {**coords, dim: i}
        members.append(c["tp"] + tp * (c["dp"] + dp * c["pp"]))
    return members


# The deeper hints of exercises/ranks.py (edu3d.course.grading.tiers): per function,
# a nudge (a check's second failure), then the answer's shape (its third).
HINTS = {'coords_of': ('tp_rank changes with every rank, dp_rank every tp ranks, pp_rank every tp*dp '
               'ranks: use // and %',
               'tp_rank = rank % tp; dp_rank = (rank // tp) % dp; pp_rank = rank // (tp * dp); '
               'return (pp_rank, dp_rank, tp_rank)'),
 'group_members': ('take your own coordinates, let the coordinate of `dim` run over its whole '
                   'range, keep the other two, and turn each triple back into a rank',
                   'for i in range(size of dim): c = your coords with dim set to i; rank = '
                   'c.tp + tp * (c.dp + dp * c.pp)')}
