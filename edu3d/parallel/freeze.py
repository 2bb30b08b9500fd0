"""Freezing parameters by name: ``edu3d train --freeze 'tok_emb.*,blocks.0.*'``.

After reading this file you should understand what a frozen parameter is in every layout,
and why freezing is one line per parameter rather than one per parallelism:

* a frozen parameter has ``requires_grad=False``. Autograd then computes no gradient for it
  (the gradient still flows *through* it to earlier layers: freezing the first blocks stops
  nothing behind them), so it has none to average, shard, clip or step;
* everything downstream already keys on ``requires_grad``: the optimizer's groups
  (:func:`edu3d.train.optim.param_groups`) take trainable parameters only, so a frozen one has
  no AdamW moments; data parallelism's buckets hold trainable parameters only; ZeRO's units
  hold every *trainable* parameter once (:func:`edu3d.parallel.zero.units.check_cover`), so a
  frozen one stays whole on every rank, never sharded (FSDP's ``use_orig_params`` shards
  frozen ones with the rest; edu3d keeps them out, which costs their bytes on every rank and
  no communication); the global norm adds the gradients that exist;
* the globs match the **serial** parameter names (``fnmatch``: ``*`` crosses dots), so one
  ``--freeze`` means the same numbers in every layout: it is applied after tensor
  parallelism swapped the layers (their new parameters keep the serial names) and before the
  pipeline cut and DP/ZeRO (:func:`edu3d.parallel.parallelize.parallelize`);
* a tied head is the token embedding: freezing ``tok_emb.*`` freezes it too, and
  ``lm_head.*`` matches nothing in a tied model (``named_parameters`` yields the matrix once).

A glob that matches nothing is almost always a typo; ``check_patterns`` refuses it with a few
real names, before any process starts. The matching rule itself (``patterns``, ``matching``,
``check_patterns``) lives in :mod:`edu3d.model.param_globs`, below this floor, so that the
planner (:mod:`edu3d.plan.inventory`) counts exactly the parameters this file freezes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from edu3d.model.gpt import GPT
from edu3d.model.param_globs import frozen


def param_names(config) -> list[str]:
    """The serial GPT's parameter names for ``config``, without allocating it (meta device)."""
    with torch.device("meta"):
        return [n for n, _ in GPT(config).named_parameters()]


def apply_freeze(model: nn.Module, globs) -> list[str]:
    """``requires_grad_(False)`` on every parameter of ``model`` whose serial name matches;
    returns their names."""
    names = []
    for name, p in model.named_parameters():
        if globs and frozen(name, globs):
            p.requires_grad_(False)
            names.append(name)
    return names
