"""One ``Trainer``: the training step of every layout, serial included.

After reading this file you should understand that a 3D-parallel step is the serial step
with four things added, and nothing else:

1. **the batch is cut**: each dp replica takes its rows of the global batch (each cp rank
   of it its pieces of those rows' sequences), and cuts them into ``m`` micro-batches;
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
the step the routers' counts are summed over every rank (:meth:`Trainer.moe_step`) for the
record and for DeepSeek-V3's bias balancing.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from edu3d.ckpt import reshard
from edu3d.model.gpt import set_attention
from edu3d.model.moe import MoE, set_aux_scale
from edu3d.parallel.cp.sequence import split_batch
from edu3d.distributed import trace
from edu3d.train.batching import StepBatch
from edu3d.train.data import microbatches, shard_rows
from edu3d.config.layout import Layout
from edu3d.distributed.mesh import Mesh
from edu3d.train.optim import (clip_coef, lr_at, make_optimizer, optimizer_kwargs,
                               param_groups, set_lr)
from edu3d.config.sections import Run
from edu3d.train.step_stats import StepMeter
from edu3d.parallel.grads import GradSync
from edu3d.parallel.optim_state import adam_state
from edu3d.parallel.parallelize import parallelize
from edu3d.parallel.pp.engine import PipelineEngine, scaled_loss
from edu3d.parallel.precision import MixedPrecision
from edu3d.schedules.actions import placement, stage_rank
from edu3d.parallel.tp.layers import unshard


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
        if isinstance(x, StepBatch):  # --batching: documents, cut and weighted by tokens
            batch = x.microbatches(self.dp_index, self.dp_size, m, self.device, self.cp_size,
                                   self.mesh.index("cp"), self.run.parallel.cp_split)
        else:
            if self.device.type == "cuda" and x.device.type == "cpu":  # page-locked, async
                x, y = (t.pin_memory().to(self.device, non_blocking=True) for t in (x, y))
            xs = shard_rows(x, self.dp_index, self.dp_size)
            ys = shard_rows(y, self.dp_index, self.dp_size)
            if self.cp_size > 1:  # this rank's pieces of every sequence
                xs, ys = split_batch(xs, ys, self.cp_size, self.mesh.index("cp"),
                                     self.run.parallel.cp_split)
            batch = microbatches(xs, ys, m)
        if self.moe:  # the balancing terms reach backward scaled like the loss
            set_aux_scale(float(self.precision.scale) / m)
        self.grads.zero_grad()
        losses = self.engine.run(batch)
        self.grads.finish()
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
        record, and DeepSeek-V3's bias update from the step's global counts.

        ``tokens_per_expert``: the first MoE layer's assignments to each expert, before any
        capacity limit, over all ranks and micro-batches (they add up to tokens x topk);
        ``dropped``: that layer's assignments the capacity limit dropped; ``aux_loss`` and
        ``z_loss``: means over layers and micro-batches (the load-balancing loss is 1 at
        perfect balance, E when every token picks the same experts); ``ep_tokens``: under
        expert parallelism, tokens each rank of the first expert-parallel group sent to each
        (row: sender, column: receiver), for the first MoE layer."""
        n, experts = len(self.moe_layers), self.config.n_experts
        ep = self.mesh.layout.ep
        tp0 = self.mesh.index("tp") == 0
        cp0 = self.cp_size == 1 or self.mesh.index("cp") == 0
        first_group = ep > 1 and self.mesh.index("dpcp") < ep
        counts = torch.zeros(n, experts, dtype=torch.float64)
        dropped = torch.zeros(n, dtype=torch.float64)
        sums = torch.zeros(4, dtype=torch.float64)  # aux sum, aux count, z sum, z count
        matrix = torch.zeros(ep, ep, dtype=torch.float64)
        for j, layer in enumerate(self.moe_layers):
            if layer not in self.moe:
                continue
            st = self.moe[layer].take_stats()
            if not tp0 or not st["forwards"]:
                continue
            counts[j] += st["counts"].double()
            dropped[j] += st["dropped"]
            if cp0:  # the group's aux loss is the same on every cp rank
                sums[0] += st["aux"]
                sums[1] += st["forwards"]
            sums[2] += st["z"]
            sums[3] += st["forwards"]
            if j == 0 and first_group and st.get("matrix") is not None:
                matrix += st["matrix"].double()  # this rank's row; the others are 0
        flat = torch.cat([counts.view(-1), dropped, sums, matrix.view(-1)])
        if self.mesh.layout.world_size > 1:  # bookkeeping: left out of the trace
            dist.all_reduce(flat)
        counts = flat[:n * experts].view(n, experts)
        dropped, sums = flat[n * experts:n * experts + n], flat[n * experts + n:][:4]
        if self.config.balance == "bias":
            for j, layer in enumerate(self.moe_layers):
                if layer in self.moe:
                    self.moe[layer].update_bias(counts[j].to(self.moe[layer].expert_bias.device))
        out = {"aux_loss": float(sums[0] / max(sums[1], 1)),
               "z_loss": float(sums[2] / max(sums[3], 1)),
               "tokens_per_expert": [int(c) for c in counts[0].tolist()],
               "dropped": int(dropped[0])}
        if ep > 1:
            out["ep_tokens"] = [[int(v) for v in row]
                                for row in flat[-ep * ep:].view(ep, ep).tolist()]
        return out

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
        """Every piece of training state this rank holds, as ``(placement, view, owned)``:
        the placement in the full serial tensor (:mod:`edu3d.ckpt.reshard`), a 1-D view of the
        numbers here (write into it to load), and whether this rank is the piece's one writer.
        Parameters and AdamW's moments; ZeRO: the shard's pieces. One owner per number: a
        TP-replicated tensor is written by tp index 0, a dp (or cp) replica by the first
        ``dp x cp`` rank, an expert by the first rank holding it (``edp``), the tied
        embedding's copy on the last stage by the first stage only."""
        par, mesh = self.par, self.mesh
        tp_i, tp_n, pp_i = mesh.index("tp"), mesh.size("tp"), mesh.index("pp")
        first = {False: mesh.index("dpcp") == 0, True: mesh.index("edp") == 0}
        slots = []

        def add(p, kind, view, window, owned):
            name = par.names[p]
            owned = owned and (par.specs.get(name) is not None or tp_i == 0) \
                and self._owner_pp(name) == pp_i
            start = window[0] if window else 0
            for place, s, e in reshard.pieces(name, kind, par.shapes[name], par.specs.get(name),
                                              tp_i, tp_n, window):
                slots.append((place, view[s - start:e - start], owned))

        if not par.zeros:
            adam = isinstance(self.optimizer, torch.optim.AdamW)
            for p in par.module.parameters():
                mine = first[par.names[p] in par.experts]
                add(p, "param", p.data.view(-1), None, mine)
                if adam and p.requires_grad:  # a frozen parameter has no optimizer state
                    state = adam_state(self.optimizer, p)
                    for kind in ("exp_avg", "exp_avg_sq"):
                        add(p, kind, state[kind].view(-1), None, mine)
            return slots
        for z in par.zeros:
            for p, a, b, views in z.state_pieces():
                for kind, view, owned in views:
                    add(p, kind, view, (a, b), owned)
        for p in par.module.parameters():
            if not p.requires_grad:  # frozen: in no ZeRO unit, whole on every rank, written once
                add(p, "param", p.data.view(-1), None, first[par.names[p] in par.experts])
            elif par.zero.stage < 3:  # the full parameters every rank keeps: loaded, not written
                add(p, "param", p.data.view(-1), None, False)
        return slots

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        if self.par.zeros:
            return [z.optimizer for z in self.par.zeros]
        return [] if self.optimizer is None else [self.optimizer]

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
        """The pipeline rank holding serial parameter ``name`` (tied matrix: the first stage's)."""
        if name.startswith("blocks."):
            layer = int(name.split(".")[1])
            stage = next(s for s, (a, b) in enumerate(self.par.parts) if a <= layer < b)
        else:
            stage = self.par.n_stages - 1 if name.startswith(("ln_f", "lm_head")) else 0
        return stage_rank(stage, self.mesh.layout.pp, placement(self.run.parallel.schedule))

    @torch.no_grad()
    def gather(self, what: str = "grad") -> dict[str, torch.Tensor]:
        """Full serial tensors by serial name, ``"param"`` or ``"grad"`` (after a step or
        :meth:`forward_backward`), on every rank. Collective and untraced: for tests and
        charts, not for training."""
        par, mesh = self.par, self.mesh
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
            owner = self._owner_pp(name)
            if name in par.experts:  # held whole by one rank of each expert-parallel group
                t = local[name].clone() if name in local else torch.empty(shape)
                src = self._expert_owner(name)
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

    def _expert_owner(self, name: str) -> int:
        """The index, in its expert-parallel group, of the rank holding expert ``name``."""
        expert = int(name.split(".experts.")[1].split(".")[0])
        return expert // (self.config.n_experts // self.mesh.layout.ep)

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
