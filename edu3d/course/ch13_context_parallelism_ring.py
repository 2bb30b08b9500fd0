"""Chapter 13, section 2: the ring's steps, read from a live trace, and what each step costs.

After reading this file you should know why the ring is cut in *steps*, and what a step
needs to be cheap:

* :func:`ring_steps` reads the ring's sends out of a live trace, numbered by ring step, and
  :func:`ring_schedule` says which block each rank holds at each step;
* every ring step ends in a wait for the next block, a synchronisation point: the step takes
  as long as its slowest rank. :func:`ring_step_work` counts the causal score entries each
  rank computes at each step. The plain split is unbalanced at every step (and the step's
  slowest rank differs), so the sum over steps of the slowest rank's work is what the ring
  costs, not the mean; zigzag gives every rank the same work *at every step*, not only in
  total (:func:`step_imbalance`);
* the ring hides its communication only when one step's attention (``4·(s/cp)²·h`` FLOPs for
  a rank's queries against one block) outlasts moving one block of K and V (``2·(s/cp)·h``
  values): attention grows with ``(s/cp)²``, the transfer with ``s/cp`` plus a fixed
  latency, so short sequences expose the transfer and long ones hide it.
  :func:`overlap_probe` (a launch target) measures both on the ranks for several sequence
  lengths, and :func:`hidden_from` reads the first length at which the attention wins.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from edu3d.parallel.cp import block_attention, positions


def ring_steps(events: list[dict], step: int = 1) -> list[dict]:
    """The ring's K/V transfers in ``step`` of the trace: per rank and phase, its sends in
    order, numbered by ring step. Each step sends the K, V block it holds (and its
    positions) to the next rank; in backward the dK, dV sums travel with it."""
    rows: dict[tuple, list] = {}
    for ev in sorted(events, key=lambda e: e["t0"]):
        if ev.get("step") != step or ev.get("op") != "send" or ev.get("group") != "cp":
            continue
        rows.setdefault((ev["rank"], ev.get("phase", "forward")), []).append(ev)
    out = []
    for (rank, phase), sends in sorted(rows.items()):
        per_step = 2 if phase == "forward" else 3  # K,V then positions (then dK,dV)
        last = per_step * (len(sends) // per_step)
        for i, ev in enumerate(sends):
            step_i, kind = i // per_step, ("K,V", "positions", "dK,dV")[i % per_step]
            if i >= last:  # backward's last step: only the sums travel, home
                kind = "dK,dV"
            out.append({"rank": rank, "phase": phase, "send": i, "ring_step": step_i,
                        "kind": kind, "peer": ev["peer"], "bytes": ev["bytes"],
                        "t0": ev["t0"], "t1": ev["t1"]})
    return out


def ring_schedule(cp: int) -> list[dict]:
    """The theory: at ring step ``i`` rank ``r`` attends to the K, V block of rank
    ``(r - i) mod cp`` and sends it on to ``r + 1`` (except after the last step)."""
    return [{"rank": r, "step": i, "holds": (r - i) % cp, "sends_to": (r + 1) % cp
             if i < cp - 1 else None} for i in range(cp) for r in range(cp)]


def ring_step_work(seq_len: int, cp: int, split: str = "zigzag") -> list[list[int]]:
    """``[ring step][rank]``: the causal score entries rank r computes at step i, its
    queries against the keys of rank ``(r - i) mod cp``."""
    pos = [positions(seq_len, cp, r, split) for r in range(cp)]
    return [[sum(1 for q in pos[r] for k in pos[(r - i) % cp] if k <= q) for r in range(cp)]
            for i in range(cp)]


def step_imbalance(work: list[list[int]]) -> dict[str, float]:
    """What the ring pays for ``work`` (:func:`ring_step_work`): ``slowest``, the sum over
    steps of the busiest rank's entries (each step waits for it); ``mean``, the sum of the
    per-step means (perfect balance); ``ratio`` = slowest / mean."""
    slowest = sum(max(row) for row in work)
    mean = sum(sum(row) / len(row) for row in work)
    return {"slowest": slowest, "mean": mean, "ratio": slowest / mean}


def _median_ms(fn, repeats: int, group) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])


def overlap_probe(group, seq_lens=(64, 256, 1024, 4096), heads: int = 4, head_dim: int = 8,
                  repeats: int = 3) -> list[dict]:
    """On every rank of ``group`` (cp ranks, a ring): per sequence length, the time of one
    ring step's attention (this rank's ``s/cp`` queries against a block of ``s/cp`` earlier
    keys, all visible) and of moving one K, V block (``2·(s/cp)·h`` fp32 values) to the next
    rank while receiving the previous one's: medians of ``repeats``, in ms."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    nxt, prv = ranks[(me + 1) % cp], ranks[(me - 1) % cp]
    g = torch.Generator().manual_seed(me)
    rows = []
    for s in seq_lens:
        n = s // cp
        q, k, v = (torch.randn(1, heads, n, head_dim, generator=g) for _ in range(3))
        q_pos, k_pos = torch.arange(n) + n, torch.arange(n)  # every key before every query
        kv = torch.stack([k, v])
        recv = torch.empty_like(kv)

        def attend():
            block_attention(q, k, v, q_pos, k_pos, head_dim ** -0.5)

        def move():
            for h in (dist.irecv(recv, prv, group=group), dist.isend(kv, nxt, group=group)):
                h.wait()

        rows.append({"seq_len": s, "tokens": n, "kv_bytes": kv.numel() * kv.element_size(),
                     "attention_ms": _median_ms(attend, repeats, group),
                     "transfer_ms": _median_ms(move, repeats, group)})
    return rows


def hidden_from(rows: list[dict]) -> int | None:
    """The shortest measured sequence from which on one ring step's attention outlasts the
    transfer of one K, V block (so the ring hides it); None if none does."""
    for i, r in enumerate(rows):
        if all(x["attention_ms"] >= x["transfer_ms"] for x in rows[i:]):
            return r["seq_len"]
    return None
