"""Expert parallelism's exchange: tokens travel to the rank that holds their expert and back.

After reading this file you should understand:

* the two all-to-alls of an expert-parallel MoE layer (GShard, torchtitan, Megatron's
  "alltoall" dispatcher): first each rank tells every other how many rows it will send for
  each of that rank's experts (a tiny all-to-all of counts), then the rows themselves move
  with uneven splits (``comm.AllToAll``: rows per destination rank);
* the two reorders around the experts: rows arrive *rank-major* (all of rank 0's rows, sorted
  by expert, then rank 1's ...), an expert wants its rows together, so they are permuted
  *expert-major*, run, and permuted back before the return trip;
* why backward needs nothing new: ``AllToAll``'s backward is the same exchange with the
  splits swapped, and the permutations are plain indexing, so autograd sends each gradient
  row back to where its token came from;
* what it costs: dispatch and combine each move the ``(EP-1)/EP`` of this rank's ``T·k·h``
  elements that belong to other ranks' experts, forward and again in backward.

The source keeps the gates: :meth:`edu3d.model.moe.MoE.forward` sorts its assignments by
expert, dispatches the rows through :class:`ExpertDispatcher` (installed by
:func:`edu3d.parallel.ep.placement.apply_ep`), runs the experts it holds, combines, and
weights what comes back, exactly as it does when every expert is local.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from edu3d.distributed import comm


@dataclass
class Route:
    """How one dispatch moved rows, kept for the combine that undoes it."""
    send: list[int]       # rows this rank sent to each rank of the group
    recv: list[int]       # rows it received from each rank
    per_local: list[int]  # received rows per local expert (all sources together)
    inv: torch.Tensor     # expert-major position -> rank-major position


def dispatch(xs: torch.Tensor, per_expert: torch.Tensor, group) -> tuple[torch.Tensor, Route]:
    """``xs``: rows sorted by global expert id, ``per_expert[e]`` of them for expert e (all E).
    Experts are split into equal consecutive ranges, rank r holding ``[r·E/ep, (r+1)·E/ep)``.
    Returns the rows for this rank's experts, expert-major, and the :class:`Route`."""
    ep = dist.get_world_size(group)
    local = len(per_expert) // ep
    counts = per_expert.contiguous()
    send = counts.view(ep, local).sum(1).tolist()
    got = torch.empty_like(counts)
    comm.all_to_all(got, counts, group)  # block j: rank j's rows for each of my experts
    got = got.view(ep, local)
    recv = got.sum(1).tolist()
    x_recv = comm.AllToAll.apply(xs, group, recv, send)
    # Segment (source j, local expert e) starts where the rank-major layout puts it.
    starts = (torch.cumsum(got.flatten(), 0) - got.flatten()).view(ep, local)
    perm = [torch.arange(int(starts[j, e]), int(starts[j, e] + got[j, e]))
            for e in range(local) for j in range(ep)]
    perm = torch.cat(perm) if perm else torch.zeros(0, dtype=torch.long)
    route = Route(send, recv, got.sum(0).tolist(), torch.argsort(perm))
    return x_recv[perm], route


def combine(y_local: torch.Tensor, route: Route, group) -> torch.Tensor:
    """The expert outputs (expert-major, as :func:`dispatch` returned the inputs) back to the
    ranks they came from, in the order each rank sent them."""
    return comm.AllToAll.apply(y_local[route.inv], group, route.send, route.recv)


class ExpertDispatcher:
    """``MoE.dispatcher`` under expert parallelism, over ``group`` (this rank is ``ep_rank`` of
    ``ep``): :meth:`dispatch` sends each row to the rank holding its expert, the layer runs
    its own experts (global numbers from :attr:`first`), :meth:`combine` brings the outputs
    home. It counts the rows it sent to each rank (this rank's row of the token matrix)."""

    def __init__(self, group, ep_rank: int, ep: int, n_experts: int):
        self.group, self.ep_rank, self.ep = group, ep_rank, ep
        self.first = ep_rank * (n_experts // ep)
        self.sent = [0] * ep

    def dispatch(self, rows: torch.Tensor, per_expert: torch.Tensor):
        """-> (the rows for this rank's experts, expert-major; rows per local expert; the
        :class:`Route` that :meth:`combine` undoes)."""
        x_local, route = dispatch(rows, per_expert, self.group)
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            self.sent = [a + b for a, b in zip(self.sent, route.send)]
        return x_local, route.per_local, route

    def combine(self, y_local: torch.Tensor, route: Route) -> torch.Tensor:
        return combine(y_local, route, self.group)

    def take_traffic(self) -> torch.Tensor | None:
        """The ``[ep, ep]`` matrix of rows sent since the last call, this rank's row filled
        (a SUM over the group fills the others); None when nothing was sent."""
        if not any(self.sent):
            return None
        matrix = torch.zeros(self.ep, self.ep, dtype=torch.int64)
        matrix[self.ep_rank] = torch.tensor(self.sent, dtype=torch.int64)
        self.sent = [0] * self.ep
        return matrix
