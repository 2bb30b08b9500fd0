"""``apply_cp``: the serial GPT with its sequence cut over the ranks of a context-parallel group.

After reading this file you should understand:

* context parallelism changes only two things in the model: every block's attention core
  (:func:`~edu3d.parallel.cp.attention.cp_core` replaces ``attn.core``, so the block's own
  ``forward`` runs unchanged on this rank's tokens) and the position embedding, which must
  look up this rank's *global* positions instead of ``0 .. T/cp - 1``;
* every other layer (LayerNorm, MLP, the LM head, the loss) is per token, so it runs as is on
  ``T/cp`` tokens: no communication outside attention;
* each rank's loss is the mean over its own tokens; with equal token counts the mean of those
  over the ``cp`` ranks is the serial loss, and the sum of the ranks' gradients divided by
  ``cp`` is the serial gradient (K and V's gradients already travel back inside attention).
  So the dense gradients are averaged over DP x CP together (DESIGN.md, "5D gradients");
* :func:`split_batch` cuts the tokens and labels with the same split
  (:mod:`~edu3d.parallel.cp.zigzag`), so a label stays with its token;
* packed documents (``--batching pack``) need two things cut the same way. The positions
  restart at each document (:func:`~edu3d.model.gpt.document_positions`): they are computed
  on the whole row, then cut exactly as the tokens are, so a document that began on another
  rank's chunk goes on counting where it left off. And the mask: the model hands its
  blocks the whole row's document ids instead of a ``T x T`` mask
  (``model.attention_mask``), and every CP core reads each query's and key's document at
  its global position (:mod:`~edu3d.parallel.cp.attention`). A document boundary inside a
  chunk or exactly between two chunks is the same thing to it: only ids are compared.
  With packing the ranks hold different numbers of target tokens (padding sits at a row's
  end), so the loss is weighted by the global token count
  (:func:`edu3d.train.cut.cut`, which cuts every batch), not by ``1/cp``.

Parameter names and tensors are untouched: a checkpoint or an optimizer sees the serial model.
Order: ``apply_tp``, then ``apply_cp``, then recomputation (it wraps the core set here), then
the pipeline cut (a stage keeps references to ``model.embed`` and ``model.attention_mask``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from edu3d.model.gpt import document_positions
from edu3d.parallel.cp.attention import cp_core
from edu3d.parallel.cp.zigzag import check, positions, split_tokens


def apply_cp(model: nn.Module, group, cp_rank: int, cp: int, impl: str = "ring",
             split: str = "zigzag") -> nn.Module:
    """Make ``model`` (an edu3d GPT, tensor-parallel or not) work on rank ``cp_rank``'s
    tokens of each ``config.seq_len`` sequence, its attention exchanging K and V over
    ``group`` (``impl``: ring, allgather or ulysses). In place; returns ``model``."""
    seq_len = model.config.seq_len
    check(seq_len, cp, split)
    heads = model.blocks[0].attn.n_heads if len(model.blocks) else cp
    if impl == "ulysses" and heads % cp:
        ok = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        raise ValueError(f"Ulysses splits this rank's {heads} heads over cp={cp} ranks; "
                         f"choose cp in {ok} (or impl='ring' / 'allgather')")
    if any(hasattr(b.attn.core, "recomputed") or hasattr(b.forward, "recomputed")
           for b in model.blocks):
        raise ValueError("apply_cp replaces attn.core, which recomputation has wrapped: "
                         "apply_cp first, then apply_recompute")
    mine = positions(seq_len, cp, cp_rank, split)
    core = cp_core(impl, group, mine)
    for block in model.blocks:
        block.attn.core = core
    pos = torch.tensor(mine, dtype=torch.long)

    def embed(idx: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's token ids ``[B, seq_len/cp]`` -> residual stream, with the tokens'
        global positions (replaces ``GPT.embed`` on this instance). With packed documents,
        ``doc`` is the *whole* rows' document ids ``[B, seq_len]``: the restarting
        positions are computed on the whole row and cut as the tokens were."""
        if idx.shape[1] != len(mine):
            raise ValueError(f"cp rank {cp_rank} holds {len(mine)} of the {seq_len} tokens, "
                             f"got {idx.shape[1]}; cut the batch with split_batch")
        if doc is None:
            return model.tok_emb(idx) + model.pos_emb(pos.to(idx.device))
        whole_rows(doc)
        return model.tok_emb(idx) + model.pos_emb(
            split_tokens(document_positions(doc), cp, cp_rank, split))

    def whole_rows(doc: torch.Tensor) -> torch.Tensor:
        """The blocks' mask argument under CP: the whole rows' document ids, as they are
        (replaces ``GPT.attention_mask``, which builds the ``[B, 1, T, T]`` mask)."""
        if doc.shape[-1] != seq_len:
            raise ValueError(f"context parallelism takes the whole rows' document ids "
                             f"[B, {seq_len}] (every rank reads its tokens' and its keys' "
                             f"documents in them), got {tuple(doc.shape)}; do not cut doc")
        return doc

    model.embed = embed
    model.attention_mask = whole_rows
    model.cp_positions = mine
    return model


def split_batch(x: torch.Tensor, y: torch.Tensor, cp: int, cp_rank: int,
                split: str = "zigzag") -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and labels of a ``[B, T]`` batch."""
    return split_tokens(x, cp, cp_rank, split), split_tokens(y, cp, cp_rank, split)
