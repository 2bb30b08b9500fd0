"""``edu3d train --impl torch``: the same layout, model, data and optimizer as edu3d's own
:class:`~edu3d.train.trainer.Trainer`, executed by PyTorch's parallel APIs, composed as torchtitan
composes them.

After reading this file you should understand how each of edu3d's mechanisms maps onto a
PyTorch API, in torchtitan's order (TP, then recomputation, then the pipeline cut, then
data parallelism over what is left):

==============================  ===========================================================
edu3d                            PyTorch
==============================  ===========================================================
``Mesh`` (tp fastest, then dp)   ``init_device_mesh(dev, (pp, dp, tp), ("pp", "dp", "tp"))``
``apply_tp`` (+ ``--sp``)        DTensor ``parallelize_module`` (:mod:`.torch_tp`),
                                 ``loss_parallel`` cross entropy
``--recompute full``             ``checkpoint_wrapper`` around each block
pipeline cut and schedules       ``torch.distributed.pipelining`` (:mod:`.torch_pp`)
``DataParallel`` (bucketed)      ``DistributedDataParallel`` (dp alone); ``replicate``
                                 (FSDP2's replicate) beside tp or pp
ZeRO-1                           ``ZeroRedundancyOptimizer`` over DDP (dp alone)
ZeRO-2 / ZeRO-3                  FSDP2 ``fully_shard`` per block and per stage,
                                 ``reshard_after_forward=False`` / ``True``
``--grad-reduce per-microbatch``  FSDP2's default: ``set_requires_gradient_sync(True)``
                                 on every micro-batch (reduce-scatter each backward)
``--grad-reduce per-step``        ``set_requires_gradient_sync(False)`` but on the last;
                                 ZeRO-3 also ``set_reshard_after_forward(False)`` and
                                 ``set_reshard_after_backward(False)`` but on the last
                                 (under ``--pp``, torch's pipelining does this itself)
ZeRO-2's whole parameters        ``set_reshard_after_backward(False)`` but on the last
                                 micro-batch (gathered once per step, either mode)
``--hsdp R`` (ZeRO-2/3)          FSDP2 on a 2-D mesh: ``init_device_mesh(dev, (pp, R, dp/R,
                                 tp), ("pp", "dp_replicate", "dp_shard", "tp"))`` and
                                 ``fully_shard(mesh=mesh["dp_replicate", "dp_shard"])``;
                                 per micro-batch ``set_requires_all_reduce`` on the last
                                 only (edu3d all-reduces the summed shard once per step)
``GradSync.norm`` + clip         the norm of DTensor gradients (``full_tensor``), summed
                                 over pp by hand as torchtitan does, then
                                 ``clip_grads_with_norm_``
==============================  ===========================================================

What stays edu3d's: the model and its initial weights (``GPT(config, seed)`` on every rank,
then parallelized), the global batch of each step, its cut into dp rows and micro-batches,
the AdamW/SGD rule with its weight-decay groups, the learning-rate schedule, and the loss
reported (the global batch's mean, equal on every rank).
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from edu3d.train.cut import microbatches, shard_rows
from edu3d.config.layout import Layout
from edu3d.distributed.mesh import Mesh
from edu3d.train.optim import lr_at, optimizer_for, param_groups, set_lr
from edu3d.schedules.partition import partition
from edu3d.schedules.actions import chunks
from edu3d.production import torch_pp
from edu3d.production.torch_tp import apply_tp, serial_qkv


def _data_parallel(modules: dict, mesh, zero: int, layout: Layout, hsdp: int) -> None:
    """Wrap each stage module (in place in ``modules``) for data parallelism over dp (under
    HSDP, FSDP2 over the 2-D mesh: replicate across its first dimension, shard along the
    second)."""
    dp_mesh = mesh["dp_replicate", "dp_shard"] if hsdp > 1 else mesh["dp"]
    for s, module in list(modules.items()):
        if zero >= 2:
            for block in module.blocks.values():  # one FSDP unit per block, one for the rest
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=zero == 3)
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=zero == 3)
        elif layout.tp > 1 or layout.pp > 1:
            # DDP cannot take DTensors, and under torch.distributed.pipelining's micro-batches
            # (torch 2.13) its reducer fails its bucket rebuild, or with static_graph=True
            # averages wrong gradients (measured: 34% off the serial norm). FSDP2's
            # replicate does both right: what torchtitan uses beside TP and PP
            replicate(module, mesh=dp_mesh)
        else:
            modules[s] = DistributedDataParallel(module, process_group=dp_mesh.get_group())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class TorchTrainer:
    """:class:`~edu3d.train.trainer.Trainer`'s interface (``mesh``, ``step``, ``stats``) on
    PyTorch's own APIs. ``model`` is the full serial GPT, the same on every rank."""

    def __init__(self, model: nn.Module, mesh: Mesh | None, args):
        self.mesh = mesh if mesh is not None else Mesh(Layout(), 0, {})
        self.args = args
        layout = self.layout = self.mesh.layout
        self.m = args.microbatches or args.grad_accum or layout.pp
        self.device = next(model.parameters()).device
        self.distributed = layout.world_size > 1
        self.dmesh = None
        self.hsdp = hsdp = args.parallel.hsdp
        if self.distributed and hsdp > 1:  # the dp axis cut in two, the shard one faster
            self.dmesh = init_device_mesh(
                self.device.type, (layout.pp, hsdp, layout.dp // hsdp, layout.tp),
                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
        elif self.distributed:
            self.dmesh = init_device_mesh(self.device.type, (layout.pp, layout.dp, layout.tp),
                                          mesh_dim_names=("pp", "dp", "tp"))
        tie = model.lm_head.weight is model.tok_emb.weight
        if layout.tp > 1:
            apply_tp(model, self.dmesh["tp"], args.parallel.sp)
        if args.memory.recompute == "full":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = checkpoint_wrapper(block)
        v = chunks(args.parallel.schedule, max(args.layout.vpp, layout.vpp)) if layout.pp > 1 else 1
        parts = partition(model.config, layout.pp, v)
        self.n_stages = len(parts)
        self.pp_index = self.mesh.index("pp")
        self.modules = torch_pp.cut(model, parts, layout.pp, self.pp_index, args.parallel.schedule)
        if tie and layout.pp == 1:  # one stage holds both uses: keep them one parameter
            stage = self.modules[0]
            stage.lm_head.weight = stage.tok_emb.weight
        self.zero = args.parallel.zero
        if layout.dp > 1:
            _data_parallel(self.modules, self.dmesh, self.zero, layout, hsdp)
        self.is_first = 0 in self.modules
        self.is_last = self.n_stages - 1 in self.modules
        self.schedule = None
        if layout.pp > 1:
            self.schedule = torch_pp.schedule(args.parallel.schedule, self.modules, self.n_stages, self.m,
                                              self.dmesh["pp"].get_group(), self.device)
        self.params = [p for mod in self.modules.values() for p in mod.parameters()]
        self.optimizer = self._optimizer()

    def _optimizer(self):
        groups = param_groups(self.params, self.args.training.weight_decay)
        if self.zero == 1:
            cls, kw = ((torch.optim.SGD, {}) if self.args.training.optimizer == "sgd" else
                       (torch.optim.AdamW, {"betas": (0.9, 0.95)}))
            return ZeroRedundancyOptimizer(groups, optimizer_class=cls, lr=self.args.training.lr,
                                           process_group=self.dmesh["dp"].get_group(), **kw)
        return optimizer_for(groups, self.args)

    # ---- the step -------------------------------------------------------------------------------
    def _context(self):
        return loss_parallel() if self.layout.tp > 1 else contextlib.nullcontext()

    def _sync(self, module, last: bool):
        """Gradient accumulation without a pipeline: DDP and replicate reduce after the last
        micro-batch only; FSDP2 (``--zero 2/3``) as ``--grad-reduce`` says: every micro-batch
        (its default), or per step with full gradients (and ZeRO-3's parameters kept
        unsharded) until the last, which reshards as usual."""
        if hasattr(module, "no_sync"):  # DDP
            return contextlib.nullcontext() if last else module.no_sync()
        if self.zero == 2:  # ZeRO-2 keeps whole parameters: gathered once per step
            module.set_reshard_after_backward(last)
        if self.zero >= 2 and self.args.parallel.grad_reduce == "per-microbatch":
            module.set_requires_gradient_sync(True)
            if self.hsdp > 1:  # reduce-scatter every micro-batch, all-reduce the sum once
                module.set_requires_all_reduce(last)
        elif hasattr(module, "set_requires_gradient_sync"):  # FSDP2 and its replicate
            module.set_requires_gradient_sync(last)
            if self.zero == 3:
                module.set_reshard_after_backward(last)
                module.set_reshard_after_forward(last)
        return contextlib.nullcontext()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradients of the global batch's mean loss; returns that loss on every rank."""
        dp, dp_i = self.mesh.size("dp"), self.mesh.index("dp")
        xs, ys = shard_rows(x, dp_i, dp), shard_rows(y, dp_i, dp)
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)
        losses = []
        with self._context():
            if self.schedule is not None:
                args = (xs,) if self.is_first else ()
                kw = {"target": ys, "losses": losses} if self.is_last else {}
                self.schedule.step(*args, **kw)
            else:
                module = self.modules[0]
                for i, (xm, ym) in enumerate(microbatches(xs, ys, self.m)):
                    with self._sync(module, i == self.m - 1):
                        loss = torch_pp.cross_entropy(module(xm), ym)
                        (loss / self.m).backward()
                    losses.append(loss.detach())
        mine = self.is_last and self.mesh.index("tp") == 0 and losses
        total = (torch.stack([_local(t) for t in losses]).sum().reshape(1) if mine
                 else torch.zeros(1, device=self.device))
        if self.distributed:
            dist.all_reduce(total)
        return total[0] / (dp * self.m)

    def _grad_groups(self) -> list[list[nn.Parameter]]:
        """Parameters with gradients, grouped so that one group's gradients are all plain
        tensors or all DTensors on one mesh with one placement (torch's foreach kernels
        refuse a mixed list; TP leaves the LayerNorms plain without --sp)."""
        groups: dict = {}
        for p in self.params:
            g = p.grad
            if g is not None:
                key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
                groups.setdefault(key, []).append(p)
        return list(groups.values())

    def grad_norm(self) -> torch.Tensor:
        """The serial model's gradient norm: DTensor gradients are reduced over the mesh
        dimensions they are sharded on (``full_tensor`` of their norm), plain ones are whole
        on this rank; the pipeline stages' squares are summed over pp."""
        sq = torch.zeros((), device=self.device)
        # DTensor warns that a norm partial over (dp, tp) takes two all-reduces, one per
        # mesh dimension: true, and equal on every rank; quiet it
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        for params in self._grad_groups():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
            sq = sq + _local(norm) ** 2
        if self.layout.pp > 1:  # torchtitan: all-reduce the p-th power over the pp group
            dist.all_reduce(sq, group=self.dmesh["pp"].get_group())
        return sq.sqrt()

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> dict:
        loss = self.forward_backward(x, y)
        norm = self.grad_norm()
        if self.args.training.clip > 0:
            for params in self._grad_groups():
                torch.nn.utils.clip_grads_with_norm_(params, self.args.training.clip, norm)
        set_lr(self.optimizer, lr_at(step, self.args))
        self.optimizer.step()
        return {"loss": loss.item(), "grad_norm": norm.item()}

    @torch.no_grad()
    def gather(self, what: str = "grad") -> dict[str, torch.Tensor]:
        """Full serial tensors by serial name, ``"param"`` or ``"grad"``, on every rank (as
        :meth:`edu3d.train.trainer.Trainer.gather`). Collective and untraced: for tests and
        benchmarks, not for training."""
        log = logging.getLogger("torch.distributed.tensor._redistribute")
        log.setLevel(logging.ERROR)  # FSDP-over-TP shards gather in two steps; it warns
        mine = {}
        for module in self.modules.values():
            for name, p in module.named_parameters():
                name = name.replace("_checkpoint_wrapped_module.", "")
                name = name[len("module."):] if name.startswith("module.") else name
                t = p if what == "param" else p.grad
                t = torch.zeros_like(_local(p)) if t is None else _local(t)
                if self.layout.tp > 1 and name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
                    t = serial_qkv(t, self.layout.tp)
                mine[name] = t.detach().clone()
        if self.layout.pp == 1:
            return mine
        stages: list = [None] * self.layout.pp
        dist.all_gather_object(stages, mine, group=self.dmesh["pp"].get_group())
        return {k: v for part in stages for k, v in part.items()}

    def stats(self) -> dict:
        """Nothing: edu3d's memory and communication counters are edu3d's trainer's."""
        return {}
