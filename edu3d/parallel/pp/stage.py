"""A pipeline stage: a contiguous piece of the reference GPT.

After reading this file you should understand that a stage is nothing but some of the serial
model's own modules (the same tensors, not copies): the first stage also has the embedding,
the last stage also the final LayerNorm and the LM head. Parameter names are the serial
model's (``blocks.5.attn.qkv.weight``), so a stage's gradients can be compared with the
serial model's name by name.

A stage runs the model's *own* code for its ends: ``embed``, ``head`` and ``loss`` are the
GPT's bound methods, so whatever was applied to the model before the cut (tensor
parallelism's vocabulary-parallel embedding and loss, sequence parallelism's hooks) is what
the stage runs. Nothing is re-implemented here.

The engine may cut the first stage's graph between the embedding and the first block
(:attr:`PipelineStage.embed` output detached): that is what lets the split backward of the
zero-bubble schedules compute "the gradient of the stage's input" (``I``) on every stage,
the first one included; the embedding's own gradient then belongs to ``W``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from edu3d.schedules.actions import stage_rank


class PipelineStage(nn.Module):
    """Layers ``[first_layer, end_layer)`` of ``model``, plus embedding / head at the ends."""

    def __init__(self, model: nn.Module, first_layer: int, end_layer: int, is_first: bool,
                 is_last: bool):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self.layers = (first_layer, end_layer)
        if is_first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
            self.embed = model.embed  # a bound method: not a submodule, no parameters
        self.attention_mask = model.attention_mask  # bound: what apply_cp set, if it ran
        self.blocks = nn.ModuleDict({str(i): model.blocks[i]
                                     for i in range(first_layer, end_layer)})
        if is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
            self.head, self.loss = model.head, model.loss

    def forward(self, x: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        """Residual stream in, residual stream (or, on the last stage, logits) out; ``doc``:
        the packed documents' ids (every stage builds their mask from them)."""
        mask = None if doc is None else self.attention_mask(doc)
        for block in self.blocks.values():
            x = block(x) if mask is None else block(x, mask)
        return self.head(x) if self.is_last else x

    def embedding_parameters(self) -> list[nn.Parameter]:
        """The embedding tables' parameters (first stage; empty elsewhere)."""
        return [p for name in ("tok_emb", "pos_emb") if hasattr(self, name)
                for p in getattr(self, name).parameters()]

    def body_parameters(self) -> list[nn.Parameter]:
        """Parameters used after the input cut (everything but the embedding)."""
        skip = {id(p) for p in self.embedding_parameters()}
        return [p for p in self.parameters() if id(p) not in skip]


def split_model(model: nn.Module, parts: list[tuple[int, int]], pp: int,
                pp_rank: int, style: str = "loop") -> dict[int, PipelineStage]:
    """This pipeline rank's stages: global stage ``s`` lives on rank ``s % pp`` (``style``
    ``"loop"``), or as a V (``"v"``: rank ``r`` holds ``r`` and ``2p-1-r``), see
    :func:`~edu3d.schedules.actions.stage_rank`.

    With tied embeddings and more than one stage, the first stage's ``tok_emb.weight`` and
    the last stage's ``lm_head.weight`` are the same tensor at the start; when they sit on
    different ranks each keeps its own copy and the trainer adds their gradients up after
    the last micro-batch (Megatron's embedding group), so the copies stay equal."""
    last = len(parts) - 1
    return {s: PipelineStage(model, a, b, s == 0, s == last)
            for s, (a, b) in enumerate(parts) if stage_rank(s, pp, style) == pp_rank}
