"""A pipeline-parallel training step that reproduces the serial step exactly.

After reading this file you should understand the bookkeeping around the engine:

1. each data-parallel replica takes its rows of the global batch and cuts them into ``m``
   micro-batches;
2. the engine runs the schedule; each stage's gradients are the sum over micro-batches of
   ``∂(loss_i / m)``, i.e. the gradient of the mean loss;
3. gradients are averaged over the data-parallel replicas **once per step** (one all-reduce
   of all of a rank's gradients, SUM then divide, after the last micro-batch);
4. the gradient norm needs every stage's share: each rank sums its squares, the pipeline
   group adds them up; clipping and the learning rate then follow ``edu3d.train.train_step``;
5. the loss lives on the last stage; it is summed over the pipeline group (the other stages
   contribute 0) and averaged over replicas, so rank 0 can print it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from edu3d import comm
from edu3d.data import microbatches, shard_rows
from edu3d.parallel.pp.engine import PipelineEngine
from edu3d.parallel.pp.partition import partition
from edu3d.parallel.pp.schedules import Action, build, chunks, with_comms
from edu3d.parallel.pp.stage import split_model
from edu3d.train import clip_and_step, make_optimizer


def _unscaled(loss: torch.Tensor, m: int) -> torch.Tensor:
    return loss  # the bug: m micro-batches' gradients add up to m times the mean's


class PipelineTrainer:
    """Holds this rank's stages, their optimizer and the engine; :meth:`step` trains."""

    def __init__(self, model: nn.Module, mesh, schedule: str = "1f1b", microbatches: int = 4,
                 args=None, partition_method: str = "uniform", scale_loss: bool = True,
                 vpp: int | None = None, compute=None, microbatch_loss=None):
        """``compute`` (per-rank lists of compute actions, e.g. from a learner's generator)
        replaces the named schedule's; ``scale_loss=False`` drops the 1/m (the bug the
        exercise hunts); ``microbatch_loss(loss, m)`` replaces the scaling altogether."""
        layout = mesh.layout
        if layout.tp > 1:
            raise ValueError(f"tp={layout.tp}: this pipeline trainer cuts whole layers; "
                             "combine it with tensor parallelism through edu3d's 3D trainer")
        self.mesh, self.args, self.m = mesh, args, microbatches
        vpp = layout.vpp if vpp is None else vpp
        pp, v = layout.pp, chunks(schedule, vpp)
        if schedule != "interleaved" and vpp > 1:
            raise ValueError(f"vpp={vpp} needs --schedule interleaved, not {schedule}")
        parts = partition(model.config, pp, v, method=partition_method)
        self.pp_rank = mesh.index("pp")
        self.stages = split_model(model, parts, pp, self.pp_rank)
        self.module = nn.ModuleDict({str(s): st for s, st in self.stages.items()})
        if compute is None:
            actions = build(schedule, pp, microbatches, v)
        else:
            actions = with_comms([[a if isinstance(a, Action) else Action.parse(a) for a in ops]
                                  for ops in compute], pp, v)
        if not scale_loss:
            microbatch_loss = _unscaled
        self.engine = PipelineEngine(self.stages, actions[self.pp_rank], len(parts),
                                     mesh.ranks("pp"), mesh.groups.get("pp"), microbatches,
                                     microbatch_loss)
        self.params = list(self.module.parameters())
        self.optimizer = make_optimizer(self.module, args) if args is not None else None

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradients of the global batch's mean loss in this rank's parameters; returns
        that loss (the same on every rank)."""
        dp, dp_rank = self.mesh.size("dp"), self.mesh.index("dp")
        x, y = shard_rows(x, dp_rank, dp), shard_rows(y, dp_rank, dp)
        for p in self.params:
            p.grad = None
        losses = self.engine.run(microbatches(x, y, self.m))
        if dp > 1:  # once per step, after the last micro-batch
            grads = [p.grad for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, group=self.mesh.dp)
            flat /= dp
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))
        loss = torch.stack(losses).sum() / self.m if losses else torch.zeros(())
        loss = loss.reshape(1).clone()
        if self.mesh.size("pp") > 1:
            comm.all_reduce(loss, group=self.mesh.pp)
        if dp > 1:
            comm.all_reduce(loss, group=self.mesh.dp)
            loss /= dp
        return loss[0]

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm: squares summed over this rank's stages, then over the
        pipeline group (data-parallel replicas hold the same gradients)."""
        sq = torch.stack([p.grad.detach().pow(2).sum() for p in self.params]).sum().reshape(1)
        if self.mesh.size("pp") > 1:
            comm.all_reduce(sq, group=self.mesh.pp)
        return sq[0].sqrt()

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> dict:
        """One optimizer step on the global batch, as ``edu3d.train.train_step``."""
        loss = self.forward_backward(x, y)
        norm = self.grad_norm()
        clip_and_step(self.optimizer, self.params, norm, step, self.args)
        return {"loss": loss.item(), "grad_norm": norm.item()}


def build_trainer(model: nn.Module, mesh, args) -> PipelineTrainer:
    """What ``edu3d train --pp P [--vpp V] --schedule S --microbatches M`` runs on each rank.

    ``model`` is the full reference GPT (same config and seed on every rank); ``args`` are
    ``edu3d train``'s options plus ``schedule`` (default ``1f1b``) and ``microbatches``
    (default ``pp``)."""
    return PipelineTrainer(model, mesh, getattr(args, "schedule", None) or "1f1b",
                           getattr(args, "microbatches", None) or mesh.layout.pp, args,
                           getattr(args, "partition", None) or "uniform")
