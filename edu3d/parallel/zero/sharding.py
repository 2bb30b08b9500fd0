"""ZeRO stages 1, 2 and 3: data parallelism that stops keeping N copies of everything.

After reading this file you should understand where each byte of training state lives
(Rajbhandari et al. 2019; formulas in DESIGN.md, measured in :mod:`edu3d.plan.formulas`):

* the model is cut into **units** (the embeddings, each transformer block, the head). Each
  unit's parameters are laid end to end in one **flat buffer**, padded to a multiple of N, and
  rank ``r`` owns the contiguous slice ``[r·P/N, (r+1)·P/N)`` of it: its **shard**;
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
  computes;
* ``offload=True`` (any stage) keeps the optimizer's work in host memory: the shard's fp32
  master copy, its gradient and the Adam moments live on the CPU, the step runs there, and
  only the updated shard is copied back (ZeRO-Offload, Ren et al. 2021). On a GPU that moves
  ``16Ψ/N`` bytes per rank off the device; on a CPU-only machine it is the same memory.

Memory per rank in fp32 (4-byte params and grads, 8 bytes of Adam moments; K=8):
stage 1 ``8Ψ + 8Ψ/N``, stage 2 ``4Ψ + 12Ψ/N``, stage 3 ``16Ψ/N``.

The optimizer is the serial loop's own (AdamW or SGD, decay on matrices only) applied to
views of the shard, one per parameter piece the shard contains, so every element is updated
by exactly the arithmetic the serial model uses. Gradients are summed and divided by N here,
never averaged by the backend (``ReduceOp.AVG`` is broken on gloo).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from edu3d.distributed import comm, trace
from edu3d.parallel.dp.data_parallel import switched
from edu3d.parallel.optim_state import adam_state

STAGES = (1, 2, 3)


class FlatUnit:
    """One unit's parameters as a padded flat buffer, and this rank's shard of it."""

    def __init__(self, name: str, modules: list, params: list, n: int, index: int):
        self.name, self.modules, self.params = name, modules, params
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(self.numel / n) * n
        self.shard_numel = self.padded // n
        self.lo, self.hi = index * self.shard_numel, (index + 1) * self.shard_numel
        self.offsets = []
        off = 0
        for p in params:
            self.offsets.append(off)
            off += p.numel()
        p0 = params[0]
        self.flat_param = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for p, o in zip(params, self.offsets):
                self.flat_param[o:o + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.flat_param[o:o + p.numel()].view_as(p)
        self.shard_param = self.flat_param[self.lo:self.hi]
        self.flat_grad: torch.Tensor | None = None
        self.shard_grad = torch.zeros(self.shard_numel, dtype=p0.dtype, device=p0.device)
        self.ready = 0
        self.reduced = False  # stages 2-3: reduce-scattered in this step's last backward
        self.gathered = True
        self.pending = None  # an asynchronous all-gather in flight (prefetch)

    def pieces(self):
        """``(param, start, end, at)``: elements ``[start, end)`` of ``param`` (flattened)
        lie in this rank's shard, beginning at offset ``at`` of the shard."""
        for p, o in zip(self.params, self.offsets):
            a, b = max(o, self.lo), min(o + p.numel(), self.hi)
            if a < b:
                yield p, a - o, b - o, a - self.lo

    def flatten_grads(self) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=self.shard_grad.dtype, device=self.shard_grad.device)
        for p, o in zip(self.params, self.offsets):
            flat[o:o + p.numel()].copy_(p.grad.reshape(-1))
        return flat


def _units_of(pieces: list[tuple[str, list]], tied=None) -> list[tuple[str, list, list]]:
    """``(name, modules, params)`` per unit from ``(name, modules)`` in call order.

    A parameter belongs to the first unit whose modules hold it. A ``tied`` parameter (the
    embedding shared with the LM head) is a unit of its own, whose modules are every module
    that uses it: so the first and the last pipeline stage shard it identically, and their
    shards of its gradient can simply be added up.
    """
    units, seen = [], {id(tied)} if tied is not None else set()
    if tied is not None:
        users = [m for _, mods in pieces for m in mods
                 if any(p is tied for p in m.parameters(recurse=False))]
        units.append(("tied", users, [tied]))
    for name, modules in pieces:
        params = []
        for p in (p for m in modules for p in m.parameters()):
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                params.append(p)
        kept = [m for m in modules if any(any(p is q for q in params) for p in m.parameters())]
        if params:
            units.append((name, kept, params))
    return units


def model_units(model, tied=None) -> list[tuple[str, list, list]]:
    """``(name, modules in call order, parameters)`` per unit: embeddings, each block, head.

    ``model`` is edu3d's GPT or one of its pipeline stages (``blocks`` a list or a dict keyed
    by the serial layer number); any other module is one unit. An embedding that ``model``
    itself ties to its LM head is found here; ``tied`` names one tied across pipeline stages.
    """
    tok, head = (getattr(getattr(model, m, None), "weight", None) for m in ("tok_emb", "lm_head"))
    if tied is None and tok is not None and tok is head:
        tied = tok
    pieces = []
    if hasattr(model, "tok_emb"):
        pieces.append(("embed", [model.tok_emb, model.pos_emb]))
    if hasattr(model, "blocks"):
        items = model.blocks.items() if isinstance(model.blocks, torch.nn.ModuleDict) \
            else enumerate(model.blocks)
        pieces += [(f"block{i}", [b]) for i, b in items]
    if hasattr(model, "lm_head"):
        pieces.append(("head", [model.ln_f, model.lm_head]))
    if not pieces:
        return [("model", [model], [p for p in model.parameters() if p.requires_grad])]
    return _units_of(pieces, tied)


class Zero:
    """Shards a model's optimizer state (stage 1), gradients (2) and parameters (3) over
    ``group``. Drive it like :class:`~edu3d.parallel.dp.data_parallel.DataParallel`: ``zero_grad()``,
    forward/backward per micro-batch (all but each unit's last backward inside
    :meth:`no_sync`), ``finish()``; then ``scale_(coef)`` by the clipping coefficient of the
    global norm and ``step(lr)``.

    ``units`` (``(name, modules, params)``, see :func:`model_units`) defaults to the model's;
    a pipeline rank passes the units of its own stages.

    **With micro-batches** (gradient accumulation or a pipeline) gradients are not
    reduce-scattered per micro-batch: inside :meth:`no_sync` they accumulate in full ``.grad``
    tensors and are reduced once, in each unit's last backward (stages 2 and 3) or in
    :meth:`finish` (stage 1). Stage 3 gathers a unit once for the forwards of a step and
    frees it after the stage's last forward (:attr:`reshard_after_forward`), gathers it again
    for the backwards and frees it after its reduce-scatter: traffic stays ``3Ψ`` per step
    whatever the number of micro-batches. The price is memory: between a unit's first
    forward and its last backward the full parameters of the rank's stages and their full
    gradients stay resident, like ZeRO-1 plus the gathered weights (torchtitan does the same
    with FSDP under pipelining; DeepSpeed refuses ZeRO-2/3 with pipelines).
    """

    def __init__(self, model, group, stage: int, make_optimizer, prefetch: bool = False,
                 offload: bool = False, units: list | None = None, divisor: int | None = None):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage {stage} is not one of 1, 2, 3 (0 is plain DP)")
        self.model, self.group, self.stage, self.prefetch = model, group, stage, prefetch
        self.offload = offload
        self.sync = True
        self.reshard_after_forward = True
        self.n = dist.get_world_size(group)
        self.divisor = divisor or self.n  # experts: the whole dp x cp size (see grads.py)
        self.index = dist.get_group_rank(group, dist.get_rank()) if group else dist.get_rank()
        src = dist.get_process_group_ranks(group)[0] if group else 0
        units = model_units(model) if units is None else units
        with torch.no_grad():
            for p in (p for _, _, ps in units for p in ps):
                comm.broadcast(p.data, src, group)
        self.units = [FlatUnit(name, mods, ps, self.n, self.index) for name, mods, ps in units]
        self._unit_of = {p: u for u in self.units for p in u.params}
        if stage == 1:
            for u in self.units:
                u.flat_grad = torch.zeros_like(u.flat_param)
                u.shard_grad = u.flat_grad[u.lo:u.hi]
        else:
            for p in self._unit_of:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if stage == 3:
            for u in self.units:
                u.shard_param = u.shard_param.clone()  # the only persistent copy
                self._free(u)
            self._install_gather_hooks()
        self.optimizer = self._make_optimizer(make_optimizer)

    def no_sync(self):
        """Accumulate full gradients locally: no reduce-scatter (and no ZeRO-3 free)."""
        return switched(self, "sync", False)

    def keep_gathered(self):
        """ZeRO-3: leave units gathered after this forward (more micro-batches follow)."""
        return switched(self, "reshard_after_forward", False)

    # ---- optimizer on shard views -----------------------------------------------------------
    def _make_optimizer(self, make_optimizer):
        """``make_optimizer(decay, no_decay)`` (the trainer's rule, AdamW or SGD) over the
        shard's pieces; a piece decays when its full tensor is a matrix."""
        decay, no_decay = [], []
        for u in self.units:
            # offload: the optimizer works on a host copy of the shard (master weights,
            # gradient, moments in CPU memory); only the shard itself stays on the device
            u.host_param = u.shard_param.detach().to("cpu", copy=True) if self.offload else None
            u.host_grad = torch.zeros(u.shard_numel) if self.offload else None
            param = u.host_param if self.offload else u.shard_param
            grad = u.host_grad if self.offload else u.shard_grad
            u.opt_params = []  # the optimizer's parameter for each of u.pieces(), in order
            for p, a, b, s in u.pieces():
                piece = torch.nn.Parameter(param[s:s + b - a], requires_grad=False)
                piece.grad = grad[s:s + b - a]
                u.opt_params.append(piece)
                (decay if p.dim() >= 2 else no_decay).append(piece)
        return make_optimizer(decay, no_decay)

    # ---- stage 3: gather before use, free after ---------------------------------------------
    def _free(self, u: FlatUnit) -> None:
        u.flat_param.untyped_storage().resize_(0)
        u.gathered = False
        self._mark_resident()

    def _mark_resident(self) -> None:
        """Record the bytes of parameters this rank holds right now (the ZeRO-3 sawtooth)."""
        full = sum(u.flat_param.untyped_storage().nbytes() for u in self.units)
        shards = sum(u.shard_param.untyped_storage().nbytes() for u in self.units)
        trace.current().mark_memory("params", params=full + shards)

    def _start_gather(self, u: FlatUnit, async_op: bool):
        u.flat_param.untyped_storage().resize_(u.padded * u.flat_param.element_size())
        with trace.current().context(chunk=self.units.index(u)):
            return comm.all_gather(u.flat_param, u.shard_param, self.group, async_op=async_op)

    def _gather(self, u: FlatUnit) -> None:
        if u.pending is not None:
            u.pending.wait()
            u.pending = None
        elif not u.gathered:
            self._start_gather(u, async_op=False)
        else:
            return
        u.gathered = True
        self._mark_resident()

    def _prefetch(self, i: int) -> None:
        if self.prefetch and 0 <= i < len(self.units):
            u = self.units[i]
            if not u.gathered and u.pending is None:
                u.pending = self._start_gather(u, async_op=True)

    def _install_gather_hooks(self) -> None:
        for i, u in enumerate(self.units):
            def before_forward(module, inputs, u=u, i=i):
                self._gather(u)
                self._prefetch(i + 1)

            def after_forward(module, inputs, output, u=u, i=i):
                if module is u.modules[-1] and self.reshard_after_forward:
                    self._free(u)
                if isinstance(output, torch.Tensor) and output.requires_grad:
                    output.register_hook(lambda grad, u=u, i=i: self._before_backward(u, i))

            for m in u.modules:
                m.register_forward_pre_hook(before_forward)
                m.register_forward_hook(after_forward)

    def _before_backward(self, u: FlatUnit, i: int) -> None:
        self._gather(u)
        self._prefetch(i - 1)

    # ---- gradients ----------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for u in self.units:
            u.shard_grad.zero_()
            u.ready = 0
            if u.flat_grad is not None:
                u.flat_grad.zero_()
                for p, o in zip(u.params, u.offsets):
                    p.grad = u.flat_grad[o:o + p.numel()].view_as(p)

    def _reduce_scatter(self, u: FlatUnit, flat: torch.Tensor) -> None:
        out = torch.empty_like(u.shard_grad)
        with trace.current().context(chunk=self.units.index(u)):
            comm.reduce_scatter(out, flat, self.group)
        u.shard_grad += out

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """Stages 2 and 3: once a unit's gradients are complete, keep only this rank's slice."""
        if not self.sync:
            return
        u = self._unit_of[p]
        u.ready += 1
        if u.ready < len(u.params):
            return
        u.ready = 0
        u.reduced = True
        self._reduce_scatter(u, u.flatten_grads())
        for q in u.params:
            q.grad = None
        if self.stage == 3:
            self._free(u)

    def finish(self) -> None:
        """After the last backward: every rank's shard holds the average gradient of its slice."""
        for u in self.units:
            if self.stage > 1 and not u.reduced:
                raise RuntimeError(
                    f"ZeRO-{self.stage}: unit {u.name} was never reduce-scattered: was its "
                    "last backward run inside no_sync(), or a parameter unused?")
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

    def step(self, lr: float) -> None:
        """Update this rank's slices; stages 1-2 then all-gather the full parameters."""
        if self.offload:
            for u in self.units:
                u.host_grad.copy_(u.shard_grad)
        if self.optimizer is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            self.optimizer.step()
        if self.offload:
            for u in self.units:
                u.shard_param.copy_(u.host_param)
        if self.stage < 3:
            for i, u in enumerate(self.units):
                with trace.current().context(chunk=i):
                    comm.all_gather(u.flat_param, u.shard_param.clone(), self.group)

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
                if adam:
                    state = adam_state(self.optimizer, piece)
                    views += [(kind, state[kind], True) for kind in ("exp_avg", "exp_avg_sq")]
                yield p, a, b, views

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
            for p, o in zip(u.params, u.offsets):
                out[p] = flat[o:o + p.numel()].view(p.shape).clone()
        return out

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by memory category (see :func:`edu3d.distributed.meter.measure`)."""
        params = [p for u in self.units for p in u.params] + [u.shard_param for u in self.units]
        grads = [p.grad for u in self.units for p in u.params if p.grad is not None]
        grads += [u.shard_grad for u in self.units]
        state = [] if self.optimizer is None else [
            t for s in self.optimizer.state.values() for t in s.values()
            if isinstance(t, torch.Tensor)]
        if self.offload:
            host = state + [u.host_param for u in self.units] + [u.host_grad for u in self.units]
            return {"params": params, "grads": grads, "optimizer": [], "host": host}
        return {"params": params, "grads": grads, "optimizer": state}
