"""The optimizer rule, the learning-rate schedule and clipping by a *given* norm.

After reading this file you should understand the three pieces of a step that every layout
shares with the serial run, which is why a parallel run can reproduce it number for number:

* **the rule**: AdamW (betas 0.9, 0.95) or plain SGD, with weight decay on matrices and
  embeddings only, not on biases or LayerNorm gains, which only shift and scale (nanoGPT);
  AdamW runs fused on a GPU, over tensor lists elsewhere (:func:`kernel_for`);
* **the schedule**: linear warmup from ``lr/warmup`` at step 1 to ``lr`` at step ``warmup``,
  then ``constant`` or ``cosine`` decay to ``lr/10`` at the last step;
* **clipping**: ``torch.nn.utils.clip_grad_norm_`` computes the norm of the gradients *it
  sees*; a rank that holds a shard sees a fraction of them. So the norm is computed
  elsewhere, over the whole model (:mod:`edu3d.parallel.grads`), and here every rank scales
  its own gradients by the same coefficient ``min(1, max_norm / (norm + 1e-6))``: the
  arithmetic of ``clip_grad_norm_``.
"""

from __future__ import annotations

import math

import torch

MIN_LR_RATIO = 0.1  # cosine decays to a tenth of the peak (Chinchilla, LLaMA)


def param_groups(params, weight_decay: float) -> list[dict]:
    """Two groups: decayed (2-D and up) and not decayed (biases, LayerNorm gains)."""
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def make_optimizer(params, run) -> torch.optim.Optimizer | None:
    """AdamW (betas 0.9, 0.95) or plain SGD over ``params`` (a module's, or any iterable);
    ``None`` when there is nothing to optimize."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    return optimizer_for(param_groups(params, run.training.weight_decay), run)


def optimizer_kwargs(run) -> dict:
    """The rule of ``run`` as a class and its defaults: ``{"optimizer_class", "lr", ...}``
    (what :class:`~edu3d.parallel.zero.sharding.Zero` takes, with the groups)."""
    if run.training.optimizer == "sgd":
        return {"optimizer_class": torch.optim.SGD, "lr": run.training.lr}
    return {"optimizer_class": torch.optim.AdamW, "lr": run.training.lr, "betas": (0.9, 0.95)}


def optimizer_for(groups: list[dict], run) -> torch.optim.Optimizer | None:
    """The rule of ``run`` (AdamW or SGD) over ready-made parameter groups; ``None`` for
    no groups."""
    groups = [g for g in groups if g["params"]]
    if not groups:
        return None
    kwargs = optimizer_kwargs(run)
    cls = kwargs.pop("optimizer_class")
    if cls is torch.optim.AdamW:
        kwargs.update(kernel_for(groups))
    return cls(groups, **kwargs)


def kernel_for(groups: list[dict]) -> dict:
    """AdamW's implementation for where the parameters live: ``fused=True`` (one kernel
    for every tensor) when they are all on a GPU, ``foreach=True`` (one operation per step
    of the rule, over the list of tensors) elsewhere: the same arithmetic as the loop over
    tensors, with far fewer Python calls."""
    params = [p for g in groups for p in g["params"]]
    if any(type(p) is not torch.nn.Parameter and type(p) is not torch.Tensor for p in params):
        return {}  # DTensors (--impl torch): torch's own choice, per-tensor over mixed kinds
    devices = {p.device.type for p in params}
    return {"fused": True} if devices == {"cuda"} else {"foreach": True}


def lr_at(step: int, run) -> float:
    """The learning rate of ``step`` (1-based): warmup, then constant or cosine."""
    warmup = run.training.warmup
    if warmup > 0 and step < warmup:
        return run.training.lr * step / warmup
    if run.training.lr_schedule != "cosine":
        return run.training.lr
    span = max(1, run.training.steps - warmup)
    progress = min(1.0, max(0, step - warmup) / span)
    low = run.training.lr * MIN_LR_RATIO
    return low + 0.5 * (run.training.lr - low) * (1 + math.cos(math.pi * progress))


def clip_coef(norm: torch.Tensor | float, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_``'s scale for a total norm ``norm``: at most 1; 1 when clipping is
    off (``max_norm`` 0)."""
    norm = torch.as_tensor(norm)
    if max_norm <= 0:
        return torch.ones_like(norm)
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
