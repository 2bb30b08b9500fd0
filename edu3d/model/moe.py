"""Mixture of experts: a router sends every token to k of E expert MLPs.

After reading this file you should understand:

* token-choice top-k routing: ``probs = softmax(x W_r^T)``, each token picks the k experts of
  highest probability, and the expert outputs are summed weighted by their *gates* (the chosen
  probabilities, renormalised to sum to 1 when ``norm_topk`` and k > 1);
* the two balancers: the Switch/GShard loss ``E · Σ_i f_i · P_i`` (``f_i`` share of the
  assignments that went to expert i, ``P_i`` mean probability of i; 1 at perfect balance, E
  at full collapse) and DeepSeek-V3's bias, added to the scores only to *select* experts and
  nudged after each step towards the under-used ones; and the ST-MoE z-loss
  ``mean(logsumexp(logits)^2)`` that keeps the router's logits small;
* how an extra loss made deep inside the model reaches backward without being returned:
  :class:`AuxLoss` passes the layer's output through unchanged and, in backward, gives the
  aux term the gradient the main loss would have (:func:`set_aux_scale`), so it works even
  when the layer sits on an earlier pipeline stage than the loss (Megatron's
  ``MoEAuxLossAutoScaler``);
* capacity: with ``capacity_factor`` C > 0 each expert takes at most ``ceil(N·k/E · C)``
  assignments of a token group; the lowest gates are dropped first, ties broken in favour of
  the lower token index, so every rank that sees the same group makes the same decision;
* the token group: one forward call's tokens plus, under context parallelism, the same
  micro-batch's tokens on the other ranks of ``seq_group`` (the rest of the sequences).

The experts are the dense :class:`~edu3d.model.gpt.MLP` (passed in, so this module does not
import gpt.py, which imports it). Parameters are named ``router.weight``,
``experts.<e>.fc.weight`` ... and ``shared.<s>...``: a ModuleDict keyed by the expert's global
number, so expert parallelism (:mod:`edu3d.parallel.ep`) deletes the experts a rank does not
hold and the names of those it keeps do not change.

The model floor cannot import :mod:`edu3d.distributed`, so the two collectives over
``seq_group`` go through ``self.collectives``: plain ``torch.distributed`` by default, which
parallel code replaces with :mod:`edu3d.distributed.comm` (same signatures) to trace them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

RDTYPES = {"fp32": torch.float32, "fp64": torch.float64}
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
    """The two collectives MoE needs over ``seq_group``, straight on torch.distributed (SUM)."""

    @staticmethod
    def all_reduce(t, group=None):
        dist.all_reduce(t, group=group)

    @staticmethod
    def all_gather(out, t, group=None):
        dist.all_gather(list(out.chunk(dist.get_world_size(group))), t, group=group)


def route(probs: torch.Tensor, k: int, bias: torch.Tensor | None = None,
          norm_topk: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k selection on ``probs`` ``[n, E]`` (plus ``bias`` if given): ``(expert ids [n, k],
    gates [n, k])``. Gates are always the *probabilities* of the chosen experts (the bias only
    selects). With ``norm_topk`` and k > 1 they are renormalised to sum to 1, as Mixtral, Qwen3
    and DeepSeek-V3 do; with k = 1 renormalising would make every gate 1 and cut the router
    out of the main loss's gradient, so Switch keeps the raw probability and so do we."""
    scores = probs if bias is None else probs + bias.to(probs.dtype)
    idx = torch.topk(scores, k, dim=-1).indices
    gates = probs.gather(1, idx)
    if norm_topk and k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    return idx, gates


def capacity_keep(gate: torch.Tensor, expert: torch.Tensor, token: torch.Tensor,
                  n_experts: int, capacity: int) -> torch.Tensor:
    """Which assignments (1-D ``gate``, ``expert``, global ``token`` index, one per assignment)
    an expert taking at most ``capacity`` keeps: per expert, highest gate first, ties to the
    lower token index. Three stable sorts, least significant key first."""
    order = torch.argsort(token, stable=True)
    order = order[torch.argsort(-gate[order], stable=True)]
    order = order[torch.argsort(expert[order], stable=True)]
    per_expert = torch.bincount(expert, minlength=n_experts)
    starts = torch.cumsum(per_expert, 0) - per_expert
    place = torch.arange(len(order)) - starts[expert[order]]
    keep = torch.empty_like(expert, dtype=torch.bool)
    keep[order] = place < capacity
    return keep


class MoE(nn.Module):
    """Routed experts (plus optional shared ones) in place of a block's MLP: ``[B, T, d]`` in,
    ``[B, T, d]`` out. ``make_expert(config)`` builds one expert (the dense MLP).

    Attributes set by parallel code: ``seq_group`` (the context-parallel group, None),
    ``positions`` (this rank's positions in the sequence, LongTensor [T] or None = arange(T)),
    ``dispatcher`` (expert parallelism's exchange; None runs every expert here) and
    ``collectives`` (see the module docstring)."""

    def __init__(self, config, make_expert):
        super().__init__()
        self.n_experts, self.topk = config.n_experts, config.topk
        self.capacity_factor, self.balance = config.capacity_factor, config.balance
        self.aux_coef, self.z_coef = config.aux_loss_coef, config.z_loss_coef
        self.bias_rate, self.norm_topk = config.bias_rate, config.norm_topk
        self.rdtype, self.seq_len = RDTYPES[config.router_dtype], config.seq_len
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): make_expert(config)
                                      for e in range(config.n_experts)})
        if config.shared_experts:
            self.shared = nn.ModuleDict({str(s): make_expert(config)
                                         for s in range(config.shared_experts)})
        else:
            self.shared = None
        self.register_buffer("expert_bias", torch.zeros(config.n_experts))
        self.seq_group, self.positions, self.dispatcher = None, None, None
        self.collectives = TorchCollectives
        self.stats = self.empty_stats()

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        flat = x.reshape(-1, d)
        n, E, k = flat.shape[0], self.n_experts, self.topk
        logits = flat.to(self.rdtype) @ self.router.weight.to(self.rdtype).t()
        probs = logits.softmax(-1)
        bias = self.expert_bias if self.balance == "bias" else None
        idx, gates = route(probs, k, bias, self.norm_topk)

        # Balance loss over the token group: counts and probability sums all-reduced.
        cp = 1 if self.seq_group is None else dist.get_world_size(self.seq_group)
        N = n * cp
        counts = torch.bincount(idx.flatten(), minlength=E)
        summed = torch.cat([counts.double(), probs.detach().sum(0).double()])
        if self.seq_group is not None:
            self.collectives.all_reduce(summed, self.seq_group)
        f = summed[:E] / (N * k)
        # Each rank's term is cp times its share; averaging gradients over the cp ranks (what
        # data/context parallelism does) then gives exactly the serial gradient of E·Σ f_i P_i.
        aux_local = cp * E * (f.to(self.rdtype) * probs.sum(0) / N).sum()
        aux_value = E * float((f * summed[E:] / N).sum())
        z = torch.logsumexp(logits, -1).square().mean()

        # Assignments (token, expert, gate), capacity, then expert-major order.
        tok = torch.arange(n).repeat_interleave(k)
        exp, gate = idx.flatten(), gates.flatten()
        dropped = 0
        if self.capacity_factor > 0:
            keep = self.capacity_mask(gate.detach(), exp, T, N)
            tok, exp, gate = tok[keep], exp[keep], gate[keep]
            dropped = n * k - len(tok)
        order = torch.argsort(exp, stable=True)
        tok, exp, gate = tok[order], exp[order], gate[order]
        per_expert = torch.bincount(exp, minlength=E)
        y = self.run_experts(flat[tok], per_expert)
        out = torch.zeros_like(flat).index_add(0, tok, y * gate.to(x.dtype)[:, None])
        if self.shared is not None:
            for expert in self.shared.values():
                out = out + expert(flat)

        term = self.aux_coef * aux_local + self.z_coef * z
        if torch.is_grad_enabled() and (self.aux_coef or self.z_coef):
            out = AuxLoss.apply(out, term)
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            self.record(counts, dropped, aux_value, float(z.detach()))
        return out.view(B, T, d)

    def capacity_mask(self, gate, expert, T, N) -> torch.Tensor:
        """Which local assignments survive the capacity ``ceil(N·k/E · C)`` of the group. Under
        ``seq_group`` every rank gathers all (gate, expert, token index) of the group, makes the
        same decision and keeps its own slice."""
        capacity = math.ceil(N * self.topk / self.n_experts * self.capacity_factor)
        pos = self.positions if self.positions is not None else torch.arange(T)
        rows = max(self.seq_len, T)
        B = len(gate) // (T * self.topk)
        token = (torch.arange(B)[:, None] * rows + pos[None, :]).flatten()
        token = token.repeat_interleave(self.topk)
        if self.seq_group is None:
            return capacity_keep(gate, expert, token, self.n_experts, capacity)
        mine = torch.stack([gate.double(), expert.double(), token.double()], 1)
        cp = dist.get_world_size(self.seq_group)
        everyone = mine.new_empty((cp * len(mine), 3))
        self.collectives.all_gather(everyone, mine, self.seq_group)
        keep = capacity_keep(everyone[:, 0], everyone[:, 1].long(), everyone[:, 2].long(),
                             self.n_experts, capacity)
        r = dist.get_rank(self.seq_group)
        return keep[r * len(mine):(r + 1) * len(mine)]

    def run_experts(self, xs: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """Rows ``xs`` sorted by expert (``per_expert[e]`` rows for expert e) -> each row
        through its expert, same order. Expert parallelism's dispatcher runs them remotely."""
        if self.dispatcher is not None:
            return self.dispatcher(self, xs, per_expert)
        chunks = xs.split(per_expert.tolist())
        return torch.cat([self.experts[str(e)](c) for e, c in enumerate(chunks)])

    # ------------------------------------------------------------------ statistics, balance
    def empty_stats(self) -> dict:
        return {"counts": torch.zeros(self.n_experts, dtype=torch.int64), "dropped": 0,
                "aux": 0.0, "z": 0.0, "forwards": 0, "matrix": None}

    def record(self, counts, dropped, aux, z) -> None:
        s = self.stats
        s["counts"] += counts
        s["dropped"] += dropped
        s["aux"] += aux
        s["z"] += z
        s["forwards"] += 1

    def record_traffic(self, row: list[int], ep_rank: int) -> None:
        """Rows this rank sent to each rank of the expert-parallel group: row ``ep_rank`` of
        the ``[ep, ep]`` matrix (the others stay 0, so a SUM over the group fills them)."""
        if self.stats["matrix"] is None:
            self.stats["matrix"] = torch.zeros(len(row), len(row), dtype=torch.int64)
        self.stats["matrix"][ep_rank] += torch.tensor(row, dtype=torch.int64)

    def take_stats(self) -> dict:
        """Statistics since the last call, then reset: ``counts`` [E] (this rank's assignments
        per expert, before capacity), ``dropped``, ``aux`` and ``z`` (sums over ``forwards``
        calls: divide; ``aux`` is the group's value, ``z`` this rank's mean), ``matrix``."""
        stats, self.stats = self.stats, self.empty_stats()
        return stats

    @torch.no_grad()
    def update_bias(self, global_counts: torch.Tensor) -> None:
        """DeepSeek-V3's balancer: ``bias += rate · sign(mean(counts) - counts)``, with the
        step's counts summed over every rank that shares this router."""
        c = global_counts.to(self.expert_bias.dtype)
        self.expert_bias += self.bias_rate * torch.sign(c.mean() - c)


# ---------------------------------------------------------------------- parameter counts
def _mlp_params(d: int) -> int:
    return 8 * d * d + 5 * d  # fc 4d²+4d, proj 4d²+d


def _count(config, active: bool, exclude_embeddings: bool) -> int:
    d, L = config.d_model, config.n_layers
    n = L * (config.block_params - _mlp_params(d)) + 2 * d  # attention, LayerNorms, ln_f
    for layer in range(L):
        if config.is_moe_layer(layer):
            routed = config.topk if active else config.n_experts
            n += config.n_experts * d + (routed + config.shared_experts) * _mlp_params(d)
        else:
            n += _mlp_params(d)
    if not config.tie_weights:
        n += d * config.padded_vocab  # lm_head
    if not exclude_embeddings:
        n += (config.padded_vocab + config.seq_len) * d
    return n


def total_params(config, exclude_embeddings: bool = False) -> int:
    """Every parameter of ``GPT(config)`` (all E experts of each MoE layer): what memory holds."""
    return _count(config, active=False, exclude_embeddings=exclude_embeddings)


def active_params(config, exclude_embeddings: bool = False) -> int:
    """The parameters one token uses: the router, its top-k experts and the shared ones in an
    MoE layer, everything elsewhere. What FLOPs per token count (``6N``). Equals
    :func:`total_params` for a dense model."""
    return _count(config, active=True, exclude_embeddings=exclude_embeddings)
