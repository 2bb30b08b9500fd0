"""FP8 training, emulated on a CPU and real on an FP8 GPU: casts, scales, layers, gathers.

Read in this order: :mod:`~edu3d.parallel.fp8.scaling` (the two formats, a scale, a cast,
the scaled matrix product; :func:`quantize` shows one tensor's scale and error),
:mod:`~edu3d.parallel.fp8.scales` (current and delayed scaling, and the reductions a
parallel layout adds), :mod:`~edu3d.parallel.fp8.fp8_linear` (the FP8 layers and
:func:`apply_fp8`), :mod:`~edu3d.parallel.fp8.fp8_gather` (ZeRO-3's weights gathered in FP8).
"""

from edu3d.parallel.fp8.scaling import (E4M3, E5M2, RECIPES, Quantized, amax, amax_to_scale,
                                        cast, quantize, scaled_mm)
from edu3d.parallel.fp8.scales import KINDS, SCALINGS, Fp8Scales, end_step, layers
from edu3d.parallel.fp8.fp8_linear import (Fp8ColumnParallelLinear, Fp8Linear, Fp8Matmul,
                                           Fp8RowParallelLinear, apply_fp8, scaled_linear)
from edu3d.parallel.fp8.fp8_gather import Fp8Gather, gathered_weights, install, split_units

__all__ = ["E4M3", "E5M2", "KINDS", "RECIPES", "SCALINGS", "Fp8ColumnParallelLinear",
           "Fp8Gather", "Fp8Linear", "Fp8Matmul", "Fp8RowParallelLinear", "Fp8Scales",
           "Quantized", "amax", "amax_to_scale", "apply_fp8", "cast", "end_step",
           "scaled_linear", "gathered_weights", "install", "layers", "quantize", "scaled_mm",
           "split_units"]
