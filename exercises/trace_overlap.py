"""Exercise 10: how much communication did the step really wait for, and how busy were the
GPUs?

A rank's trace (chapter 10) is a list of timed spans ``(t0, t1)`` on two lanes: compute
(forward, backward) and communication (all-reduces, sends). A collective that runs while the
rank computes costs nothing extra: it is *hidden*. Only the communication time that no
compute runs under makes the step longer: the **exposed** communication, the number to
shrink when you tune overlap. Spans come in any order; they may overlap, nest inside one
another, touch end to start, or have no length at all.

The second number of a performance review is **MFU**, the model FLOPs utilisation: the
FLOPs the model needs per step (``flops_per_token`` for every token of the step), divided by
what the GPUs could have done in that time at their peak.

Run the checks in ``exercises/10_exposed_comm.ipynb``.
"""


def merge(spans: list) -> list[tuple[float, float]]:
    """The time covered by ``spans`` as disjoint spans, sorted by start: ``[(0, 2), (1, 3),
    (5, 6)]`` -> ``[(0, 3), (5, 6)]``; spans that touch (``(0, 1)`` and ``(1, 2)``) become
    one. A span of no length may be kept or dropped."""
    raise NotImplementedError(
        "hint: the same instant may be covered by several spans: describe the covered time "
        "with spans that never overlap, in order")


def exposed_time(comm: list, compute: list) -> float:
    """The total length of the time covered by ``comm`` that ``compute`` does not cover."""
    raise NotImplementedError(
        "hint: a moment of communication costs the step time only when no compute runs at "
        "that moment; add up those moments")


def mfu(step_seconds: float, tokens: int, flops_per_token: float, peak_flops: float,
        gpus: int) -> float:
    """Model FLOPs utilisation of a step of ``tokens`` tokens on ``gpus`` GPUs of
    ``peak_flops`` FLOP/s each (a fraction, 0.45 for 45 %)."""
    raise NotImplementedError(
        "hint: compare the work the step needed with the work the GPUs could have done in "
        "the same time")



# ---- design: gradient buckets that hide their all-reduce --------------------------------------------
def bucket_plan(job: str) -> list[int]:
    """How many gradients each all-reduce bucket holds, in backward order: 12 blocks (6 ms
    of backward and 40 MB of gradients each), then the embedding (1 ms, 120 MB). A bucket's
    all-reduce starts when its last gradient is ready and the previous all-reduce is done,
    and takes 6 ms of latency plus ``2 (n - 1) / n`` of its bytes at 25 GB/s over 8 ranks.
    The buffer of the largest bucket may use at most 400 MB (job ``a``) or 130 MB (job
    ``b``). The target: the step (backward plus the communication no compute hides) within
    2 % of the best cut (the grader's model: ``cost`` in
    ``edu3d/course/ch10_performance_grade.py``).
    """
    raise NotImplementedError(
        "hint: a bucket per gradient pays the latency 13 times, one bucket hides nothing: "
        "what must the last bucket hold?")
