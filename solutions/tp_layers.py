"""Solution to exercise 04: tensor-parallel layers and the vocabulary-parallel loss.

Every function takes the tensor-parallel process group ``group`` explicitly; rank ``r`` of
``t`` holds shard ``r`` of every split tensor. Collectives go through :mod:`edu3d.distributed.comm`
(recorded in the trace) and always reduce with SUM; the only other reduction, the max in
the loss, is a numerical shift and uses ``ReduceOp.MAX``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from edu3d import comm


class IdentityAllReduce(torch.autograd.Function):
    """``f``: forward identity; backward all-reduce (every rank's gradient of the shared
    input is partial: the true one is their sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, ctx.group)
        return grad, None


class AllReduceIdentity(torch.autograd.Function):
    """``g``: forward all-reduce (sum the partial products); backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        comm.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def column_parallel_linear(x, weight_shard, bias_shard, group):
    """``Y_r = X · W_r^T + b_r``: this rank's output features. ``x`` is the full input."""
    return F.linear(IdentityAllReduce.apply(x, group), weight_shard, bias_shard)


def row_parallel_linear(x_shard, weight_shard, bias, group):
    """``Y = Σ_r X_r · W_r^T + b``: ``x_shard`` holds this rank's input features; ``bias`` is
    the full, replicated bias, added once after the sum."""
    return AllReduceIdentity.apply(F.linear(x_shard, weight_shard), group) + bias


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy from this rank's vocabulary columns ``[start, start + V_r)``.

    Columns at or beyond ``vocab_size`` are padding. Returns the per-token loss (0 where the
    target is ``ignore_index``).
    """

    @staticmethod
    def forward(ctx, logits, target, group, start, vocab_size, ignore_index):
        cols = start + torch.arange(logits.shape[-1])
        z = logits.masked_fill(cols >= vocab_size, float("-inf"))
        zmax = z.max(dim=-1).values
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        z = z - zmax.unsqueeze(-1)
        ignored = target == ignore_index
        mine = (target >= start) & (target < start + logits.shape[-1]) & ~ignored
        local = (target - start).masked_fill(~mine, 0)
        z_target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = z.exp()
        both = torch.stack([exp.sum(dim=-1), z_target])
        comm.all_reduce(both, group)
        sum_exp, z_target = both[0], both[1]
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine, ignored)
        return (sum_exp.log() - z_target).masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine, ignored = ctx.saved_tensors
        g = softmax.scatter_add(-1, local.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        return g * grad.masked_fill(ignored, 0.0).unsqueeze(-1), None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard, target, group, start, vocab_size,
                                 ignore_index=-100):
    """Mean cross entropy over the non-ignored tokens, like ``F.cross_entropy``.

    ``logits_shard``: ``[tokens, V_r]``, this rank's columns; ``target``: ``[tokens]``.
    """
    per_token = VocabParallelCrossEntropy.apply(logits_shard, target, group, start,
                                                vocab_size, ignore_index)
    return per_token.sum() / (target != ignore_index).sum()




# ---- design: a tensor-parallel degree, with or without sequence parallelism -------------------
def choose_tp(job: str) -> tuple[int, bool]:
    """The whole node (tp 8) while it fits: the compute shrinks with every GPU and NVLink's
    all-reduces cost little. At 6144 tokens plain TP keeps ``10 sbh`` per layer whole on
    every rank: only sequence parallelism fits in the node. At 8192 tokens and 6.7 B even
    tp 8 with SP does not fit: tp 16 crosses a node (slow all-reduces) but is still faster
    than tp 32."""
    return {"a": (8, True), "b": (8, True), "c": (16, True)}[job]


# The deeper hints of exercises/tp_layers.py (edu3d.course.grading.tiers): per function,
# a nudge (a check's second failure), then the answer's shape (its third).
HINTS = {'IdentityAllReduce': ('forward returns its input as is; backward sums the gradient over the '
                       "group (a copy: never change autograd's tensor in place)",
                       'forward: ctx.group = group; return x.view_as(x); backward: g = '
                       'grad.contiguous().clone(); comm.all_reduce(g, ctx.group); return g, '
                       'None'),
 'AllReduceIdentity': ('forward sums a copy of x over the group; backward passes the gradient '
                       'through unchanged',
                       'forward: out = x.contiguous().clone(); comm.all_reduce(out, group); '
                       'return out; backward: return grad, None'),
 'column_parallel_linear': ('apply f to the input first, then an ordinary linear with this '
                            "rank's shards",
                            'F.linear(IdentityAllReduce.apply(x, group), weight_shard, '
                            'bias_shard)'),
 'row_parallel_linear': ('a linear without bias on your shard, g to add up the partials, then '
                         'the bias once',
                         'AllReduceIdentity.apply(F.linear(x_shard, weight_shard), group) + '
                         'bias'),
 'VocabParallelCrossEntropy': ('padding columns to -inf; subtract the global max (all-reduce '
                               'MAX); the target logit only on the rank holding it; all-reduce '
                               '(SUM) the sum of exps and the target logit; backward: softmax '
                               'minus one-hot on your columns',
                               'loss = log(sum_exp) - target_logit, 0 where ignored; save '
                               'softmax = exp / sum_exp; backward: (softmax - onehot(target - '
                               'start)) * grad per token, 0 for ignored tokens; return the '
                               'gradient and five Nones'),
 'vocab_parallel_cross_entropy': ('the per-token losses summed, divided by the tokens that are '
                                  'not ignored',
                                  'VocabParallelCrossEntropy.apply(logits_shard, target, '
                                  'group, start, vocab_size, ignore_index).sum() / (target != '
                                  'ignore_index).sum()'),
 'choose_tp': ('the weights and the compute shrink with tp; plain TP leaves the LayerNorms, '
               'dropouts and inputs whole on every rank; a ring that leaves the node runs on '
               'the slow link',
               'the largest tp inside the node (8) with SP where plain TP does not fit; cross '
               'the node only when nothing inside fits: try plans with '
               'ch04_tensor_parallel_grade.cost')}
