"""Mixture of experts: a router sends every token to k of E expert MLPs.

After reading this file you should understand the layer's forward as five named steps, as
Megatron-core's MoE layer reads them:

1. **route** (:meth:`MoE.route`): ``probs = softmax(x W_r^T)`` and each token picks the k
   experts of highest probability; their outputs will be summed weighted by their *gates*
   (the chosen probabilities, renormalised to sum to 1 when ``norm_topk`` and k > 1). The
   router runs in ``router_dtype`` (fp32 or fp64) with autocast switched off, so under
   ``--precision bf16/fp16`` its logits, softmax and z-loss stay in full precision (a
   16-bit softmax over near-equal scores flips choices). The balancers come with it: the
   load-balancing loss of :mod:`edu3d.model.balance` (1 at perfect balance, ``E/k`` at
   collapse), over the tokens ``--aux-scope`` says, and DeepSeek-V3's bias, added to the
   scores only to *select* experts and nudged after each step towards the under-used ones
   (with the bias on, the loss counts the router's own top-k, without the bias, as Megatron
   and DeepSeek-V3 do);
2. **apply capacity** (:meth:`MoE.apply_capacity`): with ``capacity_factor`` C > 0 each
   expert takes at most ``ceil(N·k/E · C)`` assignments of a token group; the lowest gates
   are dropped first, ties broken in favour of the lower token index, so every rank that
   sees the same group makes the same decision. Keeping the highest gates (Megatron's
   "probs" drop policy) is not causal: a later token of the sequence can evict an earlier
   one, which a model generating token by token could never do; dropping by position
   ("position" policy) is causal but drops the late tokens whatever their gates;
3. **dispatch**: the kept assignments' rows, sorted by expert, go to whoever runs their
   expert (:class:`LocalExperts` here; expert parallelism's all-to-all in
   :mod:`edu3d.parallel.ep.dispatch`);
4. **experts**: each expert runs its rows (:meth:`MoE.run_experts`);
5. **combine**: the outputs come back in the order they were sent, and each token's output
   is the gate-weighted sum of its experts' rows (plus the shared experts').

The token group: one forward call's tokens plus, under context parallelism, the same
micro-batch's tokens on the other ranks of the sequence group. The process groups are handed
in by parallel code as one :class:`TokenGroups` (:meth:`MoE.use_groups`); a serial layer has
the default, no groups at all. The experts are the dense :class:`~edu3d.model.gpt.MLP`
(passed in, so this module does not import gpt.py, which imports it). Parameters are named
``router.weight``, ``experts.<e>.fc.weight`` ... and ``shared.<s>...``: a ModuleDict keyed by
the expert's global number, so expert parallelism deletes the experts a rank does not hold
and the names of those it keeps do not change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from edu3d.model.balance import AuxLoss, TorchCollectives, balance_loss, z_loss

RDTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass
class TokenGroups:
    """Which ranks an MoE layer's token statistics span, given by parallel code.

    ``seq``: the context-parallel group (``seq_size`` ranks; this one is ``seq_rank``), over
    which a micro-batch's sequences are cut; ``positions``: this rank's positions in the
    sequence (None: ``arange(T)``); ``data``: every data- and context-parallel rank of the
    step (``data_size``), over which ``--aux-scope global`` reduces; ``collectives``: whose
    ``all_reduce`` and ``all_gather`` to call (traced ones under parallel code)."""

    seq: object = None
    seq_size: int = 1
    seq_rank: int = 0
    positions: torch.Tensor | None = None
    data: object = None
    data_size: int = 1
    collectives: object = TorchCollectives


@dataclass
class Routing:
    """Step 1's result for ``n`` tokens: ``probs`` ``[n, E]``, the chosen ``experts`` and
    their ``gates`` ``[n, k]``, and the balancing terms (``aux`` with its gradient, its
    ``aux_value``, the z-loss ``z``)."""

    probs: torch.Tensor
    experts: torch.Tensor
    gates: torch.Tensor
    aux: torch.Tensor
    aux_value: float
    z: torch.Tensor


@dataclass
class Assignments:
    """Step 2's result: the kept (token, expert, gate) triples sorted by expert, with
    ``per_expert[e]`` of them for expert e, and how many were ``dropped``."""

    token: torch.Tensor
    expert: torch.Tensor
    gate: torch.Tensor
    per_expert: torch.Tensor
    dropped: int


class LocalExperts:
    """The dispatcher of a layer that holds every expert: rows stay where they are. Expert
    parallelism's :class:`~edu3d.parallel.ep.dispatch.ExpertDispatcher` has the same three
    members and moves the rows by all-to-all."""

    first = 0  # the global number of the first expert held here

    @staticmethod
    def dispatch(rows: torch.Tensor, per_expert: torch.Tensor):
        """-> (the rows this rank's experts run, rows per local expert, the route back)."""
        return rows, per_expert.tolist(), None

    @staticmethod
    def combine(y: torch.Tensor, route) -> torch.Tensor:
        return y

    @staticmethod
    def take_traffic():
        """Rows sent rank to rank since the last call: nothing travels here."""
        return None


def route(probs: torch.Tensor, k: int, bias: torch.Tensor | None = None,
          norm_topk: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k selection on ``probs`` ``[n, E]`` (plus ``bias`` if given): ``(expert ids [n, k],
    gates [n, k])``. Gates are always the *probabilities* of the chosen experts (the bias only
    selects). With ``norm_topk`` and k > 1 they are renormalised to sum to 1, as Mixtral, Qwen3
    and DeepSeek-V3 do. With k = 1 renormalising would make every gate exactly 1 and cut the
    router out of the main loss's gradient (Megatron's default, softmax after top-k, does
    just that at k = 1), so Switch keeps the raw probability and so do we."""
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

    Set by parallel code: the process groups (:meth:`use_groups`) and ``dispatcher``
    (expert parallelism's exchange; :class:`LocalExperts` runs every expert here)."""

    def __init__(self, config, make_expert):
        super().__init__()
        self.n_experts, self.topk = config.n_experts, config.topk
        self.capacity_factor, self.balance = config.capacity_factor, config.balance
        self.aux_coef, self.z_coef = config.aux_loss_coef, config.z_loss_coef
        self.aux_scope = config.aux_scope
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
        self.groups, self.dispatcher = TokenGroups(), LocalExperts()
        self.stats = self.empty_stats()

    def use_groups(self, groups: TokenGroups) -> None:
        """The ranks this layer's token statistics span (parallel code calls it once)."""
        self.groups = groups

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        tokens = x.reshape(-1, d)
        r = self.route(tokens, B)                                        # 1. route
        a = self.apply_capacity(r, T)                                    # 2. capacity
        rows, per_local, back = self.dispatcher.dispatch(tokens[a.token], a.per_expert)  # 3.
        y = self.dispatcher.combine(self.run_experts(rows, per_local), back)  # 4. experts
        out = torch.zeros_like(tokens).index_add(0, a.token,                # 5. combine
                                                 y * a.gate.to(x.dtype)[:, None])
        if self.shared is not None:
            for expert in self.shared.values():
                out = out + expert(tokens)
        if torch.is_grad_enabled() and (self.aux_coef or self.z_coef):
            out = AuxLoss.apply(out, self.aux_coef * r.aux + self.z_coef * r.z)
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            self.record(torch.bincount(r.experts.flatten(), minlength=self.n_experts),
                        a.dropped, r.aux_value, float(r.z.detach()))
        return out.view(B, T, d)

    def route(self, tokens: torch.Tensor, sequences: int) -> Routing:
        """Step 1 for ``tokens`` ``[n, d]`` (``sequences`` rows of ``n / sequences``): the
        router's choice, gates and balancing terms, in ``router_dtype`` with autocast off."""
        g, k = self.groups, self.topk
        bias = self.expert_bias if self.balance == "bias" else None
        with torch.autocast(tokens.device.type, enabled=False):
            logits = tokens.to(self.rdtype) @ self.router.weight.to(self.rdtype).t()
            probs = logits.softmax(-1)
            idx, gates = route(probs, k, bias, self.norm_topk)
            counted = idx if bias is None else torch.topk(probs, k, dim=-1).indices
            if self.aux_scope == "global":
                aux, value = balance_loss(probs, counted, self.n_experts, 1, g.data,
                                          g.data_size, g.collectives)
            else:
                groups = sequences if self.aux_scope == "sequence" else 1
                aux, value = balance_loss(probs, counted, self.n_experts, groups, g.seq,
                                          g.seq_size, g.collectives)
            return Routing(probs, idx, gates, aux, value, z_loss(logits))

    def apply_capacity(self, r: Routing, T: int) -> Assignments:
        """Step 2: the assignments (token, expert, gate) that survive the capacity
        ``ceil(N·k/E · C)`` of the token group (all of them when dropless), expert-major.
        Under a sequence group every rank gathers all (gate, expert, token index) of the
        group, makes the same decision and keeps its own slice."""
        n, k, E = r.experts.shape[0], self.topk, self.n_experts
        tok = torch.arange(n).repeat_interleave(k)
        exp, gate = r.experts.flatten(), r.gates.flatten()
        dropped = 0
        if self.capacity_factor > 0:
            keep = self.capacity_mask(gate.detach(), exp, T, n * self.groups.seq_size)
            tok, exp, gate = tok[keep], exp[keep], gate[keep]
            dropped = n * k - len(tok)
        order = torch.argsort(exp, stable=True)
        return Assignments(tok[order], exp[order], gate[order],
                           torch.bincount(exp, minlength=E), dropped)

    def capacity_mask(self, gate, expert, T, N) -> torch.Tensor:
        capacity = math.ceil(N * self.topk / self.n_experts * self.capacity_factor)
        g = self.groups
        pos = g.positions if g.positions is not None else torch.arange(T)
        rows = max(self.seq_len, T)
        B = len(gate) // (T * self.topk)
        token = (torch.arange(B)[:, None] * rows + pos[None, :]).flatten()
        token = token.repeat_interleave(self.topk)
        if g.seq_size == 1:
            return capacity_keep(gate, expert, token, self.n_experts, capacity)
        mine = torch.stack([gate.double(), expert.double(), token.double()], 1)
        everyone = mine.new_empty((g.seq_size * len(mine), 3))
        g.collectives.all_gather(everyone, mine, g.seq)
        keep = capacity_keep(everyone[:, 0], everyone[:, 1].long(), everyone[:, 2].long(),
                             self.n_experts, capacity)
        return keep[g.seq_rank * len(mine):(g.seq_rank + 1) * len(mine)]

    def run_experts(self, rows: torch.Tensor, per_local: list[int]) -> torch.Tensor:
        """Step 4: rows sorted by expert, ``per_local[e]`` for the e-th expert held here
        (global number ``dispatcher.first + e``), each through its expert, same order."""
        first = self.dispatcher.first
        return torch.cat([self.experts[str(first + e)](c)
                          for e, c in enumerate(rows.split(per_local))])

    # ------------------------------------------------------------------ statistics, balance
    def empty_stats(self) -> dict:
        return {"counts": torch.zeros(self.n_experts, dtype=torch.int64), "dropped": 0,
                "aux": 0.0, "z": 0.0, "forwards": 0}

    def record(self, counts, dropped, aux, z) -> None:
        s = self.stats
        s["counts"] += counts.cpu()
        s["dropped"] += dropped
        s["aux"] += aux
        s["z"] += z
        s["forwards"] += 1

    def take_stats(self) -> dict:
        """Statistics since the last call, then reset: ``counts`` [E] (this rank's assignments
        per expert, as routed, before capacity), ``dropped``, ``aux`` and ``z`` (sums over
        ``forwards`` calls: divide; ``aux`` is the group's value, ``z`` this rank's mean) and,
        under expert parallelism, ``matrix``: the rows this rank sent to each rank of its
        group (its row of the ``[ep, ep]`` matrix, the others 0)."""
        stats, self.stats = self.stats, self.empty_stats()
        stats["matrix"] = self.dispatcher.take_traffic()
        return stats

    @torch.no_grad()
    def update_bias(self, global_counts: torch.Tensor) -> None:
        """DeepSeek-V3's balancer: ``bias += rate · sign(mean(counts) - counts)``, with the
        step's counts summed over every rank that shares this router. (DeepSeek-V3 steps by
        1e-3 for most of its training, then 0 for the last tokens: the bias freezes.)"""
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
