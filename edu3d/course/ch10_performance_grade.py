"""The grader of exercise 10 (``exercises/trace_overlap.py``): exposed communication and MFU,
checked on hidden traces.

After reading this file you should know what a correct interval arithmetic must survive. The
traces are generated here, from fixed seeds, in the shapes real ranks record and the ones
that break a naive answer: spans out of order, a span nested in another (a long all-reduce
under which a short one runs), spans touching end to start (back-to-back kernels), spans of
no length, a lane overlapping itself (two collectives in flight), compute inside
communication and the reverse, an empty lane. The reference is chapter 10's own arithmetic
(:func:`edu3d.course.ch10_performance.union` and ``minus``), the one that draws the
chapter's breakdown; MFU is checked against edu3d's FLOPs count of the course's models
(:func:`edu3d.model.gpt.flops_per_token`).

Each ``check_*`` raises ``AssertionError`` naming the first case that differs.

The design: ``bucket_plan(job)`` cuts one backward's gradients into all-reduce buckets
(layers in backward order, the embedding last) for a job of :data:`JOBS`. :func:`cost`
replays it: each bucket's all-reduce starts when its last gradient is ready and the link is
free, and costs a fixed latency plus its ring bytes; the step is the backward plus the
communication no compute hides (chapter 10's ``minus`` of the two lanes), the memory the
largest bucket's buffer. The target: the buffer fits, the step within 2 % of the best cut
(every cut is listed: 2,048).
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from dataclasses import dataclass

from edu3d.course.ch10_performance import length, minus, union
from edu3d.course.targets import Cost, Target, fmt_time, meet, plan_line, step_line, target_of
from edu3d.model.gpt import GPTConfig, flops_per_token

EDGE = {  # name -> (comm spans, compute spans)
    "out of order": ([(5, 6), (0, 2), (1, 3)], [(2.5, 5.5)]),
    "nested comm": ([(0, 10), (2, 3), (4, 5)], [(1, 2)]),
    "touching spans": ([(0, 1), (1, 2), (2, 3)], [(1, 2)]),
    "zero-length spans": ([(1, 1), (2, 4), (3, 3)], [(3, 3), (0, 1)]),
    "comm inside compute": ([(2, 3)], [(0, 10)]),
    "compute inside comm": ([(0, 10)], [(2, 3), (5, 6)]),
    "compute overlaps itself": ([(0, 10)], [(1, 4), (2, 5), (3, 4)]),
    "comm overlaps itself": ([(0, 4), (1, 5), (2, 3)], [(4.5, 6)]),
    "no compute": ([(0, 2), (1, 3)], []),
    "no comm": ([], [(0, 2)]),
    "compute starts the comm span": ([(0, 4)], [(0, 1), (3, 4)]),
}


def _random_trace(seed: int, n: int) -> tuple[list, list]:
    """One rank's step: ``n`` compute spans back to back with gaps, and collectives that
    start inside, between and after them (some in flight together)."""
    rng = random.Random(seed)
    t, compute, comm = 0.0, [], []
    for _ in range(n):
        d = rng.choice([rng.uniform(0.1, 2.0), rng.randint(1, 3)])
        compute.append((t, t + d))
        if rng.random() < 0.7:
            start = t + rng.uniform(0, d)
            comm.append((start, start + rng.uniform(0.05, 3.0)))
        t += d + rng.choice([0.0, 0.0, rng.uniform(0, 0.5)])  # touching, or a gap
    rng.shuffle(comm)
    rng.shuffle(compute)
    return comm, compute


CASES = {**EDGE, **{f"random step {s} ({n} spans)": _random_trace(s, n)
                    for s, n in ((1, 5), (2, 12), (3, 40), (4, 200))}}


def _nonempty(spans) -> list[tuple[float, float]]:
    return [(float(a), float(b)) for a, b in spans if b > a]


def check_merge(ex) -> None:
    for name, (comm, compute) in CASES.items():
        for lane, spans in (("comm", comm), ("compute", compute)):
            got = _nonempty(ex.merge(list(spans)))
            want = _nonempty(union(spans))
            same = len(got) == len(want) and all(
                math.isclose(a, c, abs_tol=1e-9) and math.isclose(b, d, abs_tol=1e-9)
                for (a, b), (c, d) in zip(got, want))
            assert same, f"{name}, {lane} lane {sorted(spans)}: merge gave {got}, " \
                         f"expected {want}"


def check_exposed(ex) -> None:
    for name, (comm, compute) in CASES.items():
        got = float(ex.exposed_time(list(comm), list(compute)))
        want = length(minus(comm, compute))
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9), \
            f"{name}: comm {sorted(comm)} under compute {sorted(compute)}: exposed " \
            f"{got:.6g}, expected {want:.6g}"


def check_mfu(ex) -> None:
    tiny = GPTConfig(n_layers=2, n_heads=4, d_model=64, seq_len=32, vocab_size=256)
    cases = [(0.5, 8192, flops_per_token(tiny), 1e12, 1), (2.0, 2**20, 6 * 7e9, 989e12, 64),
             (0.31, 4096 * 8, 6 * 124e6, 312e12, 8)]
    for step_s, tokens, fpt, peak, gpus in cases:
        got = float(ex.mfu(step_s, tokens, fpt, peak, gpus))
        want = tokens * fpt / (step_s * peak * gpus)
        assert math.isclose(got, want, rel_tol=1e-9), \
            f"{tokens} tokens of {fpt:.3g} FLOPs in {step_s} s on {gpus} GPUs of " \
            f"{peak:.3g} FLOP/s: MFU {got:.4g}, expected {want:.4g}"


# ---- the design: gradient buckets that hide their all-reduce --------------------------------------
@dataclass(frozen=True)
class Job:
    buffer_mb: float  # the largest bucket buffer allowed


LAYERS, LAYER_S, LAYER_MB = 12, 6e-3, 40.0  # backward of one block, its gradients
EMB_S, EMB_MB = 1e-3, 120.0  # the embedding's backward comes last
RANKS, LATENCY_S, LINK_GBS = 8, 6e-3, 25.0
JOBS = {"a": Job(buffer_mb=400), "b": Job(buffer_mb=130)}
SLACK = 1.02


def spans(job: str, sizes) -> tuple[list, list]:
    """The (comm, compute) lanes of one backward with buckets of ``sizes`` layers."""
    n = LAYERS + 1
    assert isinstance(sizes, (list, tuple)) and all(int(k) >= 1 for k in sizes) \
        and sum(int(k) for k in sizes) == n, \
        f"job {job}: bucket_plan must return bucket sizes of at least 1 layer adding up to " \
        f"the {n} gradients ({LAYERS} blocks and the embedding)"
    secs = [LAYER_S] * LAYERS + [EMB_S]
    mbs = [LAYER_MB] * LAYERS + [EMB_MB]
    at = done = 0.0
    i, comm = 0, []
    for k in (int(k) for k in sizes):
        at += sum(secs[i:i + k])
        size = sum(mbs[i:i + k]) * 1e6
        start = max(at, done)
        done = start + LATENCY_S + 2 * (RANKS - 1) / RANKS * size / (LINK_GBS * 1e9)
        comm.append((start, done))
        i += k
    return comm, [(0.0, at)]


def cost(job: str, sizes) -> Cost:
    comm, compute = spans(job, sizes)
    mbs = [LAYER_MB] * LAYERS + [EMB_MB]
    edges = list(itertools.accumulate(int(k) for k in sizes))
    largest = max(sum(mbs[a:b]) for a, b in zip([0] + edges[:-1], edges))
    return Cost(time=compute[0][1] + length(minus(comm, compute)), memory=largest * 1e6)


def cuts(job: str):
    """Every cut of the gradients into contiguous buckets."""
    n = LAYERS + 1
    for marks in itertools.product((False, True), repeat=n - 1):
        sizes, k = [], 1
        for mark in marks:
            if mark:
                sizes.append(k)
                k = 1
            else:
                k += 1
        yield sizes + [k]


@functools.cache
def target(job: str) -> Target:
    return target_of(cuts(job), lambda c: cost(job, c), JOBS[job].buffer_mb * 1e6, SLACK)


def check_design(ex, job: str) -> None:
    sizes = ex.bucket_plan(job)
    meet(f"job {job}: buckets of {list(sizes)} layers", cost(job, sizes), target(job))


def describe(job: str, sizes) -> str:
    """What ``sizes`` costs next to the target, or why it is no plan."""
    alone = f", backward alone {fmt_time(LAYERS * LAYER_S + EMB_S)}"
    return plan_line(lambda: cost(job, sizes), lambda: target(job), lambda c, t: step_line(
        f"job {job}: {list(sizes)}", c, t, "largest bucket {}", alone))
