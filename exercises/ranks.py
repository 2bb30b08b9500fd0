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


# ---- design: a layout for nodes of 8 --------------------------------------------------------
def layout_for(job: str) -> tuple[int, int, int]:
    """The ``(dp, tp, pp)`` to launch for ``job``, ranks numbered as above.

    Both jobs train a GPT of 13 billion parameters (40 layers, ``d_model`` 5120, sequences
    of 4096 tokens, 8 micro-batches of one sequence per step) in bf16 with AdamW, on nodes
    of 8 GPUs:

    =====  ======  =============  ================
    job    GPUs    nodes          memory per GPU
    =====  ======  =============  ================
    ``a``  16      2 nodes of 8   80 GB
    ``b``  32      4 nodes of 8   40 GB
    =====  ======  =============  ================

    The layout must use every GPU, ``pp`` must divide the 40 layers, and a rank's state (16
    bytes per parameter, split over ``tp * pp``) must fit in 90 % of a GPU. The step, in the
    grader's model (``edu3d/course/ch00_launching_ranks_grade.py``), is the compute (400
    TFLOP/s per GPU), stretched by the pipeline's bubble, plus each axis's bytes per rank
    over its link: 150 GB/s while every group of that axis stays inside one node, 25 GB/s
    once one of its groups spans two. Tensor parallelism talks at every layer, data
    parallelism once per step, the pipeline only at its stage boundaries. The target: at
    most 5 % slower than the fastest layout that fits.
    """
    raise NotImplementedError(
        "hint: first make the state fit; then, with your group_members, look at which "
        "axis's groups leave a node under each layout, and keep the chattiest ones inside")
