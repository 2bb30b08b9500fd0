"""Chapter 01 (collectives): the live runs its notebook launches and exercise 01's grader.

After reading this file you should know where chapter 01's pictures come from: each function
runs on every rank of a real launch, calls the hand-written algorithms of
:mod:`edu3d.distributed.algorithms` (ring, tree, hierarchy) inside a traced context, and returns what
the rank saw, so the gallery, the ring replay and the byte counts are drawn from a real run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.course import grading
from edu3d.distributed import trace
from edu3d.distributed.algorithms import (hierarchical_all_reduce, ring_all_gather, ring_all_reduce,
                                   ring_reduce_scatter, tree_broadcast, tree_reduce)


GALLERY = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def collectives_gallery(mesh, numel: int = 4) -> dict:
    """Run each collective once on a small buffer; return this rank's buffer before and after.

    Rank ``r`` starts with ``[10r, 10r+1, ...]`` so every value says where it came from.
    broadcast, reduce, all-reduce, all-gather and reduce-scatter are this file's algorithms;
    all-to-all is torch.distributed's (it is a transpose, not a reduction).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    start = torch.arange(numel, dtype=torch.float32) + 10 * rank
    out = {}
    for op in GALLERY:
        x = start.clone()
        with trace.current().context(case=f"gallery/{op}"):
            if op == "broadcast":
                after = tree_broadcast(x, 0)
            elif op == "reduce":
                reduced = tree_reduce(x.clone(), 0)
                after = reduced if rank == 0 else None  # other ranks hold partial sums
            elif op == "all_reduce":
                after = ring_all_reduce(x)
            elif op == "all_gather":
                x = start[:1].clone()  # every rank contributes one value
                buf = torch.zeros(n)
                buf[rank] = x[0]
                after = ring_all_gather(buf)
            elif op == "reduce_scatter":
                after = ring_reduce_scatter(x).clone()
            else:
                after = torch.empty_like(x)
                dist.all_to_all_single(after, x)
        # the ring algorithms work in place on x: "before" is the untouched start
        out[op] = {"before": start.tolist() if op != "all_gather" else [float(start[0])],
                   "after": None if after is None else after.tolist()}
    return out


def ring_demo(mesh, numel: int = 1000) -> dict:
    """One traced ring all-reduce, checked against ``dist.all_reduce``."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=g)
    want = x.clone()
    dist.all_reduce(want)
    with trace.current().context(case="ring_demo"):
        ring_all_reduce(x)
    return {"rank": rank, "numel": numel, "equal": bool(torch.allclose(x, want, rtol=1e-5,
                                                                          atol=1e-6)),
            "max_abs_diff": float((x - want).abs().max())}


def ring_sizes(mesh, numel: int = 1000) -> list[int]:
    """Ring all-reduce on the first n ranks for every n in 2..world (traced as ``ring/n{n}``);
    returns the sizes for which the result equalled ``dist.all_reduce``'s."""
    rank, agreed = dist.get_rank(), []
    for n in range(2, dist.get_world_size() + 1):
        group = dist.new_group(list(range(n)))
        if rank >= n:
            continue
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        want = x.clone()
        dist.all_reduce(want, group=group)
        with trace.current().context(case=f"ring/n{n}"):
            ring_all_reduce(x, group)
        if torch.allclose(x, want, rtol=1e-5, atol=1e-6):
            agreed.append(n)
    return agreed


def hierarchy_demo(mesh, numel: int = 1200, ranks_per_node: int = 3) -> dict:
    """A flat ring all-reduce and a hierarchical one on the same data, traced as
    ``case=flat`` and ``case=hierarchical``; both checked against ``dist.all_reduce``."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    want = x.clone()
    dist.all_reduce(want)
    out = {}
    for case, fn in (("flat", ring_all_reduce),
                     ("hierarchical", lambda t: hierarchical_all_reduce(t, ranks_per_node))):
        with trace.current().context(case=case):
            got = fn(x.clone())
        out[case] = bool(torch.allclose(got, want, rtol=1e-5, atol=1e-6))
    return out


def inter_node_bytes(events: list[dict], ranks_per_node: int, case: str | None = None) -> int:
    """Bytes of ``send`` events whose two ends sit in different (simulated) nodes."""
    return sum(e["bytes"] for e in events if e["op"] == "send"
               and (case is None or e.get("case") == case)
               and e["rank"] // ranks_per_node != e["peer"] // ranks_per_node)


# ---- grading exercise 01 -------------------------------------------------------------------------
def grade_ring_exercise(mesh, sizes=(1001, 840)) -> dict:
    """Run the learner's ``ring_all_reduce`` (exercises/ring_allreduce.py, or the solution)
    on each size, traced as ``case=exercise/s{size}``; returns ``{size: equal to
    dist.all_reduce}`` (False, never an exception, when the code is unfinished)."""

    mod = grading.load("ring_allreduce")
    out = {}
    for size in sizes:
        x = torch.randn(size, generator=torch.Generator().manual_seed(dist.get_rank()))
        want = x.clone()
        dist.all_reduce(want)
        try:
            with trace.current().context(case=f"exercise/s{size}"):
                got = mod.ring_all_reduce(x)
            out[size] = bool(torch.allclose(got, want, rtol=1e-5, atol=1e-6))
        except NotImplementedError:
            out[size] = False
            break  # an unfinished stub: the other ranks stop here too
    return out
