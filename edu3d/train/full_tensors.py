"""Full serial tensors put back together from any layout's pieces, for tests and charts.

After reading this file you should understand how the pieces of every layout add up to the
serial model's tensors, which is how a test compares a parallel run with the serial
reference and a chart shows a layout's gradients: each serial tensor by name, on every rank,
put together (:func:`gather`) from

* the ZeRO shards (every unit's full tensor, :meth:`~edu3d.parallel.zero.sharding.Zero.full_tensors`),
  or the tensors this rank holds;
* the tensor-parallel pieces, all-gathered over tp and joined
  (:func:`~edu3d.parallel.tp.layers.unshard`);
* the expert held whole by one rank of each expert-parallel group, broadcast over ep
  (:func:`expert_owner`);
* the pipeline stage that holds it, broadcast over pp
  (:func:`~edu3d.train.state_slots.owner_pp`).

It is collective and untraced: every rank calls it, and its traffic is no training's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.parallel.tp.layers import unshard
from edu3d.train.state_slots import owner_pp


@torch.no_grad()
def gather(par, mesh, schedule: str, n_experts: int, what: str = "grad") -> dict[str, torch.Tensor]:
    """Full serial tensors by serial name, ``"param"`` or ``"grad"`` (after a step or a
    forward and backward), on every rank. ``par``: the parallelized model
    (:func:`edu3d.parallel.parallelize.parallelize`), ``schedule`` its pipeline schedule's
    name, ``n_experts`` the model's routed experts per MoE layer."""
    if par.zeros:
        local = {par.names[p]: t for z in par.zeros for p, t in z.full_tensors(what).items()}
        local.update({par.names[p]: p.detach() if what == "param" else torch.zeros_like(p)
                      for p in par.module.parameters() if not p.requires_grad})  # frozen
    else:
        local = {}
        for p in par.module.parameters():
            t = p if what == "param" else p.grad
            local[par.names[p]] = torch.zeros_like(p) if t is None else t.detach()
    pp_index, tp = mesh.index("pp"), mesh.size("tp")
    out = {}
    for name, shape in par.shapes.items():
        owner = owner_pp(par, mesh, schedule, name)
        if name in par.experts:  # held whole by one rank of each expert-parallel group
            t = local[name].clone() if name in local else torch.empty(shape)
            src = expert_owner(name, n_experts, mesh.layout.ep)
            if owner == pp_index:
                dist.broadcast(t, mesh.ranks("ep")[src], group=mesh.group("ep"))
        elif owner == pp_index:
            t, spec = local[name], par.specs.get(name)
            if spec is not None and tp > 1:
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t.contiguous(), group=mesh.group("tp"))
                t = unshard(parts, *spec)
            t = t.clone()
        else:
            t = torch.empty(shape, dtype=next(iter(local.values())).dtype)
        if mesh.size("pp") > 1:
            dist.broadcast(t, mesh.ranks("pp")[owner], group=mesh.group("pp"))
        out[name] = t
    return out


def expert_owner(name: str, n_experts: int, ep: int) -> int:
    """The index, in its expert-parallel group, of the rank holding expert ``name``."""
    expert = int(name.split(".experts.")[1].split(".")[0])
    return expert // (n_experts // ep)
