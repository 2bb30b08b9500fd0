"""Reading gradients under ZeRO: what ``p.grad`` holds after ``finish()``, and clipping.

After reading this file you should understand why ``torch.nn.utils.clip_grad_norm_`` cannot
clip a sharded model, and what replaces it:

* ZeRO-1 (all-reduce, :class:`~edu3d.parallel.zero.sharding.Zero`'s default): every ``p.grad``
  is the full average gradient, as under DDP + ``ZeroRedundancyOptimizer``; whatever torch
  does with it is right (its norm is the global one, the same on every rank);
* ZeRO-2/3, and ZeRO-1 with ``reduce_scatter=True``, keep only this rank's slice of each
  gradient. ``clip_grad_norm_`` sums the squares of what it sees: nothing (``p.grad is
  None``: norm 0, nothing clipped) or a slice (a different norm on every rank). So after
  ``finish()`` such a ``p.grad`` is a :class:`ShardedGrad`: a placeholder with the
  parameter's shape that holds no numbers (one element, expanded) and refuses every torch
  operation with a message that names the cure. FSDP2 answers with DTensor gradients whose
  norm is a collective; edu3d's shards cut parameters anywhere in a flat buffer, so it
  refuses rather than guess. The placeholder goes away at the step, at ``zero_grad`` and
  before the next gradient accumulates;
* :func:`global_norm` is the norm of the whole average gradient: each rank sums ``|g|^p``
  over its slices, one all-reduce adds the sums (the largest ``|g|`` for ``inf``), and the
  root is taken: what FSDP's ``clip_grad_norm_`` returns. :func:`clip_coefficient` is torch's
  ``max_norm / (norm + 1e-6)``, at most 1, by which every rank scales its slices.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from edu3d.distributed import comm

REFUSAL = ("this gradient is sharded by edu3d's Zero (ZeRO-2/3, or ZeRO-1 with "
           "reduce_scatter=True): this rank holds only its slice, so torch cannot read it (a "
           "norm of it would be a slice's). Clip with zero.clip_grad_norm_(max_norm), which "
           "returns the global norm; read it with zero.full_tensors('grad') (collective)")


class ShardedGrad(torch.Tensor):
    """``p.grad`` of a parameter whose average lives in the shards: refuses every use."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(REFUSAL)


def placeholder(p: torch.Tensor) -> ShardedGrad:
    """A :class:`ShardedGrad` that ``p.grad`` accepts: ``p``'s shape, dtype and device, one
    element of memory."""
    one = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
    return torch.Tensor._make_subclass(ShardedGrad, one)


def global_norm(slices: list[torch.Tensor], group, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of the gradient whose disjoint ``slices`` the ranks of ``group``
    hold (one all-reduce), in float64, the same on every rank."""
    device = slices[0].device if slices else torch.device("cpu")
    if math.isinf(norm_type):  # the largest of every rank's largest (edu3d reduces only SUM)
        local = max((float(s.detach().abs().max()) for s in slices if s.numel()), default=0.0)
        mine = torch.tensor([local], dtype=torch.float64, device=device)
        every = torch.empty(dist.get_world_size(group), dtype=torch.float64, device=device)
        comm.all_gather(every, mine, group)
        return every.max()
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for s in slices:
        total += s.detach().double().abs().pow(norm_type).sum()
    comm.all_reduce(total, group)
    return total[0].pow(1.0 / norm_type)


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clipping factor: ``max_norm / (total + 1e-6)``, clamped to at most 1."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def clip(zero, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    """``zero.clip_grad_norm_``: the global norm of ``zero``'s averaged gradients (after
    ``finish()``), returned, and every rank's slices scaled by :func:`clip_coefficient`."""
    if not zero.finished:
        raise RuntimeError("zero.clip_grad_norm_() before zero.finish(): call zero.finish() "
                           "after the last backward, then clip, then zero.step()")
    total = global_norm([g for _, g in zero.grad_pieces()], zero.group, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           "non-finite, so it cannot be clipped (error_if_nonfinite=True)")
    zero.scale_(clip_coefficient(total, max_norm))
    return total.to(zero.units[0].dtype if zero.units else torch.float32)
