"""ZeRO stages 1, 2 and 3: data parallelism that stops keeping N copies of everything.

After reading this file you should understand where each byte of training state lives
(Rajbhandari et al. 2019; formulas in DESIGN.md, measured in :mod:`edu3d.plan.formulas`):

* the model is cut into **units** (:mod:`edu3d.parallel.zero.units`), each laid out in a
  padded **flat buffer** of which rank ``r`` owns a contiguous **shard**
  (:mod:`edu3d.parallel.zero.flat_unit`);
* **stage 1** shards the optimizer state. Backward fills full gradients as usual; then each
  unit's gradients are averaged: all-reduced by default, so ``p.grad`` is the full average
  on every rank as under DDP + ``ZeroRedundancyOptimizer`` (Ψ more traffic), or, with
  ``reduce_scatter=True`` (the paper's, the trainer's), *reduce-scattered*: rank r receives
  the sum of its slice only. The optimizer steps only the owned slice, and the updated
  slices are *all-gathered* back into every rank's full parameters. Traffic: reduce-scatter
  Ψ + all-gather Ψ = 2Ψ, the same as an all-reduce;
* **stage 2** also shards gradients: as soon as backward has produced all of a unit's
  gradients, they are reduce-scattered and the full gradients freed. Same 2Ψ traffic;
* **stage 3** also shards the parameters (:mod:`edu3d.parallel.zero.gathering`): a unit's full
  weights exist only while it computes. Traffic 3Ψ; ``prefetch=True`` overlaps the gathers;
* ``offload=True`` (any stage) keeps the optimizer's work in host memory (ZeRO-Offload);
  ``param_dtype`` / ``reduce_dtype`` are FSDP2's ``MixedPrecisionPolicy``
  (:mod:`edu3d.parallel.zero.mixed_precision`);
* **with micro-batches**, stages 2-3 reduce-scatter every micro-batch
  (``grad_reduce="per-microbatch"``, DeepSpeed's and FSDP2's) or accumulate full gradients
  inside :meth:`Zero.no_sync` and reduce once (``"per-step"``, Megatron's);
* **HSDP** (``replicate_group=``): shards within ``group``, the same shards held once per
  replica group, their gradients all-reduced across (:mod:`edu3d.parallel.zero.hybrid`).

Memory per rank in fp32 (4-byte params and grads, 8 bytes of Adam moments; K=8):
stage 1 ``8Ψ + 8Ψ/N``, stage 2 ``4Ψ + 12Ψ/N``, stage 3 ``16Ψ/N``.

**The loop**, on any model at any stage: ``zero.zero_grad()``, forward, backward,
``zero.finish()`` (the average: forgetting it is an error at :meth:`Zero.step`), optionally
``zero.clip_grad_norm_(c)``, ``zero.step()``. The optimizer is any ``torch.optim`` class,
built like ``ZeroRedundancyOptimizer``'s (``optimizer_class``, param groups, ``**defaults``):
an element-wise one over *views of the shard* (:mod:`edu3d.parallel.zero.shard_optimizer`),
any other over whole parameters owned by one rank each
(:mod:`edu3d.parallel.zero.whole_tensors`). Own optimizers over ``model.parameters()``,
``zero.optimizer.step()`` and a missing ``finish()`` are refused at the step
(:mod:`edu3d.parallel.dp.step_guard`). After ``finish()``, ``p.grad`` is the full average
(ZeRO-1) or a placeholder that refuses to be read (:mod:`edu3d.parallel.zero.sharded_grads`).
A parameter is stepped only if some rank gave it a gradient (``find_unused_parameters=True``;
without it a missing gradient is an error). Sums are divided by N here, never averaged by
the backend (``ReduceOp.AVG`` is broken on gloo).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from edu3d.parallel.dp import same_start, step_guard
from edu3d.parallel.dp.data_parallel import switched
from edu3d.parallel.zero import (holdings, hybrid, mixed_precision, reduction,
                                shard_optimizer, zero_state)
from edu3d.parallel.zero.flat_unit import FlatUnit
from edu3d.parallel.zero.gathering import Gathering
from edu3d.parallel.zero.sharded_grads import ShardedGrad, clip, placeholder
from edu3d.parallel.zero.units import model_units
from edu3d.parallel.zero.whole_tensors import WholeTensors, shard_mode

STAGES = (1, 2, 3)
GRAD_REDUCE = ("per-microbatch", "per-step")  # stages 2-3; stage 1 reduces per step


class Zero:
    """Shards ``model``'s optimizer state (stage 1), gradients (2) and parameters (3) over
    ``group`` (``None``: the world), with ``optimizer_class(groups, **defaults)`` (module
    docstring). ``params`` (default: every unit parameter) is what torch optimizers take.

    ``units`` (``(name, modules, params)``, see :func:`model_units`) defaults to the model's;
    a pipeline rank passes the units of its own stages (and then broadcasts only those
    parameters, and owns no buffers). ``shard_by`` (``"element"`` or ``"tensor"``) overrides
    the choice by optimizer class. ``broadcast_buffers=True`` broadcasts the buffers before
    every forward that follows a synchronising one, as DDP; the default is FSDP2's (buffers
    broadcast once, at wrap time, then each rank's own). ``replicate_group`` (HSDP, FSDP2's
    replicate mesh dimension): the ranks holding this rank's shard in the other groups.

    **With micro-batches**, stages 2-3 per micro-batch need nothing marked (traffic per step
    ``(m + 1)Ψ`` at stage 2, ``3mΨ`` at stage 3); per step, every backward but the last runs
    inside :meth:`no_sync` (DDP's idiom; FSDP2's ``set_requires_gradient_sync(False)``),
    ZeRO-3 forwards inside it or :meth:`keep_gathered`: ``2Ψ`` / ``3Ψ`` whatever m. A
    backward after :meth:`finish` (before the step) adds its average, as DDP's does.
    """

    def __init__(self, model, group=None, stage: int = 1, *, optimizer_class=torch.optim.AdamW,
                 params=None, prefetch: bool = False, offload: bool = False,
                 units: list | None = None, divisor: int | None = None,
                 find_unused_parameters: bool = False, grad_reduce: str = "per-microbatch",
                 reduce_scatter: bool = False, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, broadcast_buffers: bool = False,
                 shard_by: str | None = None, replicate_group=None, **defaults):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage {stage} is not one of 1, 2, 3 (0 is plain DP)")
        if grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"grad_reduce={grad_reduce!r} is not one of {GRAD_REDUCE}")
        whole = shard_mode(optimizer_class, shard_by, offload, param_dtype) == "tensor"
        self.grad_reduce, self.reduce_scatter = grad_reduce, reduce_scatter or stage > 1
        self.model, self.group, self.stage, self.prefetch = model, group, stage, prefetch
        self.offload, self.find_unused = offload, find_unused_parameters
        self.param_dtype = param_dtype
        self.sync = True
        self.n = dist.get_world_size(group)
        self.replicate = replicate_group
        self.replicas, self.replica_index = hybrid.place(replicate_group)
        self.divisor = divisor or self.n * self.replicas  # experts: dp x cp (see grads.py)
        self.index = dist.get_group_rank(group, dist.get_rank()) if group else dist.get_rank()
        self.collective_wait_s = 60.0  # model.state_dict() waits this long for every rank
        mine = model_units(model) if units is None else units
        hybrid.same_start(self, model.parameters() if units is None else
                          [p for _, _, ps in mine for p in ps], buffers=units is None)
        self.names = {p: n for n, p in model.named_parameters()}
        self.keys = dict(model.named_parameters(remove_duplicate=False))
        originals = {p: p.detach().clone() for _, _, ps in mine for p in ps} if whole else {}
        self.units = [FlatUnit(name, mods, ps, self.n, self.index, param_dtype)
                      for name, mods, ps in mine]
        self.reduce_dtype = reduce_dtype or param_dtype
        self.where = {p: (u, i) for u in self.units for i, p in enumerate(u.params)}
        if len(self.where) != sum(len(u.params) for u in self.units):
            raise ValueError("a parameter is in two ZeRO units")
        self.got = {p: False for p in self.where}  # received a gradient this step
        self.stepped = set(self.where)  # the parameters the last finish() lets step
        self._next = None  # find_unused, stages 2-3: the next unit to reduce, in order
        self.consumed = False  # stages 2-3: step() used the shard gradients
        self.finished = False  # finish() ran after the last gradient arrived
        self._stepping = False
        if stage == 1:
            for u in self.units:
                u.flat_grad = torch.zeros_like(u.flat_param)
                u.shard_grad = u.flat_grad[u.lo:u.hi]
        for p in self.where:
            p.register_hook(lambda grad, p=p: self._before_accumulate(p))
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.frozen_originals = {}  # mixed precision: frozen parameters before their cast
        if param_dtype is not None:  # see edu3d.parallel.zero.mixed_precision
            self.frozen_originals = mixed_precision.cast_frozen(model, self.where, param_dtype)
            mixed_precision.cast_forward_inputs(model, param_dtype)
        self.gathering = Gathering(model, self.units, group, prefetch) if stage == 3 else None
        groups = shard_optimizer.checked_groups(params, self.where, self.names)
        self.group_names = [[self.names[p] for p in g["params"]] for g in groups]
        self.whole = WholeTensors(self, groups, optimizer_class, defaults, originals) \
            if whole else None
        self.optimizer = self.whole.optimizer if whole else shard_optimizer.build(
            self.units, groups, optimizer_class, defaults, offload)
        zero_state.install_hooks(self)  # model.state_dict / load_state_dict and the shards
        self.buffer_sync = [same_start.BufferSync(model, g, lambda: self.sync)
                            for g in hybrid.groups(self) if broadcast_buffers and units is None]
        step_guard.watch(self)

    @property
    def per_microbatch(self) -> bool:
        """Stages 2-3 reducing every micro-batch (stage 1 always reduces once per step)."""
        return self.stage > 1 and self.grad_reduce == "per-microbatch"

    def _refuse(self, what: str) -> None:
        if self.per_microbatch:
            raise RuntimeError(f"ZeRO-{self.stage} {what}: grad_reduce='per-microbatch' reduces "
                               "every micro-batch (DeepSpeed's no_sync refuses too); build Zero "
                               "with grad_reduce='per-step' to accumulate full gradients")

    def no_sync(self):
        """Per-step: accumulate full gradients locally, no reduce-scatter (and under ZeRO-3
        no free after the forwards and backwards inside). Refused per micro-batch."""
        self._refuse("no_sync()")
        stack = contextlib.ExitStack()
        stack.enter_context(switched(self, "sync", False))
        if self.gathering is not None:
            stack.enter_context(switched(self.gathering, "reshard_after_forward", False))
        return stack

    def keep_gathered(self):
        """ZeRO-3 per-step: leave units gathered after this forward (more micro-batches
        follow); a pipeline's forwards run outside :meth:`no_sync`. Refused per micro-batch."""
        self._refuse("keep_gathered()")
        if self.gathering is None:
            return contextlib.nullcontext()
        return switched(self.gathering, "reshard_after_forward", False)

    def accumulating(self, forward: bool = False):
        """Around every backward but the last (``forward=True``: every forward but the
        last) of a step, in either mode: :meth:`no_sync` (:meth:`keep_gathered`) per step,
        nothing per micro-batch. What a trainer enters without knowing the mode."""
        if self.per_microbatch:
            return contextlib.nullcontext()
        return self.keep_gathered() if forward else self.no_sync()

    # ---- gradients ----------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients: ``p.grad = None`` (or zeros, which torch optimizers
        then step: decay, moments), and the sharded gradients zeroed."""
        for u in self.units:
            u.shard_grad.zero_()
            u.ready.clear()
            u.averaged = False
            if u.flat_grad is not None and not set_to_none:
                u.flat_grad.zero_()
            for i, p in enumerate(u.params):
                self.got[p] = not set_to_none
                keep = u.flat_grad is not None and not set_to_none
                p.grad = u.grad_view(i) if keep else None
        self._next, self.consumed, self.finished = None, False, False

    def _before_accumulate(self, p: torch.Tensor) -> None:
        """A gradient is about to accumulate into ``p.grad``: a placeholder goes first (the
        average it stands for stays in the shard)."""
        if isinstance(p.grad, ShardedGrad):
            if self.stage == 1:
                raise RuntimeError(
                    f"{self.names.get(p)}: a backward after zero.finish() and before "
                    "zero.step() under ZeRO-1 with reduce_scatter=True (each rank kept only "
                    "its slice's average): step or zero_grad first, or build Zero without "
                    "reduce_scatter to accumulate full averages as DDP does")
            p.grad = None

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """The gradient autograd just accumulated into ``p.grad`` (whatever tensor that is).
        Stage 1: kept in the flat gradient buffer. Stages 2 and 3: once a unit's gradients
        are complete, only this rank's slice is kept."""
        u, i = self.where[p]
        self.got[p] = True
        self.finished = False
        if self.stage == 1:
            view = u.grad_view(i)
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
            return
        if not self.sync:
            return
        u.ready.add(i)
        if not self.find_unused:
            if len(u.ready) == len(u.params):
                reduction.reduce_unit(self, u)
            return
        if self._next is None:  # the first gradient of this backward
            self._next = len(self.units) - 1
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        while self._next >= 0 and len(self.units[self._next].ready) == \
                len(self.units[self._next].params):
            reduction.reduce_unit(self, self.units[self._next])
            self._next -= 1

    def _end_of_backward(self) -> None:
        """find_unused, stages 2-3: reduce every unit left, in the same order on every rank
        (its unused parameters count zero)."""
        while self._next is not None and self._next >= 0:
            reduction.reduce_unit(self, self.units[self._next])
            self._next -= 1
        self._next = None

    def finish(self) -> None:
        """After the last backward: every rank's shard holds the average gradient of its
        slice, and ``p.grad`` the full average (ZeRO-1) or a placeholder (module docstring).
        Once per step: a second call before more gradients arrive does nothing."""
        if self.finished:
            return
        if self.stage == 1:
            for u in self.units:
                for i, p in enumerate(u.params):
                    self.got[p] = p.grad is not None
                    view = u.grad_view(i)
                    if p.grad is None:
                        view.zero_()  # stale numbers of an earlier step
                    elif p.grad.data_ptr() != view.data_ptr():
                        view.copy_(p.grad)
                        p.grad = view
        self.stepped = reduction.agree_on_stepped(self)
        for k, u in enumerate(self.units):
            if self.stage > 1 and not u.reduced:
                if not self.find_unused:
                    raise RuntimeError(
                        f"ZeRO-{self.stage}: unit {u.name} was never reduce-scattered: was its "
                        "last backward run inside no_sync()?")
                reduction.reduce_unit(self, u)  # accumulated inside no_sync, or none at all
            u.reduced = False
            if self.stage == 1:
                reduction.average_full_gradients(self, u, k)
            elif not u.averaged:
                hybrid.across_replicas(self, u.shard_grad, k)
                u.shard_grad.div_(self.divisor)
                u.averaged = True
        for u in self.units:  # what p.grad shows now
            for i, p in enumerate(u.params):
                if p not in self.stepped:
                    p.grad = None
                else:
                    p.grad = placeholder(p) if self.reduce_scatter else u.grad_view(i)
        self.finished = True

    def grad_pieces(self):
        """``(param, view)``: this rank's slices of the reduced gradient, parameter by
        parameter (what the global norm and the cross-axis fixes work on)."""
        for u in self.units:
            for p, a, b, at in u.pieces():
                yield p, u.shard_grad[at:at + b - a]

    def scale_(self, coef: torch.Tensor) -> None:
        """Multiply the averaged gradients by ``coef`` (clipping by the global norm); under
        ZeRO-1 the whole flat gradient, so ``p.grad`` and the shard stay one."""
        for u in self.units:
            g = u.flat_grad if u.flat_grad is not None else u.shard_grad
            g.mul_(coef.to(g.dtype))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` for the sharded gradient (after :meth:`finish`): the
        global norm of this ``Zero``'s gradients over its group (one all-reduce), returned,
        and every rank's slices scaled by ``min(1, max_norm / (norm + 1e-6))``. Across tensor
        or pipeline parallelism the norm is :class:`~edu3d.parallel.grads.GradSync`'s."""
        return clip(self, max_norm, norm_type, error_if_nonfinite)

    # ---- the step ----------------------------------------------------------------------------
    def _set_lr(self, lr: float) -> None:
        rates = sorted({float(g["lr"]) for g in self.optimizer.param_groups})
        if len(rates) > 1:
            raise ValueError(f"zero.step(lr={lr}) would give every param group the learning "
                             f"rate {lr}, but they have their own ({rates}): call zero.step() and "
                             "set the rates on zero.optimizer.param_groups (or a scheduler)")
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def step(self, lr: float | None = None) -> None:
        """Update this rank's slices (or whole parameters) of the parameters that received a
        gradient, then share the result (stages 1-2 all-gather the full parameters). ``lr``
        sets every group's learning rate first (refused where the groups have their own)."""
        if not self.finished:
            raise RuntimeError(f"zero.step() before zero.finish(): call zero.finish() after the "
                               f"last backward of the step: it averages the gradients over the "
                               f"group (without it ZeRO-{self.stage} would step unaveraged or "
                               "no gradients)")
        if lr is not None:
            self._set_lr(lr)
        self._stepping = True
        try:
            if self.whole is not None:
                self.whole.step()
            else:
                shard_optimizer.step(self)
        finally:
            self._stepping = False
        for u in self.units:
            for p in u.params:
                if isinstance(p.grad, ShardedGrad):
                    p.grad = None  # the average is consumed with the shard
        if self.stage > 1:
            self.consumed = True
            for p in self.got:
                self.got[p] = False
        self.finished = False

    def check_step(self, optimizer) -> None:
        """The step guard's question (:mod:`edu3d.parallel.dp.step_guard`)."""
        if optimizer is self.optimizer and not self._stepping:
            raise RuntimeError("zero.optimizer.step() steps the shards without the rest of "
                               "the step (gradients in, parameters shared out): call "
                               "zero.step() (a scheduler on zero.optimizer is fine)")
        mine = [] if optimizer is self.optimizer else step_guard.stepped_by(optimizer, self.where)
        if mine:
            names = [self.names.get(p, str(tuple(p.shape))) for p in mine[:4]]
            raise RuntimeError(
                f"this optimizer steps parameters that ZeRO-{self.stage} shards ({names}...): "
                "their gradients live in the shards, so it would step nothing or the wrong "
                "numbers. Let Zero build it, Zero(model, ..., optimizer_class=<its class>, "
                "lr=...) (params= for param groups), and call zero.step()")

    # ---- checkpoints and inspection -------------------------------------------------------------
    def state_pieces(self):
        """What a checkpoint of this rank's shard holds: :func:`zero_state.state_pieces`."""
        return zero_state.state_pieces(self)

    def state_dict(self, full: bool = False) -> dict:
        """The optimizer's state: this rank's shard and its layout (default, no
        communication), or ``full=True`` FSDP2's full form keyed by parameter name (collective),
        which loads at any world size. Formats: :mod:`edu3d.parallel.zero.zero_state`."""
        return zero_state.full_state(self) if full else zero_state.sharded_state(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load either form of :meth:`state_dict` (the model: ``model.load_state_dict``)."""
        zero_state.load(self, state_dict)

    def numel(self) -> int:
        """The model's number of parameters at their full shapes (a ZeRO-3 parameter is an
        empty tensor between forwards, so ``p.numel()`` counts 0)."""
        return holdings.numel(self)

    def shapes(self) -> dict[str, torch.Size]:
        """Every parameter's full shape, by name."""
        return holdings.shapes(self)

    def full_tensors(self, what: str) -> dict:
        """Unsharded parameters (``"param"``) or gradients (``"grad"``) keyed by parameter
        (collective, untraced): :func:`holdings.full_tensors`."""
        return holdings.full_tensors(self, what)

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by memory category (see :func:`edu3d.distributed.meter.measure`)."""
        return holdings.tensors(self)
