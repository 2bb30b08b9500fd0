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
        raise NotImplementedError(
            "hint: f does nothing on the way forward; remember what backward will need")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError(
            "hint: every rank used the same input, so each holds only part of its "
            "gradient: what makes the whole one?")


class AllReduceIdentity(torch.autograd.Function):
    """``g``: forward all-reduce; backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError(
            "hint: each rank holds a partial result; forward must give every rank the "
            "complete one, without changing its input")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError(
            "hint: the output was the same on every rank: what gradient does each "
            "partial input get?")


def column_parallel_linear(x, weight_shard, bias_shard, group):
    """``Y_r = X · W_r^T + b_r``: this rank's output features. ``x`` is the full input."""
    raise NotImplementedError(
        "hint: this rank computes its own output features from the whole input; the "
        "input's gradient must still come out right on every rank")


def row_parallel_linear(x_shard, weight_shard, bias, group):
    """``Y = Σ_r X_r · W_r^T + b``: ``x_shard`` holds this rank's input features; ``bias`` is
    the full, replicated bias."""
    raise NotImplementedError(
        "hint: this rank holds some input features, so it computes a partial product; "
        "the ranks' partials add up to the output, and the bias belongs to the output "
        "once")


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy from this rank's vocabulary columns ``[start, start + V_r)``.

    Columns at or beyond ``vocab_size`` are padding. Returns the per-token loss (0 where the
    target is ``ignore_index``).
    """

    @staticmethod
    def forward(ctx, logits, target, group, start, vocab_size, ignore_index):
        raise NotImplementedError(
            "hint: compute the cross entropy without any rank ever seeing the whole row "
            "of logits: only per-token numbers may cross ranks, padding columns must "
            "never count, and the exponentials must not overflow")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError(
            "hint: the gradient of cross entropy with respect to the logits needs "
            "nothing another rank holds")


def vocab_parallel_cross_entropy(logits_shard, target, group, start, vocab_size,
                                 ignore_index=-100):
    """Mean cross entropy over the non-ignored tokens, like ``F.cross_entropy``.

    ``logits_shard``: ``[tokens, V_r]``, this rank's columns; ``target``: ``[tokens]``.
    """
    raise NotImplementedError(
        "hint: turn the per-token losses into the mean PyTorch's cross entropy returns: which "
        "tokens count?")


# ---- design: a tensor-parallel degree, with or without sequence parallelism -------------------
def choose_tp(job: str) -> tuple[int, bool]:
    """``(tp, sp)``: how many GPUs share one replica of the model by tensor parallelism
    (``tp`` divides the heads), and whether sequence parallelism shares the activations
    between the tensor-parallel layers too. One sequence per step, bf16 with AdamW:

    =====  ==========  ======  =======  =====  ========  ===============
    job    parameters  layers  d_model  heads  sequence  memory per GPU
    =====  ==========  ======  =======  =====  ========  ===============
    ``a``  2.7 B       32      2560     32     4096      40 GB
    ``b``  2.7 B       32      2560     32     6144      40 GB
    ``c``  6.7 B       32      4096     32     8192      40 GB
    =====  ==========  ======  =======  =====  ========  ===============

    A GPU holds 16 bytes per parameter over ``tp`` and every layer's activations, as
    chapter 04 counted them (Korthikanti et al.: without sequence parallelism the
    LayerNorms, dropouts and the layer's input stay whole on every tensor-parallel rank).
    A step is the compute (6 FLOPs per parameter and token, 400 TFLOP/s per GPU, shared by
    ``tp``) plus, at every layer, the collectives of the activations (forward and backward)
    on a ring of ``tp``: NVLink (150 GB/s, 5 us per step) inside a node of 8 GPUs,
    InfiniBand (25 GB/s) beyond. The target: within 90 % of the GPU's memory, and within
    5 % of the fastest plan that fits (the grader's model: ``cost`` in
    ``edu3d/course/ch04_tensor_parallel_grade.py``).
    """
    raise NotImplementedError(
        "hint: more tensor parallelism shares the weights and the compute but talks at "
        "every layer; which activations does plain TP leave whole on every rank, and "
        "what does the link beyond a node cost?")
