"""ZeRO for optimizers that are not element-wise: each rank owns whole parameters.

After reading this file you should understand which optimizers can step a slice of a
parameter, and what ``ZeroRedundancyOptimizer`` does for the others:

* an **element-wise** optimizer (SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad,
  Adadelta, Rprop, ASGD) updates every number from that number's gradient and state alone,
  plus scalars shared by the whole tensor (the step count). Stepping views of a shard is
  exactly what it does on one process (:mod:`edu3d.parallel.zero.shard_optimizer`);
* others look at the whole tensor: Adafactor factors a matrix's second moment into row and
  column means, LAMB and LARS scale by ``‖p‖ / ‖update‖``, Muon orthogonalises the whole
  matrix, Shampoo preconditions by its Gram matrices. Given a slice they compute something
  else, even on one rank (a flat shard is a 1-D piece: Adafactor never factors it);
* so for those every parameter gets **one owner** (:func:`owners`: largest first, each to the
  rank that owns the fewest elements so far, ``ZeroRedundancyOptimizer``'s partition). The
  owner keeps a master copy of it and the optimizer's state; at the step it takes the full
  average gradient of each parameter it owns (the gradient shards all-gathered, or ZeRO-1's
  full average), steps, and broadcasts the updated parameter to the group, which copies it
  into the full parameters (stages 1-2) or into its shards (stage 3). The optimizer state is
  still about ``1/N`` per rank (by whole tensors, so only roughly balanced); the traffic is
  the gradients' reduction, an all-gather of them (Ψ) and the broadcasts (Ψ);
* LBFGS is refused: it searches along one direction of *all* parameters with a closure
  that re-evaluates the loss, so no rank can step its part alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.distributed import comm

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad,
               torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD)
SHARD_BY = ("element", "tensor")


def shard_mode(optimizer_class, shard_by: str | None, offload: bool, param_dtype) -> str:
    """``"element"`` (slices of a flat shard) or ``"tensor"`` (whole parameters per rank) for
    ``optimizer_class``; ``shard_by`` overrides the choice by class (a custom element-wise
    optimizer, or ``"tensor"`` to match ``ZeroRedundancyOptimizer`` exactly)."""
    if optimizer_class is torch.optim.LBFGS:
        raise ValueError("LBFGS cannot be sharded: its line search moves all parameters along "
                         "one direction at once and re-evaluates the loss through a closure; "
                         "use it without ZeRO, or choose another optimizer")
    if shard_by is not None and shard_by not in SHARD_BY:
        raise ValueError(f"shard_by={shard_by!r} is not one of {SHARD_BY}")
    mode = shard_by or ("element" if optimizer_class in ELEMENTWISE else "tensor")
    if mode == "tensor" and (offload or param_dtype is not None):
        what = "offload=True" if offload else f"param_dtype={param_dtype}"
        raise ValueError(f"{optimizer_class.__name__} is not element-wise, so Zero shards it by "
                         f"whole parameters, which does not support {what} yet: use an "
                         "element-wise optimizer (SGD, Adam, AdamW, ...) or leave it out")
    return mode


def owners(params: list, n: int) -> dict:
    """``{param: rank}``: the largest parameter first, each to the rank owning the fewest
    elements so far (the lowest rank on a tie); the same on every rank."""
    load = [0] * n
    out = {}
    for p in sorted(params, key=lambda q: -q.numel()):  # stable: ties keep model order
        r = min(range(n), key=lambda k: (load[k], k))
        out[p] = r
        load[r] += p.numel()
    return out


class WholeTensors:
    """The optimizer of a :class:`~edu3d.parallel.zero.sharding.Zero` over the whole
    parameters this rank owns; ``originals`` are their values before any sharding."""

    def __init__(self, zero, groups: list[dict], optimizer_class, defaults: dict,
                 originals: dict):
        self.zero = zero
        self.owner = owners([p for u in zero.units for p in u.params], zero.n)
        self.masters = {p: torch.nn.Parameter(originals[p], requires_grad=False)
                        for p in originals if self.owner[p] == zero.index}
        self.ranks = dist.get_process_group_ranks(zero.group) if zero.group is not None \
            else list(range(zero.n))
        self.optimizer = optimizer_class(
            [{**{k: v for k, v in g.items() if k != "params"},
              "params": [self.masters[p] for p in g["params"] if p in self.masters]}
             for g in groups], **defaults)
        self.param_of = {id(m): p for p, m in self.masters.items()}

    def pieces(self) -> list[tuple]:
        """``(param, 0, numel)`` per parameter the optimizer steps, in its own order."""
        return [(self.param_of[id(m)], 0, m.numel())
                for g in self.optimizer.param_groups for m in g["params"]]

    def tensors(self) -> list[torch.Tensor]:
        return [t for m in self.masters.values() for t in (m, m.grad) if t is not None]

    def _average_grad(self, u) -> torch.Tensor:
        """Unit ``u``'s full average gradient, end to end (padded)."""
        if not self.zero.reduce_scatter:
            return u.flat_grad  # ZeRO-1's all-reduce left it whole
        flat = torch.empty(u.padded, dtype=u.shard_grad.dtype, device=u.shard_grad.device)
        comm.all_gather(flat, u.shard_grad.contiguous(), self.zero.group)
        return flat

    @torch.no_grad()
    def step(self) -> None:
        """The owners step their parameters; every rank receives the results."""
        zero = self.zero
        for u in zero.units:
            if not any(p in self.masters for p in u.params) and not zero.reduce_scatter:
                continue
            flat = self._average_grad(u)  # collective when reduce-scattered: every rank
            for p, o, size in zip(u.params, u.offsets, u.sizes):
                m = self.masters.get(p)
                if m is None:
                    continue
                if p not in zero.stepped:
                    m.grad = None  # no rank used it: torch skips it
                    continue
                m.grad = flat[o:o + size].view(m.shape).to(m.dtype, copy=True)
        self.optimizer.step()
        for m in self.masters.values():
            m.grad = None
        for u in zero.units:
            self._share(u)

    def _share(self, u) -> None:
        """Broadcast each owner's updated parameters of unit ``u`` into every rank's copy."""
        zero = self.zero
        freed = zero.gathering is not None and not u.gathered
        if freed and u.pending is not None:
            zero.gathering.gather(u)
            freed = False
        if freed:
            u.regrow()
            u.flat_param.zero_()  # the padding stays zero
        for r in range(zero.n):
            mine = [(o, size, p) for p, o, size in zip(u.params, u.offsets, u.sizes)
                    if self.owner[p] == r]
            if not mine:
                continue
            if r == zero.index:
                buf = torch.cat([self.masters[p].reshape(-1) for _, _, p in mine])
            else:
                buf = torch.empty(sum(size for _, size, _ in mine), dtype=u.flat_param.dtype,
                                  device=u.flat_param.device)
            comm.broadcast(buf, self.ranks[r], zero.group)
            for (o, size, _), piece in zip(mine, buf.split([size for _, size, _ in mine])):
                u.flat_param[o:o + size].copy_(piece)
        if zero.gathering is not None:
            u.shard_param.copy_(u.flat_param[u.lo:u.hi])
        if freed:
            u.free()

    def full_state(self) -> dict:
        """``{name: {key: value}}``: the state of the parameters this rank owns."""
        state = self.optimizer.state
        return {self.zero.names[p]: {k: v.clone() if isinstance(v, torch.Tensor) else v
                                     for k, v in state.get(m, {}).items()}
                for p, m in self.masters.items() if state.get(m)}
