"""The grader of exercise 01 (``exercises/ring_allreduce.py``): a ring all-reduce on real
ranks, then the choice of an all-reduce algorithm for a message.

After reading this file you should know what ``exercises/01_ring_allreduce.ipynb`` checks:

* :func:`ring_on_ranks` runs the learner's ``ring_all_reduce`` on every rank of a launch
  against ``dist.all_reduce``: fp32 buffers of 1,001 and 840 values (1,001 does not split
  evenly over 4 ranks), then a bf16 one of 1,003 (a receive buffer made with the default
  dtype, fp32, cannot take a bf16 chunk: the sizes differ on the wire). Each size is traced
  as ``case=exercise/s{size}``, so the notebook sums the bytes every rank sent;
* the design: ``choose_all_reduce(size_bytes, n, alpha, beta, memory)`` picks ``"ring"``,
  ``"halving-doubling"`` or ``"doubling"`` for one message; :func:`cost` prices each with the
  alpha-beta model (one step costs ``α`` plus its bytes times ``β``) and its extra receive
  buffer, and :func:`check_design` wants, on every message of :data:`CASES` (4 bytes to
  1 GB, 4 and 64 ranks, a high-latency and a low-bandwidth link), the fastest algorithm
  whose buffer fits the memory given.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from edu3d.course import grading
from edu3d.course.targets import Cost, Target, fmt_bytes, fmt_time, meet, target_of
from edu3d.distributed import trace

# (values, dtype): uneven chunks, even chunks, and a 2-byte dtype
SIZES = ((1001, torch.float32), (840, torch.float32), (1003, torch.bfloat16))


def ring_on_ranks(mesh, sizes=SIZES) -> dict:
    """Launch target: the learner's ``ring_all_reduce`` on each ``(values, dtype)``; returns
    ``{values: equal to dist.all_reduce}`` (False, never an exception, when the code is
    unfinished or fails, so that every rank stops at the same point)."""
    mod = grading.load("ring_allreduce")
    out = {}
    for size, dtype in sizes:
        g = torch.Generator().manual_seed(dist.get_rank())
        x = (torch.randn(size, generator=g) * 4).round().to(dtype)  # exact sums in bf16 too
        want = x.clone()
        dist.all_reduce(want)
        try:
            with trace.current().context(case=f"exercise/s{size}"):
                got = mod.ring_all_reduce(x)
            out[size] = got.dtype == dtype and bool(torch.equal(got, want))
        except NotImplementedError:
            out[size] = False
            break  # an unfinished stub: the other ranks stop here too
        except RuntimeError:  # a transfer the ranks disagree on: each rank's gloo says so
            out[size] = False
    return out


# ---- the design: which all-reduce for this message? ------------------------------------------
ALGORITHMS = ("ring", "halving-doubling", "doubling")
LINKS = {"high-latency": (50e-6, 1 / 100e9), "low-bandwidth": (2e-6, 1 / 10e9)}  # α s, β s/B
CASES = [(size, n, link, memory) for size in (4, 4096, 262144, 16 << 20, 1 << 30)
         for n in (4, 64) for link in LINKS for memory in (256 << 20,)
         if not (size == 4 and link == "low-bandwidth")]


def cost(algorithm: str, size: float, n: int, alpha: float, beta: float) -> Cost:
    """Seconds of one all-reduce of ``size`` bytes on ``n`` ranks (a power of two), and the
    bytes of its largest receive buffer.

    * ring: ``2(n-1)`` steps, each moving one ``size/n`` chunk;
    * halving-doubling (Rabenseifner): recursive halving then doubling, ``2·log2 n`` steps
      moving ``size/2, size/4, ...`` and back: the ring's bytes in fewer steps, half the
      buffer received at the first step;
    * doubling: ``log2 n`` steps, each exchanging and adding the whole buffer.
    """
    steps = int(math.log2(n))
    if algorithm == "ring":
        return Cost(2 * (n - 1) * (alpha + size / n * beta), size / n)
    if algorithm == "halving-doubling":
        return Cost(2 * steps * alpha + 2 * (n - 1) / n * size * beta, size / 2)
    if algorithm == "doubling":
        return Cost(steps * (alpha + size * beta), size)
    raise AssertionError(f"{algorithm!r} is not one of {', '.join(ALGORITHMS)}")


def target(size: float, n: int, link: str, memory: float) -> Target:
    alpha, beta = LINKS[link]
    return target_of(ALGORITHMS, lambda a: cost(a, size, n, alpha, beta), memory, 1 + 1e-9)


def check_design(ex) -> None:
    """Every message of :data:`CASES`: the learner's choice is the fastest that fits."""
    for size, n, link, memory in CASES:
        alpha, beta = LINKS[link]
        choice = ex.choose_all_reduce(size, n, alpha, beta, memory)
        assert choice in ALGORITHMS, \
            f"choose_all_reduce returned {choice!r}; choose one of {', '.join(ALGORITHMS)}"
        meet(f"{fmt_bytes(size)} on {n} ranks, {link} link (α {fmt_time(alpha)}, "
             f"{1 / beta / 1e9:g} GB/s), {fmt_bytes(memory)} of buffer: {choice}",
             cost(choice, size, n, alpha, beta), target(size, n, link, memory))


def table(ex) -> str:
    """The learner's choice next to each algorithm's time, one line per message."""
    lines = []
    for size, n, link, memory in CASES:
        alpha, beta = LINKS[link]
        try:
            mine = ex.choose_all_reduce(size, n, alpha, beta, memory)
        except NotImplementedError:
            mine = "(not written yet)"
        costs = "  ".join(f"{a} {fmt_time(cost(a, size, n, alpha, beta).time)}"
                          + ("*" if cost(a, size, n, alpha, beta).memory > memory else "")
                          for a in ALGORITHMS)
        lines.append(f"{fmt_bytes(size):>8} n={n:<3} {link:<16} yours: {mine:<17} {costs}")
    return "\n".join(lines) + "\n(* does not fit the buffer)"
