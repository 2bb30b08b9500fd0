"""Pipeline parallelism on ``torch.distributed.pipelining``: edu3d's GPT cut at edu3d's
layer boundaries, run by PyTorch's schedules.

After reading this file you should understand what torchtitan's ``pipeline_llama`` does
for a model of its own:

* the model is cut by *module ownership*, not traced: each global stage keeps some blocks
  of the (already tensor-parallel) model, the first also the embeddings, the last also the
  final LayerNorm and the head; the ranges are edu3d's
  (:func:`edu3d.schedules.partition.partition`), and global stage ``s`` lives on pipeline
  rank ``s % pp`` (round robin, PyTorch's "loop" placement for interleaving), or for ZBV and
  DualPipeV on the rank of PyTorch's "v" placement (rank ``r`` holds ``r`` and ``2p-1-r``);
* each piece becomes a ``PipelineStage`` on the pp process group, and one schedule object
  (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` or ``ScheduleDualPipeV``)
  runs all of this rank's stages: ``step(x)`` on the
  rank holding stage 0, ``step(target=y, losses=...)`` on the one holding the last, and
  ``step()`` in between; it splits the batch into micro-batches and scales the gradients
  by ``1/m`` itself;
* the loss lives on the last stage (the schedule's ``loss_fn``); the shapes of the tensors
  sent between stages are found at the first step.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV,
                                          ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from edu3d.schedules.actions import placement, stage_rank

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved": ScheduleInterleaved1F1B, "zb-h1": ScheduleInterleavedZeroBubble,
             "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
# the schedule classes that take a list of stages
MULTI = ("interleaved", "zb-h1", "zbv", "dualpipev")


class Stage(nn.Module):
    """Blocks ``[first, end)`` of ``model``; the first stage embeds token ids, the last
    returns logits. The model's own modules, not copies."""

    def __init__(self, model: nn.Module, first: int, end: int, is_first: bool, is_last: bool):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        # keyed by serial layer number: parameter names stay the serial model's
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first, end)})
        if is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # GPT.embed, on this module's own tables
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.is_last else x


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT.loss: mean over tokens; on vocabulary-sharded DTensor logits inside
    ``loss_parallel()`` this is PyTorch's vocabulary-parallel cross entropy."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def cut(model: nn.Module, parts: list[tuple[int, int]], pp: int, pp_rank: int,
        schedule: str = "1f1b") -> dict:
    """This rank's stages by global index (stage ``s`` on rank ``s % pp``, or as the V of
    ``schedule``'s placement)."""
    last, style = len(parts) - 1, placement(schedule)
    return {s: Stage(model, a, b, s == 0, s == last)
            for s, (a, b) in enumerate(parts) if stage_rank(s, pp, style) == pp_rank}


def schedule(name: str, modules: dict, n_stages: int, microbatches: int, group, device):
    """PyTorch's schedule ``name`` over this rank's ``modules`` (stage index -> module,
    already wrapped by DDP or FSDP)."""
    stages = [PipelineStage(m, s, n_stages, device, group=group)
              for s, m in sorted(modules.items())]
    cls = SCHEDULES[name]
    if name in MULTI:
        return cls(stages, microbatches, loss_fn=cross_entropy)
    (stage,) = stages
    return cls(stage, microbatches, loss_fn=cross_entropy)
