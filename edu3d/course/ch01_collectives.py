"""Chapter 01 (collectives): the live runs its notebook launches and its panel's numbers.

After reading this file you should know where chapter 01's pictures come from: each function
runs on every rank of a real launch, calls the hand-written algorithms of
:mod:`edu3d.distributed.algorithms` (ring, tree, hierarchy) inside a traced context, and returns what
the rank saw, so the gallery, the ring replay and the byte counts are drawn from a real run.

The ring panel's numbers come from the same code: :func:`ring_sends` replays
:func:`edu3d.distributed.algorithms.ring_plan` (the very list of transfers the executor walks)
with the chunk sizes ``torch.tensor_split`` gives, so its bytes are exact;
:func:`ring_step_costs` prices each of its ``2(N-1)`` steps with the alpha-beta model,
``α + (S/N)·β`` per step (:func:`ring_all_reduce_s` for the whole); :func:`ring_timed` runs
edu3d's real ring and :func:`measured_ring_steps` reads the per-step bytes and times back from
its trace.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from edu3d.distributed import comm, trace
from edu3d.distributed.algorithms import (hierarchical_all_reduce, ring_all_gather,
                                          ring_all_reduce, ring_plan, ring_reduce_scatter,
                                          tree_broadcast, tree_reduce)
from edu3d.plan.links import Link, collective_time


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


# ---- the alpha-beta model and the ring step by step (the chapter's panel) ------------------------
#: edu3d's ring on this kind of machine (2 shared CPU cores, gloo over loopback), fitted by
#: ``edu3d bench comm`` at 2 ranks: 0.7 to 1.2 ms per step, 0.8 to 1.8 GB/s. A chapter
#: passes the values it fitted itself.
ALPHA_S = 1.0e-3
BETA_S_PER_BYTE = 1 / 1.0e9


def ring_all_reduce_s(size_bytes: float, n: int, alpha: float = ALPHA_S,
                      beta: float = BETA_S_PER_BYTE) -> float:
    """``t = 2(N-1)·α + 2(N-1)/N · S · β``: a ring all-reduce of ``size_bytes`` on ``n``, as
    the performance model times it (:func:`edu3d.plan.links.collective_time`)."""
    link = Link("gloo", alpha, 1 / beta, 1 / beta)
    return collective_time("all_reduce", size_bytes, n, link)


def chunk_bytes(numel: int, n: int, itemsize: int = 4) -> list[int]:
    """Bytes of each of the ``n`` chunks ``torch.tensor_split`` cuts ``numel`` values into."""
    q, r = divmod(numel, n)
    return [(q + (1 if i < r else 0)) * itemsize for i in range(n)]


def ring_sends(n: int, numel: int, itemsize: int = 4) -> list[dict]:
    """The ``send`` events a ring all-reduce of ``numel`` values on ``n`` ranks makes, from the
    executor's own plan (no times: :func:`ring_replay` adds them)."""
    sizes = chunk_bytes(numel, n, itemsize)
    return [{"rank": t.src, "lane": "comm", "op": "send", "peer": t.dst, "bytes": sizes[t.chunk],
             "algo": "ring_all_reduce", "phase": t.phase, "ring_step": t.step, "chunk": t.chunk,
             "sim": True} for t in ring_plan(n)]


STEP_KEY = {"reduce_scatter": "RS", "all_gather": "AG"}


def step_label(phase: str, step: int) -> str:
    return f"{STEP_KEY[phase]}{step}"


def ring_step_costs(n: int, numel: int, alpha: float = ALPHA_S, beta: float = BETA_S_PER_BYTE,
                    itemsize: int = 4) -> list[dict]:
    """One row per ring step: ``{"step": "RS0", "bytes" (all ranks together), "bytes_per_rank"
    (the largest chunk a rank sends), "s": α + bytes_per_rank·β}``. The steps' times add up
    to :func:`ring_all_reduce_s` (exactly when ``n`` divides ``numel``)."""
    rows = {}
    for e in ring_sends(n, numel, itemsize):
        key = step_label(e["phase"], e["ring_step"])
        row = rows.setdefault(key, {"step": key, "bytes": 0, "bytes_per_rank": 0})
        row["bytes"] += e["bytes"]
        row["bytes_per_rank"] = max(row["bytes_per_rank"], e["bytes"])
    for row in rows.values():
        row["s"] = alpha + row["bytes_per_rank"] * beta
    return list(rows.values())


def ring_timed(mesh, numel: int = 1 << 16, repeats: int = 3) -> dict:
    """Run edu3d's ring all-reduce ``repeats`` times on ``numel`` float32 values (after one
    untimed warm-up), each traced as ``case=rep{i}``; checked against ``dist.all_reduce``."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    want = x.clone()
    dist.all_reduce(want)
    ring_all_reduce(x.clone())  # warm-up: the first exchange also sets up the connections
    equal = True
    for i in range(repeats):
        comm.barrier()
        with trace.current().context(case=f"rep{i}"):
            got = ring_all_reduce(x.clone())
        equal = equal and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5))
    return {"rank": dist.get_rank(), "equal": equal, "repeats": repeats}


def measured_ring_steps(events: list[dict], n: int, repeats: int) -> list[dict]:
    """Per ring step of a :func:`ring_timed` trace: the bytes all ranks sent, and the step's
    time: from the moment the last rank finished the previous step (or the first rank
    started) to the moment the last rank finished this one; median over the repeats."""
    per_rep = []
    for i in range(repeats):
        sends = [e for e in events if e["op"] == "send" and e.get("case") == f"rep{i}"
                 and e.get("algo") == "ring_all_reduce"]
        if not sends:
            continue
        keys = sorted({(e["phase"] != "reduce_scatter", e["ring_step"], e["phase"])
                       for e in sends})
        prev = min(e["t0"] for e in sends)
        rows = []
        for _, step, phase in keys:
            sel = [e for e in sends if e["phase"] == phase and e["ring_step"] == step]
            end = max(e["t1"] for e in sel)
            rows.append({"step": step_label(phase, step), "bytes": sum(e["bytes"] for e in sel),
                         "s": (end - prev) / 1e6})
            prev = end
        per_rep.append(rows)
    if not per_rep:
        return []
    return [{"step": rows[0]["step"], "bytes": rows[0]["bytes"],
             "s": statistics.median(r["s"] for r in rows)}
            for rows in zip(*per_rep)]
