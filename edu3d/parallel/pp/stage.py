"""A pipeline stage: a contiguous piece of the reference GPT.

After reading this file you should understand that a stage is nothing but some of the serial
model's own modules (the same tensors, not copies): the first stage also has the embedding,
the last stage also the final LayerNorm and the LM head. Parameter names are the serial
model's (``blocks.5.attn.qkv.weight``), so a stage's gradients can be compared with the
serial model's name by name.

Every stage's forward takes a residual stream ``x`` that requires grad: the received
activation, or on the first stage the embedding's output cut off from the graph
(:meth:`PipelineStage.embed`). The cut is what lets the split backward compute "the gradient
of the stage's input" (``I``) on every stage, the first one included; the embedding's own
gradient then belongs to ``W``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class PipelineStage(nn.Module):
    """Layers ``[first_layer, end_layer)`` of ``model``, plus embedding / head at the ends."""

    def __init__(self, model: nn.Module, first_layer: int, end_layer: int, is_first: bool,
                 is_last: bool):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self.layers = (first_layer, end_layer)
        if is_first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleDict({str(i): model.blocks[i]
                                     for i in range(first_layer, end_layer)})
        if is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids -> residual stream (first stage only), as ``GPT.embed``."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok_emb(idx) + self.pos_emb(pos)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual stream in, residual stream (or, on the last stage, logits) out."""
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.is_last else x

    def body_parameters(self) -> list[nn.Parameter]:
        """Parameters used after the input cut (everything but the embedding)."""
        skip = {id(p) for name in ("tok_emb", "pos_emb") if hasattr(self, name)
                for p in getattr(self, name).parameters()}
        return [p for p in self.parameters() if id(p) not in skip]

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of one micro-batch, as ``GPT.forward`` computes it."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def split_model(model: nn.Module, parts: list[tuple[int, int]], pp: int,
                pp_rank: int) -> dict[int, PipelineStage]:
    """This pipeline rank's stages (global stage ``s`` lives on rank ``s % pp``)."""
    if getattr(model.config, "tie_weights", False) and len(parts) > 1:
        raise ValueError("tied embeddings would put one matrix on the first and the last "
                         "stage; build the model without --tie for pipeline parallelism")
    last = len(parts) - 1
    return {s: PipelineStage(model, a, b, s == 0, s == last)
            for s, (a, b) in enumerate(parts) if s % pp == pp_rank}
