"""Megatron's tensor-parallel layers, each cut out of a serial layer's weights.

After reading this file you should understand:

* **column parallel** ``Y = X·[A1 A2]``: rank i holds the columns ``Ai`` (rows of torch's
  ``[out, in]`` weight) and computes ``Yi = X·Ai``, a slice of the output features. It needs
  all of ``X`` (operator ``f``: identity forward, all-reduce backward) and leaves ``Y`` split,
  unless asked to gather it;
* **row parallel** ``Y = X1·A1 + X2·A2``: rank i holds the rows ``Ai`` (columns of torch's
  weight) and an already-split input ``Xi``; the partial products are summed (operator ``g``:
  all-reduce forward, identity backward). The bias is added once, after the sum;
* column then row (MLP ``fc``/``proj``, attention ``qkv``/``proj``) needs no communication in
  between: one all-reduce per pair forward, one backward;
* under **sequence parallelism** the all-reduces become all-gather + reduce-scatter along the
  sequence (same bytes on a ring), and the column layer saves only its *shard* of the input,
  all-gathering it again in backward (Korthikanti et al. 2022): that is the memory saving;
* the **vocabulary-parallel** embedding and cross entropy: each rank owns a contiguous range
  of the (padded) vocabulary; lookups outside it give zero and an all-reduce adds the ranks
  up; the loss needs only three all-reduces of one number per token (the max, the sum of
  exponentials, the target's logit), never the full ``[tokens, vocab]`` logits;
* ``overlap=True``: the column layer's input-gradient all-reduce runs asynchronously while
  the weight gradient is computed, the overlap Megatron uses to hide TP backward traffic.

Shards are always *cut from full tensors* (:func:`shard`), so a TP model starts from exactly
the serial model's weights, and :func:`unshard` puts them back together.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from edu3d.distributed import comm
from edu3d.model.shapes import padded_size
from edu3d.parallel.tp import ops


# ---- cutting and gluing shards --------------------------------------------------------------
def shard(full: torch.Tensor, dim: int, rank: int, tp: int, parts: int = 1,
          pad_to: int | None = None) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim``.

    ``parts`` > 1 cuts each of ``parts`` equal blocks separately and concatenates the pieces:
    the fused ``qkv`` weight is ``[q | k | v]``, and a rank must get the *same heads* of q, k
    and v. ``pad_to`` first pads ``dim`` with zeros (the vocabulary to a multiple of tp).
    """
    if pad_to is not None and pad_to > full.shape[dim]:
        pad = list(full.shape)
        pad[dim] = pad_to - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad)], dim=dim)
    blocks = full.chunk(parts, dim=dim)
    return torch.cat([b.chunk(tp, dim=dim)[rank] for b in blocks], dim=dim).clone()


def unshard(shards: list[torch.Tensor], dim: int, parts: int = 1,
            size: int | None = None) -> torch.Tensor:
    """Inverse of :func:`shard`: glue every rank's shard (in rank order) into the full tensor,
    dropping padding beyond ``size``."""
    pieces = [s.chunk(parts, dim=dim) for s in shards]
    full = torch.cat([torch.cat([p[j] for p in pieces], dim=dim) for j in range(parts)], dim=dim)
    return full if size is None else full.narrow(dim, 0, size)


# ---- column parallel linear -------------------------------------------------------------------
class _ColumnParallelMatmul(torch.autograd.Function):
    """``Y_i = X · A_i^T + b_i``, with the input gradient's collective built in.

    Without sequence parallelism the input is the same on every rank and each rank's
    ``dL/dX = dL/dY_i · A_i`` is partial: it is all-reduced (``f``'s backward). ``overlap``
    starts that all-reduce asynchronously, computes the weight gradient meanwhile, and waits
    at the end (Megatron's async tensor-model-parallel all-reduce).

    With sequence parallelism the input was all-gathered by ``AllGatherReduceScatter`` (whose
    backward reduce-scatters the partial gradient); this layer keeps only *this rank's
    tokens* of it for backward and all-gathers them again there: an all-gather more, ``(t-1)/t``
    of the input's memory less (Korthikanti et al. 2022, section 4.2.3). ``overlap`` does
    not apply there: the reduce-scatter runs in that operator, after this layer's backward.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, overlap):
        n = ops.group_size(group)
        ctx.group, ctx.sp, ctx.overlap = group, sequence_parallel and n > 1, overlap
        ctx.has_bias = bias is not None
        kept = x.chunk(n, dim=1)[ops.group_rank(group)].clone() if ctx.sp else x
        ctx.save_for_backward(kept, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        kept, weight = ctx.saved_tensors
        group, n = ctx.group, ops.group_size(ctx.group)
        x = ops.all_gather(kept, group, dim=1) if ctx.sp else kept
        # under autocast the forward multiplied in 16 bits: so does the backward (autograd
        # casts each gradient back to its input's dtype, fp32 for the weights)
        weight, x = weight.to(grad.dtype), x.to(grad.dtype)
        grad_x = grad @ weight
        handle = None
        if n > 1 and not ctx.sp:
            grad_x = grad_x.contiguous()
            handle = comm.all_reduce(grad_x, group, async_op=ctx.overlap)
        grad_w = grad.flatten(0, -2).t() @ x.flatten(0, -2)
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        if handle is not None:
            handle.wait()
        return grad_x, grad_w, grad_b, None, None, None


class ColumnParallelLinear(nn.Module):
    """``Linear(in, out)`` whose output features are split over the tp ranks.

    The input is the whole sequence on every rank; under sequence parallelism it comes from
    ``AllGatherReduceScatter`` (``parallelize`` puts one before every column region).
    ``parts=3`` for a fused ``[q | k | v]`` weight (each rank gets the same heads of all
    three). ``gather_output`` all-gathers the output features (``AllGatherSplit``); otherwise
    the output stays split for a following :class:`RowParallelLinear`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, *,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 overlap: bool = False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel, self.overlap = sequence_parallel, overlap
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, parts: int = 1, pad_to: int | None = None,
                    **kw) -> "ColumnParallelLinear":
        """This rank's shard of a serial ``nn.Linear`` (weights copied, layout independent);
        ``pad_to`` pads the output features first (an LM head over a padded vocabulary)."""
        r, t = ops.group_rank(group), ops.group_size(group)
        w = shard(linear.weight.detach(), 0, r, t, parts, pad_to)
        b = None if linear.bias is None else shard(linear.bias.detach(), 0, r, t, parts, pad_to)
        return cls(w, b, group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ColumnParallelMatmul.apply(x, self.weight, self.bias, self.group,
                                        self.sequence_parallel, self.overlap)
        return ops.all_gather_split(y, self.group, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return (f"in={inp}, out_shard={out}, tp={ops.group_size(self.group)}, "
                f"sp={self.sequence_parallel}, overlap={self.overlap}")


# ---- row parallel linear ----------------------------------------------------------------------
class RowParallelLinear(nn.Module):
    """``Linear(in, out)`` whose input features are split: the input is already this rank's
    slice (the output of a :class:`ColumnParallelLinear`). The partial products are summed with
    ``g`` (all-reduce), or reduce-scattered over the sequence under sequence parallelism; the
    bias, replicated, is added after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, *,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, **kw) -> "RowParallelLinear":
        r, t = ops.group_rank(group), ops.group_size(group)
        w = shard(linear.weight.detach(), 1, r, t)
        b = None if linear.bias is None else linear.bias.detach().clone()
        return cls(w, b, group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = ops.reduce_scatter_all_gather(partial, self.group, 1)
        else:
            y = ops.all_reduce_identity(partial, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return (f"in_shard={inp}, out={out}, tp={ops.group_size(self.group)}, "
                f"sp={self.sequence_parallel}")


# ---- vocabulary parallel embedding --------------------------------------------------------------
class VocabParallelEmbedding(nn.Module):
    """``Embedding(vocab, d)`` with the vocabulary rows split over the tp ranks.

    The vocabulary is padded to a multiple of tp with zero rows no token ever looks up. A
    rank looks up the ids in its range ``[start, end)``, writes zeros for the others, and the
    ranks' results are summed (all-reduce; reduce-scatter over the sequence under SP).
    """

    def __init__(self, weight: torch.Tensor, vocab_size: int, group, *,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.vocab_size, self.sequence_parallel = group, vocab_size, sequence_parallel
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.start = ops.group_rank(group) * self.weight.shape[0]
        self.end = self.start + self.weight.shape[0]

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group, **kw) -> "VocabParallelEmbedding":
        r, t = ops.group_rank(group), ops.group_size(group)
        vocab = emb.weight.shape[0]
        w = shard(emb.weight.detach(), 0, r, t, pad_to=padded_size(vocab, t))
        return cls(w, vocab, group, **kw)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.end)
        local = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return ops.reduce_scatter_all_gather(local, self.group, 1)
        return ops.all_reduce_identity(local, self.group)

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size}, rows [{self.start}, {self.end}) of "
                f"{self.end - self.start} x tp={ops.group_size(self.group)}")


# ---- vocabulary parallel cross entropy ----------------------------------------------------------
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token ``loss = log Σ_v exp(z_v) - z_target`` from this rank's logit columns.

    Forward: three all-reduces of one number per token (max, Σ exp, target logit). Backward
    is local: ``dL/dz = softmax(z) - onehot(target)``, for this rank's columns only.
    """

    @staticmethod
    def forward(ctx, logits, target, group, start, vocab_size, ignore_index):
        z = logits.float()
        cols = start + torch.arange(z.shape[-1], device=z.device)
        z = z.masked_fill(cols >= vocab_size, float("-inf"))  # padded vocabulary rows
        zmax = ops.all_reduce_max(z.max(dim=-1).values, group) if ops.group_size(group) > 1 \
            else z.max(dim=-1).values
        z = z - zmax.unsqueeze(-1)
        ignored = target == ignore_index
        mine = (target >= start) & (target < start + z.shape[-1]) & ~ignored
        local_t = (target - start).masked_fill(~mine, 0)
        z_target = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        if ops.group_size(group) > 1:
            both = ops.all_reduce(torch.stack([sum_exp, z_target]), group)
            sum_exp, z_target = both[0], both[1]
        loss = (sum_exp.log() - z_target).masked_fill(ignored, 0.0)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_t, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, mine, ignored = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        g = g * grad.masked_fill(ignored, 0.0).unsqueeze(-1)
        return g, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, *,
                                 start: int | None = None, vocab_size: int | None = None,
                                 ignore_index: int = -100, reduction: str = "mean"):
    """Cross entropy from this rank's vocabulary columns ``logits[..., start:start+V/t]``.

    ``start`` defaults to ``rank * logits.shape[-1]``; columns at or beyond ``vocab_size``
    are padding and take no part. ``reduction`` is ``"mean"`` over the non-ignored tokens (as
    ``F.cross_entropy``; 0 rather than nan when every target is ignored), ``"sum"`` or
    ``"none"``. Equal on every rank of the group.
    """
    if start is None:
        start = ops.group_rank(group) * logits.shape[-1]
    if vocab_size is None:
        vocab_size = logits.shape[-1] * ops.group_size(group)
    per_token = _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), target.flatten(),
                                                  group, start, vocab_size, ignore_index)
    if reduction == "none":
        return per_token.view(target.shape)
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (target != ignore_index).sum().clamp(min=1)
