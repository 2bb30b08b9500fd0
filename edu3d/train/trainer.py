"""One ``Trainer``: the training step of every layout, serial included.

After reading this file you should understand that a 3D-parallel step is the serial step
with four things added, and nothing else:

1. **the batch is cut**: each dp replica takes its rows of the global batch, and cuts them
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
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from edu3d.ckpt import reshard
from edu3d.distributed import meter, trace
from edu3d.train.data import microbatches, shard_rows
from edu3d.distributed.mesh import Layout, Mesh
from edu3d.train.optim import clip_coef, lr_at, make_optimizer, optimizer_for, set_lr
from edu3d.train.options import TrainOptions
from edu3d.parallel.grads import GradSync
from edu3d.parallel.optim_state import adam_state
from edu3d.parallel.parallelize import Plan, parallelize
from edu3d.parallel.pp.engine import PipelineEngine, scaled_loss
from edu3d.parallel.precision import Precision
from edu3d.parallel.tp.layers import unshard


def plan_from(options: TrainOptions) -> Plan:
    """How :func:`~edu3d.parallel.parallelize.parallelize` cuts the model, from ``edu3d
    train``'s options (a pipeline's default: pp micro-batches)."""
    o = options
    return Plan(sequence_parallel=o.sp, tp_overlap=o.tp_overlap, schedule=o.schedule,
                microbatches=o.microbatches or o.grad_accum or o.pp, vpp=o.vpp,
                partition=o.partition, zero=o.zero, dp_impl=o.dp_impl, bucket_mb=o.bucket_mb,
                reverse_buckets=o.reverse_buckets, prefetch=o.prefetch, offload=o.offload,
                compress=o.compress, recompute=o.recompute)


class Trainer:
    """Trains this rank's piece of ``model`` on ``mesh``'s layout with ``args``' options
    (:class:`~edu3d.train.options.TrainOptions`).

    ``model`` is the full serial GPT, built from the same config and seed on every rank;
    ``mesh`` is ``None`` for one process. ``step(x, y, step)`` takes the *global* batch and
    returns ``{"loss", "grad_norm"}`` exactly as the serial loop records them.

    For the course: ``compute`` (per-rank compute actions, e.g. a learner's schedule)
    replaces the named schedule's, and ``microbatch_loss(loss, m)`` what each micro-batch
    back-propagates (default ``loss / m``).
    """

    def __init__(self, model: torch.nn.Module, mesh: Mesh | None, args: TrainOptions, *,
                 compute=None, microbatch_loss=None):
        self.mesh = mesh if mesh is not None else Mesh(Layout(), 0, {})
        self.args, self.plan = args, plan_from(args)
        self.par = parallelize(model, self.mesh, self.plan, self._shard_optimizer, compute)
        self.grads = GradSync(self.par)
        device = next(model.parameters()).device
        self.precision = Precision(args.precision, device.type,
                                   world=self.mesh.layout.world_size > 1)
        self._microbatch_loss = microbatch_loss or scaled_loss
        self.engine = PipelineEngine(self.par.stages, self.par.actions, self.par.n_stages,
                                     self.mesh.ranks("pp"), self.mesh.groups.get("pp"),
                                     self.plan.microbatches, self._scaled, self._context)
        self.optimizer = None if self.par.zero else make_optimizer(self.par.module, args)
        self.dp_size, self.dp_index = self.mesh.size("dp"), self.mesh.index("dp")
        self._comm_seen: dict[str, float] = {}

    def _shard_optimizer(self, decay: list, no_decay: list):
        """ZeRO's optimizer over its shard's pieces: this run's rule and weight decay."""
        return optimizer_for([{"params": decay, "weight_decay": self.args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], self.args)

    # ---- the schedule's hooks -----------------------------------------------------------------
    def _scaled(self, loss: torch.Tensor, m: int) -> torch.Tensor:
        return self.precision.scale_loss(self._microbatch_loss(loss, m))

    def _context(self, action, last: bool):
        """Around each compute action: autocast for forwards; ``no_sync`` for every backward
        but a stage's last; ZeRO-3 keeps units gathered until a stage's last forward."""
        stack = contextlib.ExitStack()
        if action.kind == "F":
            stack.enter_context(self.precision.autocast())
            if self.par.zero is not None and not last:
                stack.enter_context(self.par.zero.keep_gathered())
        elif action.kind == "I" or not last:
            stack.enter_context(self.grads.no_sync())
        return stack

    # ---- the step -------------------------------------------------------------------------------
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradients of the global batch's mean loss (each rank its pieces, fixed across
        axes); returns that loss, the same on every rank."""
        xs = shard_rows(x, self.dp_index, self.dp_size)
        ys = shard_rows(y, self.dp_index, self.dp_size)
        self.grads.zero_grad()
        losses = self.engine.run(microbatches(xs, ys, self.plan.microbatches))
        self.grads.finish()
        return self._global_loss(losses, xs.device)

    def _global_loss(self, losses: list, device) -> torch.Tensor:
        mine = self.par.is_last and self.mesh.index("tp") == 0 and losses
        total = torch.stack(losses).sum().reshape(1) if mine else torch.zeros(1, device=device)
        if self.mesh.layout.world_size > 1:  # a serial trainer inside a launch stays alone
            dist.all_reduce(total)  # bookkeeping, not training traffic: left out of the trace
        return total[0] / (self.dp_size * self.plan.microbatches)

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> dict:
        """One optimizer step on the global batch ``(x, y)``."""
        rec = trace.current()
        with rec.context(step=step):
            loss = self.forward_backward(x, y)
            with rec.span("compute", "optimizer"):
                scale = self.precision.scale
                scaled_norm = self.grads.norm()
                skip = self.precision.update(scaled_norm)
                norm = scaled_norm / scale
                if not skip:
                    self.grads.scale_(clip_coef(norm, self.args.clip) / scale)
                    self._update(lr_at(step, self.args))
        out = {"loss": loss.item(), "grad_norm": norm.item()}
        if self.precision.mode == "fp16":
            out.update(skipped=skip, loss_scale=scale)
        return out

    def _update(self, lr: float) -> None:
        if self.par.zero is not None:
            self.par.zero.step(lr)
        elif self.optimizer is not None:
            set_lr(self.optimizer, lr)
            self.optimizer.step()

    # ---- inspection -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """What ``edu3d train --json`` adds to each record; collective (every rank calls).

        ``mem_bytes``: the bytes of the fullest rank (largest total) by category: parameters,
        gradients and optimizer state measured from the tensors it holds, and the peak of the
        activations its pipeline engine kept. ``comm_s``: this rank's seconds in communication
        since the last call, by group (``tp``, ``pp``, ``dp``, ...), from the trace: each
        collective from its start to its completion (an overlapped one counts whole)."""
        held = meter.measure(self.tensors())
        row = torch.tensor([held["params"], held["grads"], held["optimizer"],
                            self.engine.peak_activation_bytes], dtype=torch.float64)
        if self.mesh.layout.world_size > 1:  # bookkeeping: left out of the trace
            rows = [torch.empty_like(row) for _ in range(self.mesh.layout.world_size)]
            dist.all_gather(rows, row)
            row = max(rows, key=lambda r: float(r.sum()))
        mem = dict(zip(("params", "grads", "optimizer", "activations"), map(int, row.tolist())))
        mem["total"] = sum(mem.values())
        now = dict(trace.current().comm_us)
        comm = {g: (t - self._comm_seen.get(g, 0.0)) / 1e6 for g, t in now.items()}
        self._comm_seen = now
        return {"mem_bytes": mem, "comm_s": {g: round(s, 6) for g, s in comm.items() if s}}

    # ---- checkpoints ----------------------------------------------------------------------------
    def checkpoint_slots(self) -> list[tuple[dict, torch.Tensor, bool]]:
        """Every piece of training state this rank holds, as ``(placement, view, owned)``:
        the placement in the full serial tensor (:mod:`edu3d.ckpt.reshard`), a 1-D view of the
        numbers here (write into it to load), and whether this rank is the piece's one writer.
        Parameters and AdamW's moments; ZeRO: the shard's pieces. One owner per number: a
        TP-replicated tensor is written by tp index 0, a dp replica by dp index 0, the tied
        embedding's copy on the last stage by the first stage only."""
        par, mesh = self.par, self.mesh
        tp_i, tp_n, pp_i = mesh.index("tp"), mesh.size("tp"), mesh.index("pp")
        slots = []

        def add(p, kind, view, window, owned):
            name = par.names[p]
            owned = owned and (par.specs.get(name) is not None or tp_i == 0) \
                and self._owner_pp(name) == pp_i
            start = window[0] if window else 0
            for place, s, e in reshard.pieces(name, kind, par.shapes[name], par.specs.get(name),
                                              tp_i, tp_n, window):
                slots.append((place, view[s - start:e - start], owned))

        if par.zero is None:
            adam = isinstance(self.optimizer, torch.optim.AdamW)
            for p in par.module.parameters():
                add(p, "param", p.data.view(-1), None, self.dp_index == 0)
                if adam:
                    state = adam_state(self.optimizer, p)
                    for kind in ("exp_avg", "exp_avg_sq"):
                        add(p, kind, state[kind].view(-1), None, self.dp_index == 0)
            return slots
        for p, a, b, views in par.zero.state_pieces():
            for kind, view, owned in views:
                add(p, kind, view, (a, b), owned)
        if par.zero.stage < 3:  # the full parameters every rank keeps: loaded, never written
            for p in par.module.parameters():
                add(p, "param", p.data.view(-1), None, False)
        return slots

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        opt = self.par.zero.optimizer if self.par.zero is not None else self.optimizer
        return [] if opt is None else [opt]

    @property
    def optimizer_step(self) -> int:
        """How many updates the optimizer's state has seen (AdamW's bias correction)."""
        for opt in self._optimizers():
            for state in opt.state.values():
                if "step" in state:
                    return int(state["step"])
        return 0

    @optimizer_step.setter
    def optimizer_step(self, n: int) -> None:
        for opt in self._optimizers():
            for state in opt.state.values():
                if "step" in state:
                    state["step"].fill_(float(n))

    def _owner_pp(self, name: str) -> int:
        """The pipeline rank holding serial parameter ``name`` (the first stage for the
        tied matrix)."""
        if name.startswith("blocks."):
            layer = int(name.split(".")[1])
            stage = next(s for s, (a, b) in enumerate(self.par.parts) if a <= layer < b)
        else:
            stage = self.par.n_stages - 1 if name.startswith(("ln_f", "lm_head")) else 0
        return stage % self.mesh.layout.pp

    @torch.no_grad()
    def gather(self, what: str = "grad") -> dict[str, torch.Tensor]:
        """Full serial tensors by serial name, ``"param"`` or ``"grad"`` (after a step or
        :meth:`forward_backward`), on every rank. Collective and untraced: for tests and
        charts, not for training."""
        par, mesh = self.par, self.mesh
        if par.zero is not None:
            local = {par.names[p]: t for p, t in par.zero.full_tensors(what).items()}
        else:
            local = {}
            for p in par.module.parameters():
                t = p if what == "param" else p.grad
                local[par.names[p]] = torch.zeros_like(p) if t is None else t.detach()
        pp_index, tp = mesh.index("pp"), mesh.size("tp")
        out = {}
        for name, shape in par.shapes.items():
            owner = self._owner_pp(name)
            if owner == pp_index:
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

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by memory category (see :func:`edu3d.distributed.meter.measure`)."""
        if self.par.zero is not None:
            return self.par.zero.tensors()
        params = list(self.par.module.parameters())
        grads = [b.buffer for b in self.par.dp.buckets] if self.par.dp is not None else []
        grads += [p.grad for p in params if p.grad is not None]
        state = [] if self.optimizer is None else [
            t for s in self.optimizer.state.values() for t in s.values()
            if isinstance(t, torch.Tensor)]
        return {"params": params, "grads": grads, "optimizer": state}
