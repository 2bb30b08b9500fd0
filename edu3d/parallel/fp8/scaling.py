"""FP8 numbers: two formats, a scale per tensor or per row, and the matrix product on them.

After reading this file you should understand how a tensor of 32-bit numbers becomes 8-bit
ones and back, and what a matrix product of FP8 numbers computes (Micikevicius et al. 2022,
"FP8 Formats for Deep Learning"; torchao's ``float8`` training, which torchtitan uses):

* **two formats**: ``float8_e4m3fn`` (4 exponent bits, 3 mantissa bits, largest 448) for
  forward's inputs and weights, where precision matters; ``float8_e5m2`` (5 and 2, largest
  57344) for gradients, whose values spread over a wider range. Three mantissa bits keep
  about one decimal digit: the relative rounding error of one cast is at most 2^-4;
* **a scale**: FP8 has so little range that a tensor is multiplied by ``s = fmax / amax``
  first (its largest magnitude lands on the format's largest number), then rounded:
  ``q = fp8(clamp(x·s, -fmax, fmax))``, and ``x ≈ q / s``. Without a scale, values below
  the format's smallest number (2^-9 for E4M3) become 0 and values above 448 overflow;
* **tensorwise or rowwise**: one scale for the whole tensor (torchao's ``tensorwise``
  recipe: one outlier squeezes every other value into fewer bits), or one per row along
  the dimension the product sums over (its ``rowwise`` recipe: each token and each output
  feature gets its own scale, rounded down to a power of two so that scaling is exact; all
  three tensors in E4M3, as the GPU's rowwise kernels take them);
* **the product**: ``torch._scaled_mm(qa, qb, 1/sa, 1/sb)`` is ``(qa @ qb) · (1/sa) · (1/sb)``.
  The product of two FP8 numbers (at most 4 significant bits each) is exact in fp32, and the
  tensor cores sum the products in fp32: so on a CPU :func:`scaled_mm` writes out the same
  arithmetic with an fp32 matrix product (equal to torch's own ``_scaled_mm`` within fp32
  summation order, ``tests/test_fp8.py``), and on a GPU that has FP8 tensor cores (compute
  capability 8.9 or more) it calls the real kernel.

:func:`quantize` shows one tensor's scale and cast error, for a chapter or a notebook cell.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edu3d.parallel.tp import ops

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
EPS = 1e-12  # torchao's floor under an amax: an all-zero tensor gets a finite scale


@dataclass(frozen=True)
class Recipe:
    """Which format each operand of a linear layer is cast to, and how its scales are cut."""

    name: str
    input: torch.dtype
    weight: torch.dtype
    grad: torch.dtype
    rowwise: bool  # one scale per row of the dimension summed over (else one per tensor)
    power_of_two: bool  # scales rounded down to a power of two (rowwise: exact scaling)


RECIPES = {
    "tensorwise": Recipe("tensorwise", E4M3, E4M3, E5M2, rowwise=False, power_of_two=False),
    "rowwise": Recipe("rowwise", E4M3, E4M3, E4M3, rowwise=True, power_of_two=True),
}


def fmax(fmt: torch.dtype) -> float:
    """The largest finite number of an FP8 format (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(fmt).max)


def amax(t: torch.Tensor, dim: int | None = None, group=None) -> torch.Tensor:
    """The largest magnitude of ``t`` (``dim=None``), or of each slice along ``dim`` (kept
    as a size-1 dimension), in fp32. ``group``: the ranks holding the other pieces of the
    same tensor along the dimension reduced (tensor parallelism's shards); their maximum is
    taken with one all-reduce, so every piece gets the scale the whole tensor would."""
    out = t.detach().abs().amax() if dim is None else t.detach().abs().amax(dim, keepdim=True)
    out = out.float()
    if group is not None and ops.group_size(group) > 1:
        out = ops.all_reduce_max(out, group)
    return out


def amax_to_scale(a: torch.Tensor, fmt: torch.dtype, power_of_two: bool = False) -> torch.Tensor:
    """``s = fmax / max(amax, 1e-12)`` in fp32 (computed in float64 first, as torchao does,
    so that every path rounds it the same way); ``power_of_two`` rounds it down to ``2^k``."""
    s = (fmax(fmt) / a.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(s))) if power_of_two else s


def cast(t: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """``fp8(clamp(t·s))``: saturating, as torchao casts (PyTorch's own cast of an
    out-of-range number saturates in E4M3 on a CPU but gives inf in E5M2); inside the range
    it is torch's round-to-nearest-even (``tests/test_fp8.py``)."""
    big = fmax(fmt)
    return (t.float() * scale).clamp(-big, big).to(fmt)


def fp8_kernels(device: torch.device) -> bool:
    """Whether ``device`` multiplies FP8 in hardware (a GPU of compute capability 8.9+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm(qa: torch.Tensor, qb: torch.Tensor, inv_a: torch.Tensor,
              inv_b: torch.Tensor) -> torch.Tensor:
    """``(qa @ qb) · inv_a · inv_b`` in fp32: ``qa [M, K]`` and ``qb [K, N]`` in FP8,
    ``inv_a`` a scalar or ``[M, 1]``, ``inv_b`` a scalar or ``[1, N]`` (the inverse scales,
    as ``torch._scaled_mm`` takes them). Emulated on a CPU, the real kernel on an FP8 GPU."""
    if fp8_kernels(qa.device):
        return real_scaled_mm(qa, qb, inv_a, inv_b)
    return (qa.float() @ qb.float()) * inv_a * inv_b


def real_scaled_mm(qa: torch.Tensor, qb: torch.Tensor, inv_a: torch.Tensor,
                   inv_b: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_mm``: ``qa`` row-major, ``qb`` column-major (cuBLAS's layout); a
    rowwise product gives bf16 on a GPU (the kernel's only output there), widened to fp32."""
    rowwise = inv_a.dim() > 0
    out = torch._scaled_mm(qa.contiguous(), qb.t().contiguous().t(), scale_a=inv_a.float(),
                           scale_b=inv_b.float(),
                           out_dtype=torch.bfloat16 if rowwise and qa.is_cuda else torch.float32)
    return out.float()


@dataclass
class Quantized:
    """One tensor cast to FP8: what :func:`quantize` shows."""

    q: torch.Tensor  # the FP8 numbers
    scale: torch.Tensor  # s (one, or one per row): x ≈ q / s
    dequantized: torch.Tensor  # q / s in fp32
    rel_error: float  # ||q/s - x|| / ||x||
    max_rel_error: float  # the largest |q/s - x| / |x| over the nonzero elements
    flushed: float  # share of the nonzero elements that became 0
    saturated: float  # share of the elements cast to ±fmax (clamped)


def quantize(t: torch.Tensor, scaling: str = "tensorwise", fmt: str = "e4m3",
             scale: torch.Tensor | None = None) -> Quantized:
    """Cast ``t`` to FP8 (``fmt``: ``"e4m3"`` or ``"e5m2"``) with its ``scaling``'s scale
    (``"tensorwise"``, ``"rowwise"``: one per row of the last dimension), or a given
    ``scale`` (``torch.tensor(1.0)``: no scaling, to see what the scale buys), and measure
    what the cast lost."""
    dtype = FORMATS[fmt]
    recipe = RECIPES[scaling]
    x = t.detach().float()
    if scale is None:
        scale = amax_to_scale(amax(x, -1 if recipe.rowwise else None), dtype,
                              recipe.power_of_two)
    q = cast(x, scale, dtype)
    back = q.float() / scale
    nonzero = x != 0
    err = (back - x).abs()
    return Quantized(q, scale, back,
                     float(err.norm() / x.norm().clamp_min(EPS)),
                     float((err[nonzero] / x[nonzero].abs()).max()) if nonzero.any() else 0.0,
                     float((nonzero & (q.float() == 0)).sum() / nonzero.sum().clamp_min(1)),
                     float((q.float().abs() == fmax(dtype)).float().mean()))
