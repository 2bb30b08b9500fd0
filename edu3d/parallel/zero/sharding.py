"""ZeRO stages 1, 2 and 3: data parallelism that stops keeping N copies of everything.

After reading this file you should understand where each byte of training state lives
(Rajbhandari et al. 2019; formulas in DESIGN.md, measured in :mod:`edu3d.plan.formulas`):

* the model is cut into **units** (:mod:`edu3d.parallel.zero.units`: the embeddings, each
  block, the head, for any model), each laid out in a padded **flat buffer** of which rank
  ``r`` owns a contiguous **shard** (:mod:`edu3d.parallel.zero.flat_unit`);
* **stage 1** shards the optimizer state. Backward fills full gradients as usual; then each
  unit's gradient buffer is *reduce-scattered* (rank r receives the sum of its slice), the
  optimizer steps only the owned slice, and the updated slices are *all-gathered* back into
  every rank's full parameters. Traffic: reduce-scatter Ψ + all-gather Ψ = 2Ψ, the same as
  an all-reduce (which *is* a reduce-scatter followed by an all-gather);
* **stage 2** also shards gradients: as soon as backward has produced all of a unit's
  gradients, they are reduce-scattered and the full gradients freed, so a rank never holds
  more than one unit's full gradients. Same 2Ψ traffic;
* **stage 3** also shards the parameters: a unit's full weights exist only while it computes.
  They are all-gathered before its forward, freed after it, gathered again before its
  backward, and freed once its gradients are reduce-scattered. Traffic 3Ψ (two all-gathers,
  one reduce-scatter); ``prefetch=True`` starts gathering the next unit while the current one
  computes. Outside forward and backward a parameter is an empty tensor (shape ``(0,)``, as
  in FSDP); ``model.state_dict()`` gathers full tensors (collective: every rank calls it);
* ``offload=True`` (any stage) keeps the optimizer's work in host memory: the shard's fp32
  master copy, its gradient and the Adam moments live on the CPU, the step runs there, and
  only the updated shard is copied back (ZeRO-Offload, Ren et al. 2021);
* **with micro-batches**, stages 2-3 reduce-scatter every micro-batch and keep only the
  gradient shard (``grad_reduce="per-microbatch"``, the default, as DeepSpeed and FSDP2:
  traffic grows with m) or accumulate full gradients and reduce once (``"per-step"``, as
  Megatron's distributed optimizer: the memory of ZeRO-1 for 2Ψ / 3Ψ whatever m).

Memory per rank in fp32 (4-byte params and grads, 8 bytes of Adam moments; K=8):
stage 1 ``8Ψ + 8Ψ/N``, stage 2 ``4Ψ + 12Ψ/N``, stage 3 ``16Ψ/N``.

The optimizer is any ``torch.optim`` class, built like ``ZeroRedundancyOptimizer``'s
(``optimizer_class``, ``params`` or param groups, ``**defaults``) over *views of the shard*,
one per parameter piece it contains, in the group of its parameter: every element is updated
by exactly the arithmetic the same optimizer does on one process. The gradient hooks use the
gradient autograd hands them, so ``model.zero_grad()`` or ``zero.zero_grad()`` (either
``set_to_none``), before forward or after the step, trains the same. A parameter is stepped
only if it received a gradient (``p.grad is None`` means skip, as in torch): with
``find_unused_parameters=True`` the ranks agree by summing a mask of who received one;
without it a missing gradient is an error. Gradients are summed and divided by N here, never
averaged by the backend (``ReduceOp.AVG`` is broken on gloo).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from edu3d.distributed import comm, trace
from edu3d.distributed.meter import storage_bytes
from edu3d.parallel.dp.data_parallel import switched, used_by_any_rank
from edu3d.parallel.optim_state import adam_state
from edu3d.parallel.zero.flat_unit import FlatUnit
from edu3d.parallel.zero import shard_optimizer, zero_state
from edu3d.parallel.zero.gathering import Gathering
from edu3d.parallel.zero.units import model_units

STAGES = (1, 2, 3)
GRAD_REDUCE = ("per-microbatch", "per-step")  # stages 2-3; stage 1 reduces per step


class Zero:
    """Shards ``model``'s optimizer state (stage 1), gradients (2) and parameters (3) over
    ``group`` (``None``: the world), with ``optimizer_class(groups, **defaults)`` over the
    shard. ``params`` (default: every unit parameter) is what torch optimizers take: tensors
    or param groups (dicts), each group's settings applying to its parameters' pieces.

    The loop, on any model at any stage: ``zero.zero_grad()``, forward, backward,
    ``zero.finish()``, ``zero.step()`` (the optimizer's own learning rates; ``step(lr)`` first
    sets every group's to ``lr``). Between ``finish`` and ``step``, :meth:`scale_` multiplies the
    sharded gradients (clipping). ZeRO-1's gradients stay in ``p.grad`` until zeroed, as in
    torch; stages 2-3 move them into the shard, which ``step()`` consumes.

    ``units`` (``(name, modules, params)``, see :func:`model_units`) defaults to the model's;
    a pipeline rank passes the units of its own stages.

    **With micro-batches** (gradient accumulation or a pipeline), stages 2 and 3 reduce as
    ``grad_reduce`` says. ``"per-microbatch"`` (the default, as DeepSpeed ZeRO-2/3 and FSDP2):
    nothing to mark, every backward reduce-scatters each unit as soon as its gradients are
    complete (a backward hook) and adds the result to the shard, so a rank keeps ``1/N`` of
    the gradients between micro-batches; stage 3 frees a unit after every forward and after
    every backward. Traffic per step with m micro-batches: ``(m + 1)Ψ`` (stage 2), ``3mΨ``
    (stage 3). ``"per-step"`` (Megatron's distributed optimizer): run every backward but the
    last inside :meth:`no_sync` (DDP's idiom; FSDP2's ``set_requires_gradient_sync(False)``):
    full gradients accumulate in ``.grad``, each unit is reduced once, in its last backward;
    stage 3 keeps units gathered after forwards inside :meth:`no_sync` or
    :meth:`keep_gathered` (a pipeline's forwards), gathers again for the backwards:
    ``2Ψ`` / ``3Ψ`` whatever m, for full gradients (stage 3: parameters) held for the step.
    Per micro-batch, :meth:`no_sync` and :meth:`keep_gathered` refuse; :meth:`accumulating`
    suits either mode. Stage 1 has no choice (full gradients, reduced once in :meth:`finish`,
    as in the paper): ``grad_reduce`` is ignored there.
    """

    def __init__(self, model, group=None, stage: int = 1, *, optimizer_class=torch.optim.AdamW,
                 params=None, prefetch: bool = False, offload: bool = False,
                 units: list | None = None, divisor: int | None = None,
                 find_unused_parameters: bool = False, grad_reduce: str = "per-microbatch",
                 **defaults):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage {stage} is not one of 1, 2, 3 (0 is plain DP)")
        if grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"grad_reduce={grad_reduce!r} is not one of {GRAD_REDUCE}")
        self.grad_reduce = grad_reduce
        self.model, self.group, self.stage, self.prefetch = model, group, stage, prefetch
        self.offload, self.find_unused = offload, find_unused_parameters
        self.sync = True
        self.n = dist.get_world_size(group)
        self.divisor = divisor or self.n  # experts: the whole dp x cp size (see grads.py)
        self.index = dist.get_group_rank(group, dist.get_rank()) if group else dist.get_rank()
        src = dist.get_process_group_ranks(group)[0] if group else 0
        units = model_units(model) if units is None else units
        self.names = {p: n for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in (p for _, _, ps in units for p in ps):
                comm.broadcast(p.data, src, group)
        self.units = [FlatUnit(name, mods, ps, self.n, self.index) for name, mods, ps in units]
        self._where = {p: (u, i) for u in self.units for i, p in enumerate(u.params)}
        if len(self._where) != sum(len(u.params) for u in self.units):
            raise ValueError("a parameter is in two ZeRO units")
        self.got = {p: False for p in self._where}  # received a gradient this step
        self.stepped = set(self._where)  # the parameters the last finish() lets step
        self._next = None  # find_unused, stages 2-3: the next unit to reduce, in order
        self._consumed = False  # stages 2-3: step() used the shard gradients
        if stage == 1:
            for u in self.units:
                u.flat_grad = torch.zeros_like(u.flat_param)
                u.shard_grad = u.flat_grad[u.lo:u.hi]
        for p in self._where:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.gathering = Gathering(model, self.units, group, prefetch) if stage == 3 else None
        groups = shard_optimizer.checked_groups(params, self._where, self.names)
        self.group_names = [[self.names[p] for p in g["params"]] for g in groups]
        self.optimizer = shard_optimizer.build(self.units, groups, optimizer_class, defaults,
                                               offload)
        zero_state.install_load_hooks(self)  # model.load_state_dict writes into the shards

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
            if u.flat_grad is not None and not set_to_none:
                u.flat_grad.zero_()
            for i, p in enumerate(u.params):
                self.got[p] = not set_to_none
                keep = u.flat_grad is not None and not set_to_none
                p.grad = u.grad_view(i) if keep else None
        self._next, self._consumed = None, False

    def _reduce_scatter(self, u: FlatUnit, flat: torch.Tensor) -> None:
        if self._consumed:  # the first reduction after a step starts from zero
            for v in self.units:
                v.shard_grad.zero_()
            self._consumed = False
        out = torch.empty_like(u.shard_grad)
        with trace.current().context(chunk=self.units.index(u)):
            comm.reduce_scatter(out, flat, self.group)
        u.shard_grad += out

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """The gradient autograd just accumulated into ``p.grad`` (whatever tensor that is).
        Stage 1: kept in the flat gradient buffer. Stages 2 and 3: once a unit's gradients
        are complete, only this rank's slice is kept."""
        u, i = self._where[p]
        self.got[p] = True
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
                self._reduce(u)
            return
        if self._next is None:  # the first gradient of this backward
            self._next = len(self.units) - 1
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        while self._next >= 0 and len(self.units[self._next].ready) == len(self.units[self._next].params):
            self._reduce(self.units[self._next])
            self._next -= 1

    def _end_of_backward(self) -> None:
        """find_unused, stages 2-3: reduce every unit left, in the same order on every rank
        (its unused parameters count zero)."""
        while self._next is not None and self._next >= 0:
            self._reduce(self.units[self._next])
            self._next -= 1
        self._next = None

    def _reduce(self, u: FlatUnit) -> None:
        u.ready.clear()
        u.reduced = True
        flat = u.flatten_grads()
        self._mark_grads(flat)  # the peak inside backward: this unit's grads twice
        self._reduce_scatter(u, flat)
        del flat
        for q in u.params:
            q.grad = None
        self._mark_grads()
        if self.gathering is not None:
            self.gathering.free(u)

    def _mark_grads(self, *transient: torch.Tensor) -> None:
        """A ``mem`` event with the gradient bytes held now (when a trace is recorded)."""
        rec = trace.current()
        if rec.enabled:
            rec.mark_memory("grads", grads=storage_bytes(self.tensors()["grads"] + [*transient]))

    def _agree_on_stepped(self) -> None:
        """Which parameters step: those with a gradient on some rank (summed mask), or, without
        find_unused_parameters, all of them, after checking that every one got a gradient."""
        params = list(self._where)
        if self.find_unused:
            self.stepped = used_by_any_rank(params, {p for p in params if self.got[p]},
                                            self.group)
            return
        missing = [self.names.get(p, tuple(p.shape)) for p in params if not self.got[p]]
        if missing:
            raise RuntimeError(f"ZeRO-{self.stage}: parameters {missing[:4]} received no "
                               "gradient this step (unused in forward?): pass "
                               "Zero(..., find_unused_parameters=True)")
        self.stepped = set(params)

    def finish(self) -> None:
        """After the last backward: every rank's shard holds the average gradient of its slice."""
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
        self._agree_on_stepped()
        for u in self.units:
            if self.stage > 1 and not u.reduced:
                if not self.find_unused:
                    raise RuntimeError(
                        f"ZeRO-{self.stage}: unit {u.name} was never reduce-scattered: was its "
                        "last backward run inside no_sync()?")
                self._reduce(u)  # gradients accumulated inside no_sync, or none at all
            u.reduced = False
            if self.stage == 1:
                flat = u.flat_grad.clone()
                u.shard_grad.zero_()
                self._reduce_scatter(u, flat)
            u.shard_grad.div_(self.divisor)

    def grad_pieces(self):
        """``(param, view)``: this rank's slices of the reduced gradient, parameter by
        parameter (what the global norm and the cross-axis fixes work on)."""
        for u in self.units:
            for p, a, b, at in u.pieces():
                yield p, u.shard_grad[at:at + b - a]

    def scale_(self, coef: torch.Tensor) -> None:
        """Multiply the sharded gradients by ``coef`` (clipping by the global norm)."""
        for u in self.units:
            u.shard_grad.mul_(coef.to(u.shard_grad.dtype))

    def step(self, lr: float | None = None) -> None:
        """Update this rank's slices of the parameters that received a gradient; stages 1-2
        then all-gather the full parameters. ``lr`` overrides every group's learning rate."""
        if self.offload:
            for u in self.units:
                u.host_grad.copy_(u.shard_grad)
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        for u in self.units:  # torch optimizers skip a parameter whose .grad is None
            for (p, *_), piece, grad in zip(u.pieces(), u.opt_params, u.opt_grads):
                if piece is not None:
                    piece.grad = grad if p in self.stepped else None
        self.optimizer.step()
        if self.offload:
            for u in self.units:
                u.shard_param.copy_(u.host_param)
        if self.stage < 3:
            for i, u in enumerate(self.units):
                with trace.current().context(chunk=i):
                    comm.all_gather(u.flat_param, u.shard_param.clone(), self.group)
        if self.stage > 1:  # the sharded gradients are consumed (p.grad is long gone)
            self._consumed = True
            for p in self.got:
                self.got[p] = False

    # ---- checkpoints -------------------------------------------------------------------------
    def state_pieces(self):
        """What a checkpoint of this rank's shard holds, piece by piece: ``(param, start, end,
        views)``, the elements ``[start, end)`` of ``param`` (flattened) that the shard holds
        and ``views``, a list of ``(kind, tensor, owned)``: the shard's parameters
        (``"param"``; under offload also the host master copy, loaded but not written twice)
        and the optimizer's state for them (AdamW's ``"exp_avg"``, ``"exp_avg_sq"``, created
        as zeros when the optimizer has not stepped yet, so a checkpoint can be loaded)."""
        adam = isinstance(self.optimizer, torch.optim.AdamW)
        for u in self.units:
            for (p, a, b, at), piece in zip(u.pieces(), u.opt_params):
                views = [("param", u.shard_param[at:at + b - a], True)]
                if self.offload:
                    views.append(("param", u.host_param[at:at + b - a], False))
                if adam and piece is not None:
                    state = adam_state(self.optimizer, piece)
                    views += [(kind, state[kind], True) for kind in ("exp_avg", "exp_avg_sq")]
                yield p, a, b, views

    def state_dict(self, full: bool = False) -> dict:
        """The optimizer's state: this rank's shard and its layout (default, no
        communication), or ``full=True`` FSDP2's full form keyed by parameter name (collective),
        which loads at any world size. Formats: :mod:`edu3d.parallel.zero.zero_state`."""
        return zero_state.full_state(self) if full else zero_state.sharded_state(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load either form of :meth:`state_dict` (the model: ``model.load_state_dict``)."""
        zero_state.load(self, state_dict)

    # ---- inspection -------------------------------------------------------------------------
    def full_tensors(self, what: str) -> dict:
        """Unsharded parameters (``"param"``) or gradients (``"grad"``), keyed by parameter
        object (for tests and charts; collective over the group, untraced)."""
        out = {}
        for u in self.units:
            shard = u.shard_param if what == "param" else u.shard_grad
            parts = [torch.empty_like(shard) for _ in range(self.n)]
            dist.all_gather(parts, shard.contiguous(), group=self.group)
            flat = torch.cat(parts)
            for p, o, v in zip(u.params, u.offsets, u.views):
                out[p] = flat[o:o + v.numel()].view(v.shape).clone()
        return out

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by memory category (see :func:`edu3d.distributed.meter.measure`)."""
        params = [u.flat_param for u in self.units] + [u.shard_param for u in self.units]
        grads = [p.grad for u in self.units for p in u.params if p.grad is not None]
        grads += [u.shard_grad for u in self.units]
        grads += [u.flat_grad for u in self.units if u.flat_grad is not None]
        state = [t for s in self.optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        if self.offload:
            host = state + [u.host_param for u in self.units] + [u.host_grad for u in self.units]
            return {"params": params, "grads": grads, "optimizer": [], "host": host}
        return {"params": params, "grads": grads, "optimizer": state}
