"""``GradSync``: every gradient fix across mesh axes, and the one global gradient norm.

After reading this file you should understand what must happen to a rank's gradients after
its last micro-batch, and before the optimizer, for a 3D-parallel step to equal the serial
one (Megatron's ``finalize_model_grads``):

1. **data (and context) parallelism**: every dp replica saw other rows, every cp rank other
   tokens of the same rows, so gradients are summed over ``dp x cp`` and divided by it:
   DP's all-reduce (launched bucket by bucket during the last backward and awaited here) or
   ZeRO's reduce-scatter (each rank keeps its slice). **Experts** under expert parallelism
   are summed over the ranks that hold the same experts (``edp``) but divided by the same
   ``dp x cp``: the all-to-all already brought every rank's tokens of the ``ep`` group to
   them, so the two sums together cover all ``dp x cp`` ranks. Dividing by ``edp`` instead
   trains too, ``ep`` times too fast on the experts: a bug several frameworks shipped;
2. **sequence parallelism**: LayerNorm gains/biases and the row layers' biases saw only this
   rank's tokens, so their gradients are *partial*: summed over tp;
3. **tied embeddings under pipelining**: the first stage's ``tok_emb.weight`` and the last
   stage's ``lm_head.weight`` are copies of one matrix, each with half of its gradient:
   summed between the two stages (the "embed" group). Where one rank holds both stages (a
   V schedule puts them on rank 0) they are one tensor, whose gradient already has both.

Each is a sum, so their order does not change the result; Megatron finishes the dp
reduction first, like this code, and with ZeRO the tp and embed sums then run on the slices.

**The global norm** (for clipping) is the norm of the serial model's gradient. Each rank
adds the squares of the gradients it *owns*: its TP shards; a TP-replicated tensor on tp
index 0 only (counted t times it would be the classic wrong norm); the tied matrix on the
first stage only; under ZeRO its own slices. One all-reduce of that one number over the
ranks that hold distinct pieces (the model-parallel group, the whole world under ZeRO) gives
the total. Under expert parallelism the experts differ between ep ranks, so each number is
counted where it is owned once (dense on the first ``dp x cp`` rank, an expert on the first
of its ``edp`` ranks) and summed over the world. Under HSDP every replica group holds the same
slices (:mod:`edu3d.parallel.zero.hybrid`): the first group's count, or the norm would be
``sqrt(R)`` times too large. ``clip_grad_norm_`` cannot do this: it only sees what one rank
holds.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from edu3d.distributed import comm
from edu3d.parallel.parallelize import Parallel


class GradSync:
    """The cross-axis gradient fixes and the global norm for one rank's :class:`Parallel`."""

    def __init__(self, par: Parallel):
        self.par, self.mesh = par, par.mesh
        self.tp_index = self.mesh.index("tp")
        self.params = [p for p in par.module.parameters() if p.requires_grad]
        self.expert_params = {p for p in self.params if par.names[p] in par.experts}
        layout = self.mesh.layout
        # under EP, who counts a replicated number in the norm (see the module docstring)
        self.dense_owner = layout.ep == 1 or self.mesh.index("dpcp") == 0
        self.expert_owner = layout.ep == 1 or self.mesh.index("edp") == 0
        # under HSDP the replica groups hold equal slices: the first group's count
        self.first_replica = {experts: z is None or z.replica_index == 0
                              for experts, z in ((False, par.zero), (True, par.expert_zero))}

    # ---- during backward ----------------------------------------------------------------------
    def no_sync(self):
        """Around every backward but the last: DP accumulates locally (no communication);
        ZeRO-2/3 do what their ``grad_reduce`` says (:meth:`Zero.accumulating`: nothing to
        hold back when they reduce every micro-batch)."""
        stack = contextlib.ExitStack()
        for wrapper in self.par.wrappers:
            quiet = wrapper.accumulating() if wrapper in self.par.zeros else wrapper.no_sync()
            stack.enter_context(quiet)
        return stack

    def zero_grad(self) -> None:
        dps = [w for w in (self.par.dp, self.par.expert_dp) if w is not None]
        for w in dps:
            w.zero_grad(set_to_none=False)  # keep p.grad the bucket views: no copy
        if not dps:
            for p in self.params:
                p.grad = None
            for z in self.par.zeros:
                z.zero_grad()

    # ---- after the last backward ------------------------------------------------------------
    def held(self):
        """``(serial name, parameter, gradient this rank holds)``: full tensors, or slices
        of them under ZeRO."""
        if self.par.zeros:
            for z in self.par.zeros:
                for p, g in z.grad_pieces():
                    yield self.par.names[p], p, g
        else:
            for p in self.params:
                if p.grad is not None:
                    yield self.par.names[p], p, p.grad

    def _sum_over(self, grads: list[torch.Tensor], group) -> None:
        """Replace each of ``grads`` by its sum over ``group``: one flat all-reduce."""
        if not grads or group is None or dist.get_world_size(group) == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))

    def finish(self) -> None:
        """Make every gradient this rank holds the serial model's (its slice of it)."""
        for wrapper in self.par.wrappers:
            wrapper.finish()
        if self.par.partial:
            self._sum_over([g for n, _, g in self.held() if n in self.par.partial],
                           self.mesh.group("tp"))
        if self.par.tied is not None and not (self.par.is_first and self.par.is_last):
            self._sum_over([g for _, p, g in self.held() if p is self.par.tied],
                           self.mesh.group("embed"))

    def _owned(self, name: str, p) -> bool:
        if self.par.specs.get(name) is None and self.tp_index != 0:
            return False  # replicated over tp: counted on tp index 0 only
        if not self.par.zeros and not (self.expert_owner if p in self.expert_params
                                       else self.dense_owner):
            return False  # under EP without ZeRO: one replica of each counts
        if self.par.zeros and not self.first_replica[p in self.expert_params]:
            return False  # HSDP: another replica group counts this slice
        return not (p is self.par.tied and not self.par.is_first)  # tied copy: first stage

    def norm(self) -> torch.Tensor:
        """The serial model's total gradient norm (float32, the same on every rank)."""
        device = self.params[0].device if self.params else torch.device("cpu")
        sq = torch.zeros(1, dtype=torch.float64, device=device)
        owned = [g.detach() for name, p, g in self.held() if self._owned(name, p)]
        if owned:  # one kernel per step of the sum, not four per tensor
            sq += torch.stack(torch._foreach_norm(owned, 2, dtype=torch.float64)).square().sum()
        if self.par.zeros or self.mesh.layout.ep > 1:  # slices, experts: distinct pieces too
            comm.all_reduce(sq, None)
        elif self.mesh.size("mp") > 1:  # dp replicas hold equal gradients: tp x pp suffices
            comm.all_reduce(sq, self.mesh.group("mp"))
        return sq.sqrt().float()[0]

    def scale_(self, coef: torch.Tensor) -> None:
        """Multiply every gradient this rank holds by ``coef`` (clipping, unscaling)."""
        if self.par.zeros:
            for z in self.par.zeros:
                z.scale_(coef)
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device, grads[0].dtype))
