"""Keeping a mixture of experts balanced: the load-balancing loss, over which tokens it counts,
the router z-loss, and how a loss made deep inside the model reaches backward.

After reading this file you should understand:

* the Switch/GShard loss ``E · Σ_i f_i · P_i``: ``f_i`` the share of a token group's
  assignments that went to expert i (a count: no gradient), ``P_i`` the mean router
  probability of i over the same tokens (the gradient flows here, lowering the probability
  of the experts already busy). It is 1 at perfect balance and ``E/k`` at collapse (every
  token on the same k experts: ``f_i = 1/k`` for those k);
* **which tokens a group is** (``--aux-scope``, Megatron's three load-balancing types):

  - ``microbatch`` (Megatron's ``aux_loss``, the default): one forward's tokens, and under
    context parallelism the same micro-batch's tokens on the other cp ranks. A data rank's
    micro-batch is its own group, so ``--dp 2`` counts two groups where the serial run
    counts one: the run equals the serial command with ``dp x m`` micro-batches;
  - ``sequence`` (``seq_aux_loss``, DeepSeek-V2/V3's sequence-wise loss): each sequence is a
    group, and the loss is the mean over sequences. A sequence never spans data ranks or
    micro-batches, so every layout counts the same groups as the serial run;
  - ``global`` (``global_aux_loss``, Qwen's global-batch balance, 2025): ``f_i`` and
    ``P_i`` reduced over every data-parallel and context-parallel rank, so micro-batch j of
    the step is one group whatever the layout (the trainer gives each data rank its share
    of micro-batch j, :func:`edu3d.train.cut.shard_rows`);

* the gradient rule behind the counting: rank r's term is ``D · E · Σ_i f_i · p_i^(r) / N``
  (``p_i^(r)`` its own tokens' probability sum, ``N`` the group's tokens, ``D`` the ranks the
  group spans). The trainer averages gradients over those ranks, which gives exactly the
  gradient of ``E Σ f_i P_i`` over the whole group, as if one rank held it;
* the z-loss ``mean(logsumexp(logits)^2)`` (ST-MoE), which keeps the router's logits small;
* how an extra loss reaches backward without being returned: :class:`AuxLoss` passes the
  layer's output through unchanged and, in backward, gives the aux term the gradient the main
  loss would have (:func:`set_aux_scale`), so it works even when the layer sits on an earlier
  pipeline stage than the loss (Megatron's ``MoEAuxLossAutoScaler``).

The model floor cannot import :mod:`edu3d.distributed`: the one collective goes through the
``collectives`` it is given (plain ``torch.distributed`` by default, traced
:mod:`edu3d.distributed.comm` under parallel code; same signatures).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.model.config_schema import SCOPES  # noqa: F401 (its home: the config, torch-free)

_SCALE = {"aux": 1.0}


def set_aux_scale(scale: float) -> None:
    """What the main loss is multiplied by before backward (e.g. ``1 / microbatches``): the
    gradient :class:`AuxLoss` gives the aux terms, so they are weighted like the main loss."""
    _SCALE["aux"] = float(scale)


def aux_scale() -> float:
    return _SCALE["aux"]


class AuxLoss(torch.autograd.Function):
    """``AuxLoss.apply(out, aux)`` returns ``out`` unchanged; in backward ``out``'s gradient
    passes through and ``aux`` (a scalar) gets gradient ``aux_scale()``, exactly as if
    ``aux_scale() * aux`` had been added to the loss. The aux term thus joins backward where
    the layer's output does, on whatever pipeline stage that is."""

    @staticmethod
    def forward(ctx, out, aux):
        ctx.aux_shape = aux.shape
        ctx.aux_dtype = aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, aux_scale(), dtype=ctx.aux_dtype,
                                device=grad.device)


class TorchCollectives:
    """The collectives an MoE layer needs, straight on torch.distributed (SUM)."""

    @staticmethod
    def all_reduce(t, group=None):
        dist.all_reduce(t, group=group)

    @staticmethod
    def all_gather(out, t, group=None):
        dist.all_gather(list(out.chunk(dist.get_world_size(group))), t, group=group)


def balance_loss(probs: torch.Tensor, chosen: torch.Tensor, n_experts: int, groups: int,
                 group=None, size: int = 1, collectives=TorchCollectives
                 ) -> tuple[torch.Tensor, float]:
    """The load-balancing loss of ``probs`` ``[n, E]`` and the experts ``chosen`` ``[n, k]``,
    whose rows are ``groups`` equal token groups (1, or the sequences of a micro-batch under
    ``--aux-scope sequence``; rows in sequence order). Each group's counts and probability
    sums are summed over the ``size`` ranks of ``group`` (the rest of its tokens), then
    ``E · Σ_i f_i · P_i`` is averaged over the groups.

    Returns ``(term, value)``: ``term`` carries this rank's gradient (``size`` times its share,
    see the module docstring), ``value`` is the loss itself, the same on every rank."""
    n, k = chosen.shape
    per_group = n // groups
    counts = torch.zeros(groups, n_experts, dtype=torch.float64, device=probs.device)
    rows = torch.arange(n, device=probs.device).div(per_group, rounding_mode="floor")
    counts.index_put_((rows.repeat_interleave(k), chosen.flatten()),
                      torch.ones(n * k, dtype=torch.float64, device=probs.device),
                      accumulate=True)
    local = probs.view(groups, per_group, n_experts).sum(1)  # [groups, E], with gradient
    summed = torch.cat([counts, local.detach().double()], 1)
    if size > 1:
        collectives.all_reduce(summed, group)
    tokens = per_group * size
    f = summed[:, :n_experts] / (tokens * k)
    term = size * n_experts * (f.to(probs.dtype) * local / tokens).sum(1).mean()
    value = n_experts * float((f * summed[:, n_experts:] / tokens).sum(1).mean())
    return term, value


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss ``mean(logsumexp(logits)^2)``: small logits, a stable softmax."""
    return torch.logsumexp(logits, -1).square().mean()
