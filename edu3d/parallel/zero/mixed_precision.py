"""ZeRO in mixed precision: FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``.

After reading this file you should understand where each precision lives when
:class:`~edu3d.parallel.zero.sharding.Zero` is given ``param_dtype=torch.bfloat16`` (the
mixed-precision recipe of the ZeRO paper, 2Ψ bytes of parameters plus K=12 bytes of fp32
state per parameter):

* **compute**: a unit's flat buffer, so every parameter the model computes with, is in
  ``param_dtype``; ZeRO-3's all-gathers move ``param_dtype`` (half the bytes). The model's
  floating inputs are cast to it before its forward (FSDP2's ``cast_forward_inputs``), and
  frozen parameters, which belong to no unit, are cast once (they never step; their values
  before the cast are kept for ``state_dict``, as FSDP2 keeps every parameter's);
* **gradients**: autograd produces them in ``param_dtype``; they are reduced in
  ``reduce_dtype`` (default ``param_dtype``; fp32 sums more exactly) and the gradient shard
  of stages 2-3 keeps the parameters' own dtype, so micro-batches accumulate at full
  precision (ZeRO-1's full gradients stay in ``param_dtype``, as DDP's on a bf16 model);
* **master weights**: the optimizer steps a copy of this rank's shard in the parameters' own
  dtype (:class:`~edu3d.parallel.zero.flat_unit.FlatUnit`'s ``master_init``), cast into the
  ``param_dtype`` shard after each step. ``model.state_dict()`` returns these full-precision
  values (gathered: collective) and ``model.load_state_dict`` writes them back, so a
  checkpoint loses nothing to the low-precision copy.
"""

from __future__ import annotations

import torch


def cast_frozen(model: torch.nn.Module, trainable: dict, dtype: torch.dtype) -> dict:
    """Cast the floating parameters of ``model`` that are not in ``trainable`` to ``dtype``;
    returns their values before the cast (``{param: tensor}``: what ``state_dict`` shows)."""
    originals = {}
    for p in model.parameters():
        if p not in trainable and p.is_floating_point():
            originals[p] = p.detach().clone()
            p.data = p.data.to(dtype)
    return originals


def cast_forward_inputs(model: torch.nn.Module, dtype: torch.dtype):
    """Cast every floating tensor argument of ``model``'s forward to ``dtype`` (a hook)."""

    def one(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def cast(module, args, kwargs):
        return tuple(map(one, args)), {k: one(v) for k, v in kwargs.items()}

    return model.register_forward_pre_hook(cast, with_kwargs=True)
