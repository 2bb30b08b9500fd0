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




# ---- design: a layout for nodes of 8 --------------------------------------------------------
def layout_for(job: str) -> tuple[int, int, int]:
    """The ``(dp, tp, pp)`` to launch for ``job``: the state fits once ``tp * pp`` shares it
    (208 GB: 4 ways on 80 GB GPUs, 8 ways on 40 GB); with ``tp`` fastest and ``pp``
    slowest, ``dp * tp = 4`` keeps the dp and tp groups inside a node of 8 and only the
    pipeline, which sends least, crosses nodes. Job a needs no tp at all (dp 4, pp 4); job b
    (32 GPUs) takes tp 2 inside the node rather than a deeper pipeline's bubble."""
    return {"a": (4, 1, 4), "b": (4, 2, 4)}[job]


# The deeper hints of exercises/ranks.py (edu3d.course.grading.tiers): per function,
# a nudge (a check's second failure), then the answer's shape (its third).
HINTS = {'coords_of': ('tp_rank changes with every rank, dp_rank every tp ranks, pp_rank every tp*dp '
               'ranks: use // and %',
               'tp_rank = rank % tp; dp_rank = (rank // tp) % dp; pp_rank = rank // (tp * dp); '
               'return (pp_rank, dp_rank, tp_rank)'),
 'group_members': ('take your own coordinates, let the coordinate of `dim` run over its whole '
                   'range, keep the other two, and turn each triple back into a rank',
                   'for i in range(size of dim): c = your coords with dim set to i; rank = '
                   'c.tp + tp * (c.dp + dp * c.pp)'),
 'layout_for': ('the state fixes the least tp * pp; a group leaves a node when its members are '
                'more than 8 ranks apart; tp talks most, pp least',
                'keep dp * tp within a node (dp * tp <= 8, tp fastest), let pp span the nodes: '
                'compare the few layouts that fit with ch00_launching_ranks_grade.cost')}
