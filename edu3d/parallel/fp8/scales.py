"""Where an FP8 scale comes from: this tensor now (current) or earlier steps (delayed).

After reading this file you should understand the two ways a linear layer's three operands
(its input ``x``, weight ``w`` and output gradient ``g``) get their scales, and what a
parallel layout must add so that each scale is the one the serial model would compute:

* **current scaling** (torchao's dynamic scaling, the default of torchtitan's FP8): each
  tensor's amax is measured just before it is cast. Exact, but it reads the whole tensor
  before the cast can start;
* **delayed scaling** (Transformer Engine's ``DelayedScaling``): the scale comes from the
  largest amax of the last ``history`` steps, and this step's amax is only recorded. The
  cast needs no reduction first; a value above the history's range saturates to ±fmax.
  Once per step (:func:`end_step`) the recorded amaxes of every layer are reduced over the
  ranks that saw other pieces (one all-reduce per group, Megatron's amax reduction group)
  and pushed into the histories. The first step has no history: it scales currently.
  Tensorwise only: a row of activations is a token, a new one every step;
* **pieces of one tensor**: under tensor parallelism a column-parallel layer holds rows of
  ``w`` and columns of ``g``, a row-parallel one columns of ``x`` and ``w``. An amax taken
  over a sharded dimension is reduced over the tp group (a tiny all-reduce of the max), so
  every shard is cast with the whole tensor's scale; an amax along an unsharded dimension
  (a rowwise scale of a token whose features are all here) needs nothing. Data-parallel
  replicas cast their own micro-batches, as the serial reference casts each micro-batch:
  their amaxes meet only in delayed scaling's history.

An :class:`Fp8Scales` belongs to one linear layer; ZeRO-3's FP8 all-gather
(:mod:`edu3d.parallel.fp8.fp8_gather`) computes the weight's scale from the shards and
leaves it in :attr:`Fp8Scales.gathered` for the layer to use.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from edu3d.config.sections import Precision
from edu3d.parallel.fp8.scaling import RECIPES, amax, amax_to_scale
from edu3d.parallel.tp import ops

ROLES = ("x", "w", "g")  # a linear layer's input, weight and output gradient
SCALINGS, KINDS = tuple(RECIPES), ("current", "delayed")


class Fp8Scales:
    """One linear layer's scales. ``sharded``: for each role, the dimension of its 2-D form
    (``x [tokens, in]``, ``w [out, in]``, ``g [tokens, out]``) cut over ``group`` (tp), or
    None where every rank holds it whole."""

    def __init__(self, precision: Precision, group=None, sharded: dict | None = None):
        self.recipe = RECIPES[precision.fp8_scaling]
        self.delayed = precision.fp8_recipe == "delayed"
        if self.delayed and self.recipe.rowwise:
            raise ValueError("delayed scaling keeps one amax history per tensor, and a rowwise "
                             "scale belongs to a token that changes every step: use current "
                             "scaling with rowwise, or tensorwise with delayed")
        self.length = precision.fp8_history
        self.group = group
        self.sharded = {role: (sharded or {}).get(role) for role in ROLES}
        self.history = {role: torch.zeros(0) for role in ROLES}  # newest last
        self.step_amax: dict = {role: None for role in ROLES}  # delayed: this step's largest
        self.gathered: torch.Tensor | None = None  # the weight's scale, set by an FP8 gather

    def amax(self, role: str, t: torch.Tensor, dim: int | None) -> torch.Tensor:
        """``t``'s amax along ``dim`` (None: all of it), reduced over tp where ``dim`` runs
        across the shards."""
        cut = self.sharded[role]
        across = cut is not None and (dim is None or dim == cut)
        return amax(t, dim, self.group if across else None)

    def scale(self, role: str, t: torch.Tensor, fmt: torch.dtype,
              dim: int | None = None) -> torch.Tensor:
        """The scale to cast ``t`` (role ``role``) with: from the history when delayed and
        there is one, else from ``t`` itself. Delayed scaling records ``t``'s local amax."""
        if self.delayed:
            self.record(role, amax(t))
        return self.settle(role, fmt, lambda: self.amax(role, t, dim))

    def settle(self, role: str, fmt: torch.dtype, current) -> torch.Tensor:
        """The history's scale when delayed and there is one, else the scale of the amax
        ``current()`` gives (already reduced over the pieces)."""
        if self.delayed and len(self.history[role]):
            return amax_to_scale(self.history[role].max(), fmt)
        return amax_to_scale(current(), fmt, self.recipe.power_of_two)

    def record(self, role: str, a: torch.Tensor) -> None:
        """Delayed scaling: keep the largest amax of ``role`` seen this step (this rank's)."""
        a = a.detach().float()
        held = self.step_amax[role]
        self.step_amax[role] = a if held is None else torch.maximum(held, a)

    def weight_scale(self, w: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """The weight's scale: the FP8 all-gather's when it brought the weight, else
        :meth:`scale`'s."""
        if self.gathered is not None:
            return self.gathered.to(w.device)
        return self.scale("w", w, self.recipe.weight, dim)

    def push(self, amaxes: torch.Tensor) -> None:
        """Delayed scaling, at the end of a step: this step's reduced amaxes (one per role)
        join the histories, which keep the last ``length``."""
        for role, a in zip(ROLES, amaxes):
            kept = self.history[role].to(a.device)
            self.history[role] = torch.cat([kept, a.reshape(1)])[-self.length:]
            self.step_amax[role] = None


def layers(module: nn.Module) -> list[Fp8Scales]:
    """The scales of every FP8 layer of ``module``, in module order (the same on every rank
    of a pipeline stage)."""
    return [m.fp8 for m in module.modules() if isinstance(getattr(m, "fp8", None), Fp8Scales)]


def end_step(module: nn.Module, groups=()) -> None:
    """Delayed scaling's once-a-step reduction: every layer's recorded amaxes, maximised over
    each group in ``groups`` (tp, where shards differ; dp x cp, where data differ) in one
    all-reduce per group, pushed into the histories. Nothing for current scaling."""
    delayed = [s for s in layers(module) if s.delayed]
    if not delayed:
        return
    seen = [a for s in delayed for a in s.step_amax.values() if a is not None]
    device = seen[0].device if seen else torch.device("cpu")
    amaxes = torch.stack([torch.zeros((), device=device) if s.step_amax[r] is None
                          else s.step_amax[r] for s in delayed for r in ROLES])
    for group in groups:
        if group is not None and ops.group_size(group) > 1:
            amaxes = ops.all_reduce_max(amaxes, group)
    for i, s in enumerate(delayed):
        s.push(amaxes[i * len(ROLES):(i + 1) * len(ROLES)])
