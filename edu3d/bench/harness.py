"""Benchmarks: edu3d's mechanics timed side by side with PyTorch's own implementations.

After reading this file you should understand how edu3d measures speed honestly:

* both implementations run in the **same process tree** (the same ranks, the same process
  groups), so they see the same machine, load and network;
* their repetitions are **interleaved** (edu3d, torch, edu3d, torch, ...), so a slow phase
  of the machine hurts both equally, and each time is the **median** of several repetitions;
* a distributed repetition ends when the **slowest rank** ends (a barrier before, the maximum
  over ranks after);
* results are reported as ``ratio = edu3d_s / reference_s`` in one JSON shape::

    {"benchmark": "dp", "world_size": 4, "layout": "dp4",
     "results": [{"name": "bucketed", "edu3d_s": 0.012, "reference":
                  "torch.nn.parallel.DistributedDataParallel", "reference_s": 0.011,
                  "ratio": 1.09, "tokens": 2048, "tokens_per_s": 170666.7,
                  "reference_tokens_per_s": 186181.8, "comm_share": {"dp": 0.31}}]}

  ``tokens`` (what one timed repetition processes, all ranks together) gives both sides'
  tokens/s; ``comm_share`` is the share of one traced edu3d step (rank 0's) with an
  operation of each process group in flight (:func:`comm_shares`). A row may name its own
  ``layout``. :mod:`edu3d.bench.records` turns every report into rows of a CSV that a user
  keeps (``edu3d bench NAME --csv FILE``), and :mod:`edu3d.bench.plot` draws that CSV;

Benchmarks are commands (``edu3d bench NAME``), never timed tests: a test's pass or fail must
not depend on how busy the machine is.

This module is the one harness; each benchmark is a module beside it: :mod:`.bench_comm`
(collectives and the alpha-beta fit), :mod:`.bench_dp` (DDP, ZeRO-1, ZeRO-3), :mod:`.bench_tp`
(DTensor tensor parallelism), :mod:`.bench_pp` (``Schedule1F1B``), :mod:`.bench_3d` (the
composed dp x tp x pp stack), :mod:`.bench_recompute` and :mod:`.bench_offload` (activation
recomputation and offloading against PyTorch's wrappers, both timed by :func:`timed_blocks`)
and :mod:`.bench_launch` (``edu3d run`` against a bare torchrun, and a warm pool's cell
against a cold one). :mod:`.bench_gpu` is the one that needs CUDA: the
memory planner against ``torch.cuda.max_memory_allocated``, tokens/s and MFU on one device
(``python -m edu3d.bench.bench_gpu``). :mod:`edu3d.commands.bench` maps ``edu3d bench NAME``
to them.

The timing functions bring torch in through imports inside functions: ``edu3d bench``'s
command formats reports with this module (:func:`format_table`) and must start torch-free.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from typing import Callable

from edu3d.distributed import trace


def progress(message: str) -> None:
    """One line on stderr, from rank 0 only, so a benchmark that runs for half a minute shows
    it is alive; stdout keeps only the report."""
    if os.environ.get("RANK", "0") == "0":
        print(f"bench: {message}", file=sys.stderr, flush=True)


def progress_rep(i: int, reps: int, times: dict[str, list[float]]) -> None:
    """One progress line (stderr) after repetition ``i``: each side's latest time."""
    progress(f"repetition {i + 1}/{reps}: " +
             ", ".join(f"{name} {ts[-1] * 1e3:.2f} ms" for name, ts in times.items()))


def time_once(fn: Callable[[], object], group=None) -> float:
    """Seconds from a common start (barrier) until the slowest rank finishes ``fn``."""
    import torch
    import torch.distributed as dist

    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available() and dist.get_backend(group) == "nccl":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed.item())


def interleaved_medians(fns: dict[str, Callable[[], object]], reps: int = 5, warmup: int = 1,
                        group=None) -> dict[str, float]:
    """Median seconds of each function, repetitions interleaved across functions."""
    progress(f"{' vs '.join(fns)}: {warmup} warm-up and {reps} timed repetitions")
    for _ in range(warmup):
        for fn in fns.values():
            time_once(fn, group)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(reps):
        for name, fn in fns.items():
            times[name].append(time_once(fn, group))
        progress_rep(i, reps, times)
    return {name: statistics.median(ts) for name, ts in times.items()}


def input_grad(blocks, x) -> object:
    """One forward of ``blocks`` in sequence on ``x`` and the backward of the output's sum:
    the input's gradient (the blocks' own gradients are dropped)."""
    inp = x.detach().requires_grad_()
    y = inp
    for block in blocks:
        y = block(y)
    y.sum().backward()
    blocks.zero_grad(set_to_none=True)
    return inp.grad


def timed_blocks(sides: dict[tuple[str, bool], object], x, reps: int,
                 group=None) -> dict[str, float]:
    """Median seconds of one forward and backward (:func:`input_grad`) of each side's blocks
    on ``x``, in one interleaved round: ``sides`` maps ``(mode, ours)`` to blocks, the answer
    ``"<mode>/edu3d"`` or ``"<mode>/torch"`` to seconds. First every side's input gradient must
    equal that of ``("none", True)``, the plain blocks, bit for bit, or nothing is timed."""
    want = input_grad(sides[("none", True)], x)
    for key, blocks in sides.items():
        got = input_grad(blocks, x)
        if not got.equal(want):
            raise RuntimeError(f"{key}: the input gradient differs from the plain blocks' by "
                               f"{(got - want).abs().max().item():.2e}; not timing")
    return interleaved_medians({f"{mode}/{'edu3d' if ours else 'torch'}":
                                functools.partial(input_grad, blocks, x)
                                for (mode, ours), blocks in sides.items()},
                               reps=reps, warmup=1, group=group)


def traced(fn: Callable[[], object]) -> tuple[list[dict], float, object]:
    """``fn()`` once, recorded in memory: its trace events, its seconds, what it returned."""
    rec = trace.Recorder(trace.current().rank)
    with trace.use(rec):
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
    return rec.events, seconds, out


def comm_busy(events: list[dict], group: str) -> tuple[float, float]:
    """(bytes sent on the wire, seconds with at least one of ``group``'s operations in
    flight) in ``events``: overlapping sends and receives count once, so the share of the
    step stays a share."""
    mine = sorted((e for e in events if e.get("lane") == "comm" and e.get("group") == group),
                  key=lambda e: e["t0"])
    busy, end = 0.0, float("-inf")
    for e in mine:
        busy += max(0.0, e["t1"] - max(e["t0"], end))
        end = max(end, e["t1"])
    return sum(trace.wire_bytes(e) for e in mine), busy / 1e6


def comm_shares(fn: Callable[[], object]) -> dict[str, float]:
    """For one traced call of ``fn`` (a training step), the share of its time that each
    process group seen had an operation in flight (this rank's view; communication hidden
    under compute counts too)."""
    events, seconds, _ = traced(fn)
    groups = sorted({e["group"] for e in events if e.get("lane") == "comm" and "group" in e})
    return {g: comm_busy(events, g)[1] / seconds for g in groups}


def layout_name(**axes: int) -> str:
    """``dp2-tp2-pp2`` from axis sizes (axes of size 1 left out; ``1 rank`` if all are)."""
    return "-".join(f"{k}{v}" for k, v in axes.items() if v > 1) or "1 rank"


def result(name: str, edu3d_s: float, reference: str, reference_s: float,
           tokens: int | None = None, **extra) -> dict:
    """One row of a benchmark report; with ``tokens`` (per timed repetition, all ranks
    together) both sides' tokens/s too."""
    row = {"name": name, "edu3d_s": edu3d_s, "reference": reference,
           "reference_s": reference_s, "ratio": edu3d_s / reference_s}
    if tokens:
        row.update(tokens=tokens, tokens_per_s=tokens / edu3d_s,
                   reference_tokens_per_s=tokens / reference_s)
    return {**row, **extra}


def report(benchmark: str, world_size: int, results: list[dict],
           layout: str | None = None) -> dict:
    """A benchmark's report: its rows, the ranks it ran on, and the layout (``dp4``) each
    row ran on unless the row names its own."""
    return {"benchmark": benchmark, "world_size": world_size,
            "layout": layout or f"{world_size} ranks", "results": results}


def format_table(rep: dict) -> str:
    """A readable table of a report (the non-JSON output of ``edu3d bench``)."""
    w = max([22] + [len(r["name"]) for r in rep["results"]])
    lines = [f"benchmark {rep['benchmark']} on {rep['world_size']} ranks "
             f"(medians of interleaved repetitions)",
             f"{'name':<{w}} {'edu3d':>10} {'reference':>10} {'ratio':>7}  reference"]
    for r in rep["results"]:
        lines.append(f"{r['name']:<{w}} {r['edu3d_s'] * 1e3:>8.2f}ms {r['reference_s'] * 1e3:>8.2f}ms "
                     f"{r['ratio']:>7.3f}  {r['reference']}"
                     + ("" if "met" not in r else "  met" if r["met"] else "  MISSED"))
        for key in (k for k in r if k.endswith("_bytes") and f"{k}_formula" in r):
            got, want = r[key], r[f"{key}_formula"]  # what the trace counted, what theory says
            lines.append(f"{'':<{w}} {key.replace('_', ' ')} per step: {got:,.0f} measured, "
                         f"{want:,.0f} by the formula"
                         + (f" ({got / want:.3f}x)" if want else ""))
    return "\n".join(lines)

