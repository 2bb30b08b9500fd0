"""FP8 linear layers: each matrix product of a block in FP8, swapped in like TP's layers.

After reading this file you should understand what one FP8 training step of a linear
layer ``y = x·wᵀ + b`` computes (torchao's ``Float8Linear``, which torchtitan swaps in for
``nn.Linear``), three products, each on operands cast just before it:

======  ==============  =====================================  ==============================
pass    product         tensorwise (one scale each)           rowwise (scales along the sum)
======  ==============  =====================================  ==============================
fprop   ``y = x·wᵀ``    x, w in E4M3                           x per token, w per output row
dgrad   ``dx = g·w``    g in E5M2, w as in fprop               g per token, w per input column
wgrad   ``dw = gᵀ·x``   g and x as above                       g per output, x per input
                                                               column, over the tokens
======  ==============  =====================================  ==============================

* the **master weights stay fp32**: ``w`` is the fp32 parameter, cast on every use; its
  gradient ``dw`` comes out of the product in fp32, as do ``y`` and ``dx``. The bias is
  added after the product, in fp32. Forward keeps the fp32 ``x`` and the scales for
  backward (torchao keeps the high-precision input too), so an FP8 layer saves what an fp32
  one does, and backward casts again with the same scales: the same FP8 numbers;
* a rowwise scale belongs to a row of the dimension the product sums over, so each of the
  three products casts its operands along its own dimension: ``w`` per output row in fprop,
  per input column in dgrad;
* the layers: :class:`Fp8Linear` replaces an ``nn.Linear``; under tensor parallelism
  :class:`Fp8ColumnParallelLinear` and :class:`Fp8RowParallelLinear` replace TP's layers,
  keeping their parameters and their collectives (``f`` before a column layer, ``g`` after
  a row layer) around an FP8 product, and telling the scales which dimension is cut over
  tp (:class:`~edu3d.parallel.fp8.scales.Fp8Scales`). Under sequence parallelism the
  column layer keeps only its tokens of ``x`` for backward and all-gathers them again
  there, as TP's own does (Korthikanti et al. 2022): FP8 saves what the fp32 layout saves;
* :func:`apply_fp8` swaps the four linear layers of every dense block (``attn.qkv``,
  ``attn.proj``, ``mlp.fc``, ``mlp.proj``): the embedding, the LM head and the loss stay
  fp32, as torchtitan leaves its output layer in high precision.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from edu3d.config.sections import Precision
from edu3d.parallel.fp8.scales import Fp8Scales
from edu3d.parallel.fp8.scaling import cast, scaled_mm
from edu3d.parallel.tp import ops
from edu3d.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear

BLOCK_LINEARS = (("attn", "qkv"), ("attn", "proj"), ("mlp", "fc"), ("mlp", "proj"))


def product(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
            fa: torch.dtype, fb: torch.dtype) -> torch.Tensor:
    """``a @ b`` with ``a`` cast to ``fa`` by scale ``sa`` and ``b`` to ``fb`` by ``sb``
    (scalars, or ``a``'s rows ``[M, 1]`` and ``b``'s columns ``[1, N]``)."""
    return scaled_mm(cast(a, sa, fa), cast(b, sb, fb), sa.reciprocal(), sb.reciprocal())


class Fp8Matmul(torch.autograd.Function):
    """``y = x·wᵀ`` with fprop, dgrad and wgrad in FP8 (the module docstring's table)."""

    @staticmethod
    def forward(ctx, x, w, scales: Fp8Scales, sp_group=None):
        r = scales.recipe
        x2 = x.reshape(-1, x.shape[-1])
        along = 1 if r.rowwise else None  # fprop sums over the input features
        sx = scales.scale("x", x2, r.input, along)
        sw = scales.weight_scale(w, along)
        y = product(x2, sx, w.t(), sw.t(), r.input, r.weight)
        ctx.scales, ctx.sp_group = scales, sp_group
        kept = x
        if sp_group is not None:  # keep this rank's tokens only, as TP's column layer does
            kept = x.chunk(ops.group_size(sp_group), dim=1)[ops.group_rank(sp_group)].clone()
        ctx.save_for_backward(kept, w, sx, sw)
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w, sx, sw = ctx.saved_tensors
        if ctx.sp_group is not None:  # the sequence again: an all-gather more
            x = ops.all_gather(x, ctx.sp_group, dim=1)
        scales, r = ctx.scales, ctx.scales.recipe
        x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        if r.rowwise:  # each product casts along the dimension it sums over
            sg_rows = scales.scale("g", g2, r.grad, 1)
            sw_cols = scales.scale("w", w, r.weight, 0)
            dx = product(g2, sg_rows, w, sw_cols, r.grad, r.weight)
            sg_cols = scales.scale("g", g2, r.grad, 0)
            sx_cols = scales.scale("x", x2, r.input, 0)
            dw = product(g2.t(), sg_cols.t(), x2, sx_cols, r.grad, r.input)
        else:  # one scale per tensor: fprop's casts of x and w serve again
            sg = scales.scale("g", g2, r.grad)
            dx = product(g2, sg, w, sw, r.grad, r.weight)
            dw = product(g2.t(), sg, x2, sx, r.grad, r.input)
        return dx.view(x.shape), dw, None, None


def scaled_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                  scales: Fp8Scales, sp_group=None) -> torch.Tensor:
    """``x·wᵀ + b`` with the product in FP8 and the bias added in fp32; ``sp_group``: keep
    only this rank's tokens of ``x`` for backward (a sequence-parallel column layer)."""
    y = Fp8Matmul.apply(x, w, scales, sp_group)
    return y if b is None else y + b


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose product runs in FP8; the same parameters."""

    fp8: Fp8Scales

    @classmethod
    def from_linear(cls, linear: nn.Linear, precision: Precision) -> "Fp8Linear":
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight, new.bias, new.fp8 = linear.weight, linear.bias, Fp8Scales(precision)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_linear(x, self.weight, self.bias, self.fp8)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8.recipe.name}"


class Fp8ColumnParallelLinear(ColumnParallelLinear):
    """TP's column layer with its product in FP8: ``w`` holds output rows and ``g`` output
    columns of the serial tensors, so their tensorwise amaxes (and ``g``'s per-token ones)
    are reduced over tp. Its input gradient is all-reduced by ``f`` (reduce-scattered by the
    sequence-parallel gather before it under SP), not overlapped with wgrad; under SP it
    keeps its tokens of ``x`` only."""

    fp8: Fp8Scales

    @classmethod
    def from_parallel(cls, layer: ColumnParallelLinear, precision: Precision):
        new = cls(layer.weight, None, layer.group, gather_output=layer.gather_output,
                  sequence_parallel=layer.sequence_parallel)
        new.bias = layer.bias
        new.fp8 = Fp8Scales(precision, layer.group, {"w": 0, "g": 1})
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sp = self.sequence_parallel and ops.group_size(self.group) > 1
        if not sp:
            x = ops.identity_all_reduce(x, self.group)
        y = scaled_linear(x, self.weight, self.bias, self.fp8, self.group if sp else None)
        return ops.all_gather_split(y, self.group, -1) if self.gather_output else y


class Fp8RowParallelLinear(RowParallelLinear):
    """TP's row layer with its product in FP8: ``x`` and ``w`` hold input columns, so their
    amaxes along the input features are reduced over tp; the partial products are summed
    (or reduce-scattered under SP) in fp32, then the bias is added."""

    fp8: Fp8Scales

    @classmethod
    def from_parallel(cls, layer: RowParallelLinear, precision: Precision):
        new = cls(layer.weight.detach(), None, layer.group,
                  sequence_parallel=layer.sequence_parallel)
        new.weight, new.bias = layer.weight, layer.bias
        new.fp8 = Fp8Scales(precision, layer.group, {"x": 1, "w": 1})
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = scaled_linear(x, self.weight, None, self.fp8)
        if self.sequence_parallel:
            y = ops.reduce_scatter_all_gather(partial, self.group, 1)
        else:
            y = ops.all_reduce_identity(partial, self.group)
        return y if self.bias is None else y + self.bias


def to_fp8(layer: nn.Module, precision: Precision) -> nn.Module:
    """The FP8 version of ``layer`` (an ``nn.Linear`` or one of TP's), same parameters."""
    if isinstance(layer, ColumnParallelLinear):
        return Fp8ColumnParallelLinear.from_parallel(layer, precision)
    if isinstance(layer, RowParallelLinear):
        return Fp8RowParallelLinear.from_parallel(layer, precision)
    if isinstance(layer, nn.Linear):
        return Fp8Linear.from_linear(layer, precision)
    raise TypeError(f"{type(layer).__name__}: FP8 replaces nn.Linear and TP's column and row "
                    "layers")


def apply_fp8(model: nn.Module, precision: Precision) -> list[str]:
    """Swap the four linear layers of every dense block of ``model`` (serial, or after
    :func:`~edu3d.parallel.tp.apply_tp`) for their FP8 versions, in place; returns the
    serial names of the weights now cast to FP8. A mixture-of-experts block keeps its
    MLP (its experts are not FP8 here)."""
    names = []
    for i, block in enumerate(model.blocks):
        for part, attr in BLOCK_LINEARS:
            parent = getattr(block, part)
            if not hasattr(parent, attr):
                continue
            setattr(parent, attr, to_fp8(getattr(parent, attr), precision))
            names.append(f"blocks.{i}.{part}.{attr}.weight")
    return names
