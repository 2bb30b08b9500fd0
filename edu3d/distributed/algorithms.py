"""Collectives written by hand over send/recv: ring, binomial tree, and a two-level hierarchy.

After reading this file you should understand:

* **ring reduce-scatter**: the buffer is cut into N chunks. In step ``s`` (0..N-2) rank ``i``
  sends chunk ``(i-s-1) mod N`` to its right neighbour and adds the chunk ``(i-s-2) mod N``
  arriving from its left one. After N-1 steps rank ``i`` holds the full sum of chunk ``i``.
  Each rank sent N-1 chunks: ``(N-1)/N · S`` bytes;
* **ring all-gather**: the same ring, copying instead of adding: ``(N-1)/N · S`` bytes;
* **ring all-reduce** is the two in a row: ``2(N-1)/N · S`` bytes per rank, independent of
  N for large N. That is why it is the bandwidth-optimal all-reduce;
* **binomial tree** broadcast and reduce: ``log2 N`` rounds, each doubling the ranks that
  have the data (or halving those still holding partial sums). Cheap in latency, but the root
  sends ``log2 N`` full copies;
* **hierarchical all-reduce**: reduce inside each (simulated) node, ring all-reduce across the
  node leaders, broadcast back inside the node: only leaders use the slow inter-node links.

The algorithms are **data first**: :func:`ring_plan` returns the list of transfers
``(phase, step, src, dst, chunk)`` that a ring performs; the executor walks that list, and the
chapter's animation replays the same list, or the trace of a live run. Every transfer is an
instrumented :func:`edu3d.distributed.comm.send` carrying ``algo``, ``phase``, ``ring_step`` and
``chunk``, so summing the ``bytes`` of ``send`` events gives the traffic exactly.

When S is not divisible by N the chunks differ by one element (``torch.tensor_split``);
each rank then skips a different chunk, so the traffic summed over ranks is still exactly
``(N-1)·S`` per phase, i.e. ``(N-1)/N · S`` per rank on average.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from edu3d.distributed import comm, trace


class Transfer(NamedTuple):
    """One point-to-point message of an algorithm, in group positions (0..N-1)."""

    phase: str  # "reduce_scatter" | "all_gather" | "broadcast" | "reduce"
    step: int
    src: int
    dst: int
    chunk: int  # which of the N chunks (ring) or -1 for the whole buffer (tree)


def ring_plan(n: int, phases: Sequence[str] = ("reduce_scatter", "all_gather")) -> list[Transfer]:
    """Every transfer of a ring over ``n`` positions, phase by phase, step by step."""
    plan = []
    for phase in phases:
        # reduce-scatter ends with position i owning chunk i; all-gather starts from there
        shift = 1 if phase == "reduce_scatter" else 0
        for s in range(n - 1):
            for i in range(n):
                plan.append(Transfer(phase, s, i, (i + 1) % n, (i - s - shift) % n))
    return plan


def tree_plan(n: int, root: int = 0, phase: str = "broadcast") -> list[Transfer]:
    """A binomial tree over ``n`` positions: broadcast from ``root``, or reduce to it.

    Broadcast round ``k`` sends from every position ``v < 2^k`` (relative to the root) to
    ``v + 2^k``; reduce is the same tree walked backwards (partial sums flow to the root).
    """
    rounds = []
    mask = 1
    while mask < n:
        rounds.append([(v, v + mask) for v in range(mask) if v + mask < n])
        mask <<= 1
    if phase == "reduce":
        rounds = [[(dst, src) for src, dst in r] for r in reversed(rounds)]
    elif phase != "broadcast":
        raise ValueError(f"tree phase {phase!r} must be 'broadcast' or 'reduce'")
    return [Transfer(phase, k, (src + root) % n, (dst + root) % n, -1)
            for k, r in enumerate(rounds) for src, dst in r]


def _group_ranks(group, ranks: Sequence[int] | None) -> list[int]:
    if ranks is not None:
        return list(ranks)
    return dist.get_process_group_ranks(group) if group is not None else list(
        range(dist.get_world_size()))


def _exchange(send_buf, dst, recv_buf, src, group):
    """Post the receive and the send together, then wait: a ring of blocking sends would
    deadlock once messages outgrow the transport's buffers."""
    handles = []
    if recv_buf is not None:
        handles.append(comm.recv(recv_buf, src, group, async_op=True))
    if send_buf is not None:
        handles.append(comm.send(send_buf, dst, group, async_op=True))
    for h in handles:
        h.wait()


def _run_ring(flat: torch.Tensor, plan: list[Transfer], ranks: list[int], group, algo: str):
    n, me = len(ranks), ranks.index(dist.get_rank())
    chunks = list(torch.tensor_split(flat, n))
    rec = trace.current()
    for t_send in plan:
        if t_send.src != me:
            continue
        t_recv = next(t for t in plan if t.phase == t_send.phase and t.step == t_send.step
                      and t.dst == me)
        incoming = torch.empty_like(chunks[t_recv.chunk])
        with rec.context(algo=algo, phase=t_send.phase, ring_step=t_send.step,
                         chunk=t_send.chunk):
            _exchange(chunks[t_send.chunk], ranks[t_send.dst], incoming, ranks[t_recv.src],
                      group)
        if t_recv.phase == "reduce_scatter":
            chunks[t_recv.chunk] += incoming
        else:
            chunks[t_recv.chunk].copy_(incoming)
    return chunks


def ring_all_reduce(t: torch.Tensor, group=None, ranks: Sequence[int] | None = None):
    """Sum ``t`` over the group in place with a ring: reduce-scatter, then all-gather."""
    ranks = _group_ranks(group, ranks)
    if len(ranks) > 1:
        flat = t.view(-1)
        _run_ring(flat, ring_plan(len(ranks)), ranks, group, "ring_all_reduce")
    return t


def ring_reduce_scatter(t: torch.Tensor, group=None, ranks: Sequence[int] | None = None):
    """Sum ``t`` over the group; returns this rank's chunk of the sum (a view into ``t``).

    Chunk ``i`` of ``torch.tensor_split(t.view(-1), N)`` belongs to group position ``i``.
    """
    ranks = _group_ranks(group, ranks)
    chunks = _run_ring(t.view(-1), ring_plan(len(ranks), ("reduce_scatter",)), ranks, group,
                       "ring_reduce_scatter") if len(ranks) > 1 else [t.view(-1)]
    return chunks[ranks.index(dist.get_rank())]


def ring_all_gather(t: torch.Tensor, group=None, ranks: Sequence[int] | None = None):
    """``t`` holds every rank's chunk slot; fill the other ranks' chunks in place.

    On entry chunk ``i`` of ``torch.tensor_split(t.view(-1), N)`` is valid on position ``i``.
    """
    ranks = _group_ranks(group, ranks)
    if len(ranks) > 1:
        _run_ring(t.view(-1), ring_plan(len(ranks), ("all_gather",)), ranks, group,
                  "ring_all_gather")
    return t


def _run_tree(t: torch.Tensor, plan: list[Transfer], ranks: list[int], group, algo: str):
    me = ranks.index(dist.get_rank())
    rec = trace.current()
    incoming = torch.empty_like(t) if any(x.dst == me for x in plan) else None
    for x in plan:
        if me not in (x.src, x.dst):
            continue
        with rec.context(algo=algo, phase=x.phase, ring_step=x.step):
            if x.src == me:
                comm.send(t, ranks[x.dst], group)
            else:
                comm.recv(incoming, ranks[x.src], group)
                if x.phase == "reduce":
                    t += incoming
                else:
                    t.copy_(incoming)
    return t


def tree_broadcast(t: torch.Tensor, root: int = 0, group=None,
                   ranks: Sequence[int] | None = None):
    """Copy group position ``root``'s ``t`` to every rank along a binomial tree."""
    ranks = _group_ranks(group, ranks)
    return _run_tree(t, tree_plan(len(ranks), root, "broadcast"), ranks, group, "tree_broadcast")


def tree_reduce(t: torch.Tensor, root: int = 0, group=None, ranks: Sequence[int] | None = None):
    """Sum ``t`` onto group position ``root`` along a binomial tree (other ranks' ``t`` end up
    holding partial sums)."""
    ranks = _group_ranks(group, ranks)
    return _run_tree(t, tree_plan(len(ranks), root, "reduce"), ranks, group, "tree_reduce")


def node_groups(ranks: Sequence[int], ranks_per_node: int) -> list[list[int]]:
    """Consecutive ranks grouped into simulated nodes (the last node may be smaller)."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be at least 1")
    ranks = list(ranks)
    return [ranks[i:i + ranks_per_node] for i in range(0, len(ranks), ranks_per_node)]


def hierarchical_all_reduce(t: torch.Tensor, ranks_per_node: int, group=None,
                            ranks: Sequence[int] | None = None):
    """Two-level all-reduce: tree-reduce inside each node onto its first rank (the leader),
    ring all-reduce across the leaders, tree-broadcast back inside each node."""
    ranks = _group_ranks(group, ranks)
    nodes = node_groups(ranks, ranks_per_node)
    mine = next(node for node in nodes if dist.get_rank() in node)
    tree_reduce(t, 0, group, mine)
    if dist.get_rank() == mine[0]:
        ring_all_reduce(t, group, [node[0] for node in nodes])
    tree_broadcast(t, 0, group, mine)
    return t


def sent_bytes(events: list[dict], algo: str | None = None, rank: int | None = None) -> int:
    """Bytes sent, summed from a trace's ``send`` events (optionally of one algorithm/rank)."""
    return sum(e["bytes"] for e in events if e["op"] == "send"
               and (algo is None or e.get("algo") == algo)
               and (rank is None or e["rank"] == rank))
