"""What a ZeRO rank holds, and what the model would be whole.

After reading this file you should understand how to look at a sharded model from outside
(for tests, charts and parameter counts), where ``p.numel()`` and ``p.shape`` no longer tell
the truth:

* :func:`shapes` and :func:`numel`: every parameter's full shape and the model's size. Under
  ZeRO-3 a parameter is an empty ``(0,)`` tensor between forwards (FSDP's sharded parameters
  report their full shape through DTensor; edu3d's keep it in the unit's views);
* :func:`full_tensors`: the unsharded parameters (in their own dtype: the master copy under
  mixed precision) or averaged gradients, all-gathered from every rank's shard (collective,
  untraced: inspection, not training traffic);
* :func:`tensors`: the tensors this rank holds, by memory category (parameters, gradients,
  optimizer state with any master copy, host memory under offload), what
  :func:`edu3d.distributed.meter.measure` weighs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.parallel.zero.sharded_grads import ShardedGrad


def master_shard(u) -> torch.Tensor:
    """This rank's shard of unit ``u`` in the parameters' own dtype, on the shard's device
    (under mixed precision the master copy, otherwise the shard itself)."""
    if u.master_init is not None:
        return u.master_param.to(u.shard_param.device)
    return u.shard_param


def shapes(zero) -> dict[str, torch.Size]:
    """Every parameter of ``zero.model``'s full shape, by name."""
    full = {p: u.views[i].shape for u in zero.units for i, p in enumerate(u.params)}
    return {n: full.get(p, p.shape) for n, p in zero.model.named_parameters()}


def numel(zero) -> int:
    """The model's number of parameters at their full shapes."""
    return sum(shape.numel() for shape in shapes(zero).values())


def full_tensors(zero, what: str) -> dict:
    """Unsharded parameters (``"param"``) or averaged gradients (``"grad"``), keyed by
    parameter object."""
    out = {}
    for u in zero.units:
        shard = master_shard(u) if what == "param" else u.shard_grad
        parts = [torch.empty_like(shard) for _ in range(zero.n)]
        dist.all_gather(parts, shard.contiguous(), group=zero.group)
        flat = torch.cat(parts)
        for p, o, v in zip(u.params, u.offsets, u.views):
            out[p] = flat[o:o + v.numel()].view(v.shape).clone()
    return out


def tensors(zero) -> dict[str, list[torch.Tensor]]:
    """The tensors this rank holds, by memory category."""
    units = zero.units
    params = [u.flat_param for u in units] + [u.shard_param for u in units]
    grads = [p.grad for u in units for p in u.params
             if p.grad is not None and not isinstance(p.grad, ShardedGrad)]
    grads += [u.shard_grad for u in units]
    grads += [u.flat_grad for u in units if u.flat_grad is not None]
    state = [t for s in zero.optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)]
    masters = [t for u in units for t in (u.master_param, u.master_grad) if t is not None]
    masters += zero.whole.tensors() if zero.whole is not None else []
    if zero.offload:
        return {"params": params, "grads": grads, "optimizer": [], "host": state + masters}
    return {"params": params, "grads": grads, "optimizer": state + masters}
