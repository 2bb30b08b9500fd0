"""Exercise 04: tensor-parallel layers and the vocabulary-parallel loss.

Fill in every function and method below, save, and re-run exercises/04_tensor_parallel.ipynb.
Every function takes the tensor-parallel process group ``group`` explicitly; rank ``r`` of
``t`` (``dist.get_rank(group)``, ``dist.get_world_size(group)``) holds shard ``r`` of every
split tensor. Use :mod:`edu3d.distributed.comm` for collectives (``comm.all_reduce(t, group)`` sums ``t``
in place across the group); for a maximum, ``dist.all_reduce(t, op=dist.ReduceOp.MAX,
group=group)``.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it for the max)
import torch.nn.functional as F  # noqa: F401

from edu3d import comm  # noqa: F401


class IdentityAllReduce(torch.autograd.Function):
    """``f``: forward identity; backward all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("return x unchanged (x.view_as(x)) and keep the group in ctx "
                                  "for backward")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("every rank used the same x, so each holds a partial "
                                  "gradient: sum a copy of grad over ctx.group; "
                                  "return (grad, None)")


class AllReduceIdentity(torch.autograd.Function):
    """``g``: forward all-reduce; backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("sum a copy of x over the group (do not modify x in place)")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("each partial sum gets the full gradient: return (grad, None)")


def column_parallel_linear(x, weight_shard, bias_shard, group):
    """``Y_r = X · W_r^T + b_r``: this rank's output features. ``x`` is the full input."""
    raise NotImplementedError("apply f (IdentityAllReduce.apply(x, group)), then F.linear with "
                              "this rank's weight and bias shards")


def row_parallel_linear(x_shard, weight_shard, bias, group):
    """``Y = Σ_r X_r · W_r^T + b``: ``x_shard`` holds this rank's input features; ``bias`` is
    the full, replicated bias."""
    raise NotImplementedError("F.linear without bias, then g (AllReduceIdentity) to sum the "
                              "partial products, then add the bias once")


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy from this rank's vocabulary columns ``[start, start + V_r)``.

    Columns at or beyond ``vocab_size`` are padding. Returns the per-token loss (0 where the
    target is ``ignore_index``).
    """

    @staticmethod
    def forward(ctx, logits, target, group, start, vocab_size, ignore_index):
        raise NotImplementedError(
            "1) padding columns -> -inf; 2) global max per token (all-reduce MAX), subtract it; "
            "3) the target's logit if it is in your columns, else 0; 4) all-reduce (SUM) the "
            "sum of exp and the target logit; loss = log(sum_exp) - target_logit, 0 where "
            "ignored; save softmax = exp / sum_exp for backward")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("d loss / d logits = softmax - onehot(target) on your columns, "
                                  "times grad per token (0 for ignored tokens); no communication")


def vocab_parallel_cross_entropy(logits_shard, target, group, start, vocab_size,
                                 ignore_index=-100):
    """Mean cross entropy over the non-ignored tokens, like ``F.cross_entropy``.

    ``logits_shard``: ``[tokens, V_r]``, this rank's columns; ``target``: ``[tokens]``.
    """
    raise NotImplementedError("VocabParallelCrossEntropy.apply(...), summed and divided by "
                              "the number of tokens whose target is not ignore_index")
