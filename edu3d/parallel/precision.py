"""Mixed precision as part of the step: bf16 and fp16 autocast, fp16's dynamic loss scale.

After reading this file you should understand the two 16-bit recipes (Micikevicius et al.
2018; the bf16 practice of current LLM training):

* the **weights stay fp32** (the master copy), and so do the gradients, their reduction over
  dp and the optimizer state. Only the forward's matrix multiplications run in 16 bits, under
  ``torch.autocast``; the loss and the softmax are computed in fp32 by autocast's own rules;
* **bf16** has fp32's exponent range, so nothing overflows: autocast is all it takes;
* **fp16** has 5 exponent bits: small gradients underflow to zero. The loss is multiplied by
  a large *scale* before backward and the gradients divided by it afterwards. If any
  gradient overflowed (inf or nan), the step is skipped and the scale halved; after
  ``growth_interval`` good steps it doubles. The overflow test is the global gradient norm,
  and the verdict is agreed over the whole world (one all-reduce of a flag: the norm itself
  is summed only over the ranks that hold distinct pieces, so a data-parallel replica would
  not see another replica's inf). So all ranks skip the same step and keep the same scale;
  deciding locally, one rank would skip while the others step, and the replicas would
  silently diverge.

``fp8`` needs no autocast: its layers cast their own operands (:mod:`edu3d.parallel.fp8`),
and everything else computes in fp32.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class MixedPrecision:
    """Autocast for forwards, and fp16's loss scale."""

    def __init__(self, mode: str = "fp32", device_type: str = "cpu", init_scale: float = 2.0**16,
                 growth_interval: int = 2000, world: bool = False):
        if mode not in ("fp32", "fp8", *DTYPES):
            raise ValueError(f"precision {mode!r}: choose fp32, bf16, fp16 or fp8")
        self.mode, self.device_type, self.world = mode, device_type, world
        self.scale = init_scale if mode == "fp16" else 1.0
        self.growth_interval, self.good_steps = growth_interval, 0
        self.skipped = 0

    def autocast(self):
        """Where the forward runs: 16-bit matrix multiplications, fp32 weights."""
        if self.mode not in DTYPES:  # fp8: the FP8 layers cast for themselves
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=DTYPES[self.mode])

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.scale != 1.0 else loss

    def update(self, scaled_norm: torch.Tensor) -> bool:
        """After backward: True when the step must be skipped (the global norm of the scaled
        gradients is not finite on some rank). Adjusts the scale like
        ``torch.amp.GradScaler``."""
        if self.mode != "fp16":
            return False
        found = torch.logical_not(torch.isfinite(scaled_norm)).float().reshape(1)
        if self.world:  # the trainer's ranks are the whole world
            dist.all_reduce(found)  # bookkeeping: left out of the trace
        if found.item() > 0:
            self.scale /= 2
            self.good_steps = 0
            self.skipped += 1
            return True
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2
        return False
