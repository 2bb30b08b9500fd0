"""An optimizer's state for one parameter, created before the first step when absent.

After reading this file you should understand why a checkpoint can be loaded into a run that
has not stepped yet: PyTorch's AdamW creates a parameter's state (the step count and the two
moments) lazily, in its first ``step()``; :func:`adam_state` creates it exactly as that first
step would (step 0, zero moments), so there is a tensor to load the saved moments into. The
plain trainer and ZeRO's shard pieces both hand their parameters to it.
"""

from __future__ import annotations

import torch


def adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """AdamW's state for ``p``, created as before its first step (step 0, zero moments)
    when absent: what a checkpoint is loaded into."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.tensor(0.0)  # AdamW's own scalar dtype (float32) on the CPU
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state
