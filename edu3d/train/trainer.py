"""One ``Trainer``: the training step of every layout, serial included.

After reading this file you should understand that a 3D-parallel step is the serial step
with four things added, and nothing else:

1. **the batch is cut** (:func:`edu3d.train.cut.cut`): each dp replica takes its rows of
   the global batch (each cp rank of it its pieces of those rows' sequences), and cuts them
   into ``m`` micro-batches;
2. **the micro-batches run through a pipeline schedule**. With one stage (pp = 1) the
   schedule is plain gradient accumulation (``F0 B0 F1 B1 ...``), so there is no separate
   code path for it. Every backward but each stage's last runs without dp communication
   (``no_sync``): gradients accumulate locally and are reduced once;
3. **gradients are fixed across axes, once** (:class:`~edu3d.parallel.grads.GradSync`):
   dp's all-reduce or ZeRO's reduce-scatter, sequence parallelism's partial gradients over
   tp, the tied embedding between the first and the last stage;
4. **the global norm** of the serial model's gradient comes from the pieces each rank owns;
   every rank clips by it, sets the learning rate and steps (ZeRO-1/2 then all-gather).

The loss printed is the global batch's mean, as the serial run prints it: it lives on the
last stage, which sums its micro-batches' losses; an untraced all-reduce of that one number
gives every rank the mean.

A mixture of experts adds bookkeeping, not mechanics: each micro-batch's load-balancing
terms reach backward scaled like its loss (:func:`edu3d.model.moe.set_aux_scale`), and after
the step the routers' counts are summed over every rank (:mod:`edu3d.train.moe_stats`) for the
record and for DeepSeek-V3's bias balancing.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from edu3d.model.gpt import set_attention
from edu3d.model.balance import set_aux_scale
from edu3d.model.moe import MoE
from edu3d.distributed import trace
from edu3d.train import full_tensors, state_slots
from edu3d.train.cut import cut
from edu3d.train.moe_stats import router_stats
from edu3d.config.layout import Layout
from edu3d.distributed.mesh import Mesh
from edu3d.train.optim import (clip_coef, lr_at, make_optimizer, optimizer_kwargs,
                               param_groups, set_lr)
from edu3d.config.sections import Run
from edu3d.train.step_stats import StepMeter
from edu3d.parallel.fp8 import end_step
from edu3d.parallel.grads import GradSync
from edu3d.parallel.parallelize import parallelize
from edu3d.parallel.pp.engine import PipelineEngine, scaled_loss
from edu3d.parallel.precision import MixedPrecision
from edu3d.schedules.actions import placement


class Trainer:
    """Trains this rank's piece of ``model`` on ``mesh``'s layout as ``run`` describes it
    (:class:`~edu3d.config.sections.Run`).

    ``model`` is the full serial GPT, built from the same config and seed on every rank;
    ``mesh`` is ``None`` for one process. ``step(x, y, step)`` takes the *global* batch and
    returns ``{"loss", "grad_norm"}`` exactly as the serial loop records them.

    For the course: ``compute`` (per-rank compute actions, e.g. a learner's schedule)
    replaces the named schedule's, and ``microbatch_loss(loss, m)`` what each micro-batch
    back-propagates (default ``loss / m``).
    """

    def __init__(self, model: torch.nn.Module, mesh: Mesh | None, run: Run, *,
                 compute=None, microbatch_loss=None):
        self.mesh = mesh if mesh is not None else Mesh(Layout(), 0, {})
        self.run = run
        set_attention(model, run.precision.attn)
        self.par = parallelize(model, self.mesh, run, self._shard_optimizer, compute)
        self.grads = GradSync(self.par)
        self.device = device = next(model.parameters()).device
        if device.type == "cuda":  # TF32 tensor cores for fp32 matmuls (Ampere and later)
            torch.backends.cuda.matmul.allow_tf32 = not run.precision.no_tf32
            torch.backends.cudnn.allow_tf32 = not run.precision.no_tf32
        self.precision = MixedPrecision(run.precision.dtype, device.type,
                                   world=self.mesh.layout.world_size > 1)
        self._microbatch_loss = microbatch_loss or scaled_loss
        self.engine = PipelineEngine(self.par.stages, self.par.actions, self.par.n_stages,
                                     self.mesh.ranks("pp"), self.mesh.groups.get("pp"),
                                     run.microbatches, self._scaled, self._context,
                                     placement(run.parallel.schedule))
        self.optimizer = None if self.par.zeros else make_optimizer(self.par.module, run)
        self.dp_size, self.dp_index = self.mesh.size("dp"), self.mesh.index("dp")
        self.cp_size = self.mesh.layout.cp
        self.meter = StepMeter(self.tensors, self.mesh.layout.world_size)
        self.config = config = model.config
        self.moe_layers = [i for i in range(config.n_layers) if config.is_moe_layer(i)]
        self.moe = {int(name.split(".")[-2]): m for name, m in self.par.module.named_modules()
                    if isinstance(m, MoE)}  # serial layer number -> this rank's MoE layer
        # --aux-scope global: micro-batch j of the step is the serial run's micro-batch j,
        # shared out over the data ranks, so its balance statistics are the serial ones
        self._global_balance = bool(self.moe_layers) and config.aux_scope == "global"

    def _shard_optimizer(self, params: list) -> dict:
        """ZeRO's optimizer for ``params``: this run's rule, decay on matrices only."""
        return {**optimizer_kwargs(self.run),
                "params": param_groups(params, self.run.training.weight_decay)}

    # ---- the schedule's hooks -----------------------------------------------------------------
    def _scaled(self, loss: torch.Tensor, m: int) -> torch.Tensor:
        if m == 1 and self._microbatch_loss is scaled_loss:  # loss / 1: skip the operation
            return self.precision.scale_loss(loss)
        return self.precision.scale_loss(self._microbatch_loss(loss, m))

    def _context(self, action, last: bool):
        """Around each compute action: autocast for forwards; ``no_sync`` for every backward
        but a stage's last; ZeRO-3 per step keeps units gathered until a stage's last
        forward. After it, the memory held is sampled (the step's peak, :meth:`stats`)."""
        stack = contextlib.ExitStack()
        stack.callback(self.meter.sample)
        if action.kind == "F":
            stack.enter_context(self.precision.autocast())
            if self.par.offload is not None:  # its blocks: one chain, prefetched in backward
                stack.enter_context(self.par.offload.chain())
            if not last:
                for z in self.par.zeros:
                    stack.enter_context(z.accumulating(forward=True))
        elif action.kind == "I" or not last:
            stack.enter_context(self.grads.no_sync())
        return stack

    # ---- the step -------------------------------------------------------------------------------
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradients of the global batch's mean loss (each rank its pieces, fixed across
        axes); returns that loss, the same on every rank."""
        m = self.run.microbatches
        batch = cut(x, y, m, dp_index=self.dp_index, dp_size=self.dp_size,
                    cp_rank=self.mesh.index("cp"), cp_size=self.cp_size,
                    split=self.run.parallel.cp_split, device=self.device,
                    share_each=self._global_balance)
        if self.moe:  # the balancing terms reach backward scaled like the loss
            set_aux_scale(float(self.precision.scale) / m)
        self.grads.zero_grad()
        losses = self.engine.run(batch)
        self.grads.finish()
        end_step(self.par.module, [self.mesh.groups.get(d) for d in ("tp", "dpcp")])  # fp8
        return self._global_loss(losses, self.device)

    def _global_loss(self, losses: list, device) -> torch.Tensor:
        if self.mesh.layout.world_size == 1 and len(losses) == 1:  # serial: nothing to add
            return losses[0]
        mine = self.par.is_last and self.mesh.index("tp") == 0 and losses
        total = torch.stack(losses).sum().reshape(1) if mine else torch.zeros(1, device=device)
        if self.mesh.layout.world_size > 1:  # a serial trainer inside a launch stays alone
            dist.all_reduce(total)  # bookkeeping, not training traffic: left out of the trace
        return total[0] / (self.dp_size * self.cp_size * self.run.microbatches)

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int, read: bool = True) -> dict:
        """One optimizer step on the global batch ``(x, y)``. ``read=False`` leaves
        ``loss`` and ``grad_norm`` as tensors on the device: reading a number waits for the
        device to finish (a host synchronisation), so the loop reads them only at the steps
        it logs (``--log-every``)."""
        rec = trace.current()
        with rec.context(step=step):
            loss = self.forward_backward(x, y)
            with rec.span("compute", "optimizer"):
                scale = self.precision.scale
                scaled_norm = self.grads.norm()
                skip = self.precision.update(scaled_norm)
                norm = scaled_norm / scale if scale != 1.0 else scaled_norm
                if not skip:
                    coef = clip_coef(norm, self.run.training.clip)
                    self.grads.scale_(coef / scale if scale != 1.0 else coef)
                    self._update(lr_at(step, self.run))
        self.meter.step_done()
        out = {"loss": loss.detach(), "grad_norm": norm.detach()}
        if read:
            out = {k: v.item() for k, v in out.items()}
        if self.moe_layers:
            out.update(self.moe_step())
        if self.precision.mode == "fp16":
            out.update(skipped=skip, loss_scale=scale)
        return out

    def moe_step(self) -> dict:
        """After a step: the routers' statistics summed over every rank (collective), for the
        record, and DeepSeek-V3's bias update from the step's global counts
        (:func:`edu3d.train.moe_stats.router_stats` says what each number is)."""
        return router_stats(self.moe, self.moe_layers, self.config, self.mesh)

    def _update(self, lr: float) -> None:
        if self.par.zeros:
            for z in self.par.zeros:
                z.step(lr)
        elif self.optimizer is not None:
            set_lr(self.optimizer, lr)
            self.optimizer.step()

    # ---- inspection -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """What ``edu3d train --json`` adds to each record; collective (every rank calls).
        Since the last call (:class:`~edu3d.train.step_stats.StepMeter`): ``mem_bytes``, the
        fullest rank's peak bytes by category (parameters, gradients, optimizer state held
        between compute actions; the activations its pipeline engine kept); ``comm_s``, this
        rank's seconds some collective of each group covered (``exposed_s``: with no compute
        beside it; ``comm_any_s``: any group's); ``wire_bytes``, bytes sent per step by
        collective kind."""
        return self.meter.read(self.engine.peak_activation_bytes)

    # ---- checkpoints ----------------------------------------------------------------------------
    def checkpoint_slots(self) -> list[tuple[dict, torch.Tensor, bool]]:
        """Every piece of training state this rank holds, as ``(placement, view, owned)``
        (:func:`edu3d.train.state_slots.checkpoint_slots`: where each sits in the serial
        model, and who writes it)."""
        return state_slots.checkpoint_slots(self.par, self.mesh, self.optimizer,
                                            self.run.parallel.schedule)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return state_slots.optimizers(self.par, self.optimizer)

    @property
    def optimizer_step(self) -> int:
        """How many updates the optimizer's state has seen (AdamW's bias correction)."""
        return state_slots.optimizer_step(self._optimizers())

    @optimizer_step.setter
    def optimizer_step(self, n: int) -> None:
        state_slots.set_optimizer_step(self._optimizers(), n)

    def gather(self, what: str = "grad") -> dict[str, torch.Tensor]:
        """Full serial tensors by serial name, ``"param"`` or ``"grad"`` (after a step or
        :meth:`forward_backward`), on every rank (:func:`edu3d.train.full_tensors.gather`).
        Collective and untraced: for tests and charts, not for training."""
        return full_tensors.gather(self.par, self.mesh, self.run.parallel.schedule,
                                   self.config.n_experts, what)

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by memory category (see :func:`edu3d.distributed.meter.measure`)."""
        if self.par.zeros:
            out: dict[str, list] = {}
            for z in self.par.zeros:
                for k, v in z.tensors().items():
                    out.setdefault(k, []).extend(v)
            frozen = [p for p in self.par.module.parameters() if not p.requires_grad]
            return {**out, "params": out.get("params", []) + frozen}  # frozen: whole, in no unit
        params = list(self.par.module.parameters())
        grads = [b.buffer for dp in (self.par.dp, self.par.expert_dp) if dp is not None
                 for b in dp.buckets]
        grads += [p.grad for p in params if p.grad is not None]
        state = [] if self.optimizer is None else [
            t for s in self.optimizer.state.values() for t in s.values()
            if isinstance(t, torch.Tensor)]
        return {"params": params, "grads": grads, "optimizer": state}
