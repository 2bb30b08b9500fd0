"""Same start on every rank: parameters and buffers copied from the group's first rank.

After reading this file you should understand why a data-parallel wrapper broadcasts before
it trains, and what (torch DDP's ``_sync_module_states``):

* every rank builds its own copy of the model, and a script that seeds each rank differently
  (or not at all) builds different weights. Averaged gradients keep equal weights equal; they
  never make different weights equal. So at wrap time **every** parameter is broadcast from
  the group's first rank, the frozen ones included: a frozen random projection trains nothing,
  but every forward uses it, and a copy that differs per rank differs for ever
  (:func:`broadcast_parameters`);
* **buffers** (BatchNorm's running statistics, a random mask) are broadcast then too, one
  message per dtype (:func:`broadcast_buffers`);
* buffers can also drift apart *during* training: each rank's running statistics see only
  its own rows. :class:`BufferSync` broadcasts them again before each forward that follows
  one that synchronised gradients: torch DDP's ``broadcast_buffers=True`` (its default).
  FSDP2 never does (each rank keeps its own statistics); ``Zero`` follows FSDP2 by default
  and offers the same flag.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.distributed import comm


def first_rank(group) -> int:
    """The global rank every broadcast of ``group`` copies from."""
    return dist.get_process_group_ranks(group)[0] if group is not None else 0


@torch.no_grad()
def broadcast_parameters(params, group) -> None:
    """Copy the group's first rank's ``params`` (frozen ones too) to every rank, one
    broadcast per parameter."""
    for p in params:
        comm.broadcast(p.data, first_rank(group), group)


@torch.no_grad()
def broadcast_buffers(model: torch.nn.Module, group) -> None:
    """Copy the group's first rank's buffers of ``model`` to every rank, one broadcast per
    dtype (the buffers are looked up each time: a module may have replaced one)."""
    kinds: dict = {}
    for b in model.buffers():
        kinds.setdefault((b.dtype, b.device), []).append(b)
    for bufs in kinds.values():
        flat = torch.cat([b.reshape(-1) for b in bufs])
        comm.broadcast(flat, first_rank(group), group)
        for b, piece in zip(bufs, flat.split([b.numel() for b in bufs])):
            b.copy_(piece.view_as(b))


class BufferSync:
    """Broadcasts ``model``'s buffers before each forward that follows a synchronising one
    (torch DDP's ``require_forward_param_sync``): a forward with gradients enabled while
    ``synchronising()`` is true (outside ``no_sync``). The first forward broadcasts too."""

    def __init__(self, model: torch.nn.Module, group, synchronising):
        self.model, self.group, self.synchronising = model, group, synchronising
        self.next = True
        self.handles = [model.register_forward_pre_hook(self._before_forward),
                        model.register_forward_hook(self._after_forward)]

    def _before_forward(self, module, args) -> None:
        if self.next:
            broadcast_buffers(self.model, self.group)

    def _after_forward(self, module, args, output) -> None:
        self.next = torch.is_grad_enabled() and self.synchronising()
