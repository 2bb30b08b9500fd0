"""Memory per rank, predicted: every closed-form memory formula of the course, and the
shapes and traffic of the two axes that cut a model differently, experts and the sequence.

After reading this file you should understand the four categories every chart uses:

``params``     the weights (full, or this rank's shard under ZeRO-3);
``grads``      the gradients (full, or a shard under ZeRO-2 and 3);
``optimizer``  the optimizer's state: Adam keeps two moments per parameter (8 bytes in fp32),
               plus an fp32 master copy of the weights in mixed precision (K = 12);
``activations`` what the forward pass saves for backward.

The **state** formula is the ZeRO paper's (Rajbhandari et al. 2019) with Ψ parameters, N
data-parallel ranks and the bytes per element as parameters; with 2-byte weights and
gradients and K = 12 it is DESIGN.md's ``16Ψ``, ``4Ψ + KΨ/N``, ``2Ψ + (2+K)Ψ/N`` and
``(4+K)Ψ/N``. What a rank really holds is measured by :mod:`edu3d.distributed.meter`; any
difference between the two comes from padding: each flat buffer is rounded up to a multiple
of N.

Activations have three counts. :func:`activation_bytes_per_layer` is Korthikanti et al.'s
(2022) count for a 16-bit GPT layer with dropout, generalized to a SwiGLU MLP and grouped
KV heads (their defaults give the paper's ``sbh(34 + 5as/h)`` exactly); the planner uses it
for real models. :func:`layer_activation_bytes` is the same term list for *this course's*
layer in fp32 (no dropout, fused attention): it equals what autograd saves, byte for byte,
so the planner can be checked against edu3d's own runs. :func:`autocast_activation_bytes_per_layer`
is that layer under ``torch.autocast``. No torch here: ``edu3d plan`` runs without it.

**Mixture of experts** (:class:`MoESpec`): a MoE block keeps its attention and replaces
the MLP by a router ``Linear(h, E)`` and ``E`` expert MLPs of width ``f_e``, of which each
token uses ``k`` (plus the always-on shared experts). So a MoE model has *total* parameters
(memory) and *active* ones (``6N`` FLOPs per token, N active). The expert parallelism (EP)
all-to-all and the context parallelism (CP) exchanges are :func:`ep_bytes` and
:func:`cp_bytes`; :func:`moe_mlp_activation_bytes` is what a MoE block's MLP half saves.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from edu3d.config.layout import divisors  # noqa: F401 - the planner takes the mesh's
from edu3d.model.shapes import ModelSpec

RECOMPUTE_MODES = ("none", "selective", "full")


def zero_bytes(psi: int, n: int, stage: int, param_bytes: int = 4, grad_bytes: int = 4,
               optimizer_bytes: int = 8) -> dict[str, float]:
    """Predicted bytes per rank for ZeRO ``stage`` (0 = plain data parallelism).

    fp32 Adam: ``param_bytes=4, grad_bytes=4, optimizer_bytes=8``; mixed-precision Adam:
    ``2, 2, 12`` (the paper's K = 12: fp32 master weights, momentum and variance).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} must be 0, 1, 2 or 3")
    if n < 1:
        raise ValueError(f"data-parallel degree {n} must be at least 1")
    out = {"params": param_bytes * psi / (n if stage >= 3 else 1),
           "grads": grad_bytes * psi / (n if stage >= 2 else 1),
           "optimizer": optimizer_bytes * psi / (n if stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                               recompute: str | None = None, d_ff: int | None = None,
                               kv_heads: int | None = None, mlp: str = "gelu") -> float:
    """Activation bytes of one transformer layer in 16-bit (Korthikanti et al. 2022).

    ``sbh(34 + 5as/h)``; with TP ``sbh(10 + 24/t + 5as/(ht))``; with TP+SP
    ``sbh/t (34 + 5as/h)``; ``recompute="selective"`` drops the ``5as/h`` term,
    ``"full"`` keeps only the layer input ``2sbh`` (``/t`` with SP).

    The paper's 34 is: LayerNorm inputs 4, attention 11 (QKV input 2, Q and K 4, V 2, the
    projection's input 2, its dropout mask 1) and MLP 19 (input 2, GELU input 8, GELU output
    8, dropout mask 1). Of these, 10 stay whole on every TP rank (LayerNorm, QKV and MLP
    inputs, the two dropout masks) and 24 are split. A SwiGLU MLP with ``d_ff = f`` keeps
    ``8sbf`` split (gate and up outputs, SiLU output, their product) instead of GELU's
    ``4sbf`` (``16sbh`` at ``f = 4h``); grouped KV heads shrink K and V by ``kv_heads/a``.
    """
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    f = 4 * h if d_ff is None else d_ff
    kv = a if kv_heads is None else kv_heads
    whole = 10 * s * b * h
    attn_split = s * b * h * (2 + 2 + 4 * kv / a)  # Q, the projection's input, K and V
    mlp_split = s * b * f * (8 if mlp == "swiglu" else 4)
    core = 0 if recompute == "selective" else 5 * a * s * s * b  # scores, softmax, mask
    split = attn_split + mlp_split + core
    return (whole + split) / t if sp else whole + split / t


def flat_shard(unit: list[tuple[int, bool]], n: int, index: int) -> tuple[int, int, int]:
    """ZeRO's flat buffer of ``unit``: (padded elements, shard elements, pieces in shard
    ``index``: the parameters that overlap it, each its own optimizer tensors)."""
    numel = sum(k for k, _ in unit)
    padded = math.ceil(numel / n) * n
    lo, hi = index * padded // n, (index + 1) * padded // n
    pieces, off = 0, 0
    for k, _ in unit:
        pieces += max(off, lo) < min(off + k, hi)
        off += k
    return padded, padded // n, pieces


def shard_starts(us: list, n: int) -> set[int]:
    """The ZeRO ranks (of ``n``) whose shard of some unit in ``us`` has a tensor starting
    strictly inside it. Every other rank holds at most one piece of each unit and no more of
    its state than rank 0, so the fullest rank is rank 0 or one of these: a planner over a
    million ranks weighs a few hundred instead of all."""
    out = set()
    for _, u in us:
        size, off = math.ceil(sum(k for k, _ in u) / n), 0
        for k, _ in u[:-1]:
            off += k
            if size and off % size:
                out.add(off // size)
    return out


def zero_unit_bytes(us: list, n: int, dp_index: int, zero: int, held_full: bool, at: str,
                    pb: int, gb: int, ob: int) -> dict[str, float]:
    """Weights, gradients and optimizer state of the units ``us`` (``[(name, [(elements, is
    a matrix)])]``) on rank ``dp_index`` of ``n`` under ZeRO stage ``zero``, byte for byte:
    each unit a flat buffer (:func:`flat_shard`), ``pb gb ob`` bytes per element. ``at="peak"``
    with ``held_full`` (ZeRO-2/3 reducing once per step over micro-batches) adds the full
    gradients (``.grad`` tensors, unpadded) and ZeRO-3's gathered flat weights, held for the
    step; a unit in flight is a buffer (:func:`edu3d.plan.zero_modes.in_flight_bytes`)."""
    step_bytes = 4 if ob else 0  # AdamW's step counter: one fp32 scalar per tensor it updates
    numel: dict[int, int] = {}  # a MoE stage repeats one expert list per block: count it once
    for _, u in us:
        if id(u) not in numel:
            numel[id(u)] = sum(k for k, _ in u)
    full = sum(numel[id(u)] for _, u in us)
    tensors = sum(len(u) for _, u in us)
    if not zero or n == 1:
        return {"params": pb * full, "grads": gb * full,
                "optimizer": ob * full + step_bytes * tensors * bool(ob)}
    seen: dict[int, tuple] = {}
    for _, u in us:
        if id(u) not in seen:
            sh = flat_shard(u, n, dp_index)
            seen[id(u)] = (*sh, min(sh[1], max(0, numel[id(u)] - dp_index * sh[1])))
    shards = [seen[id(u)] for _, u in us]
    padded = sum(p for p, _, _, _ in shards)
    shard = sum(s for _, s, _, _ in shards)
    covered = sum(c for _, _, _, c in shards)
    optimizer = ob * covered + step_bytes * sum(p for _, _, p, _ in shards)
    params = pb * (padded if zero < 3 else shard)
    grads = gb * (padded if zero < 2 else shard)
    if at == "peak" and held_full and zero >= 2:
        grads += gb * full
        params += pb * padded * (zero == 3)
    return {"params": params, "grads": grads, "optimizer": optimizer}


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                           mode: str = "none", value_bytes: int = 4) -> int:
    """Exactly what one layer of edu3d's GPT saves for backward, in bytes (fp32 by default).

    Korthikanti's term list for this model (no dropout, fused attention), in values:

    ============================  ==========  ===========================================
    saved for backward            values      under TP / SP
    ============================  ==========  ===========================================
    LayerNorm inputs (2)          ``2sbh``    whole on every TP rank; ``/t`` with SP
    LayerNorm mean, 1/std (2x2)   ``4sb``     whole; ``/t`` with SP
    QKV input, MLP input          ``2sbh``    whole; ``/t`` with SP (the column layer
                                              keeps only its tokens and re-gathers them)
    Q, K, V                       ``3sbh``    ``/t`` (heads)
    attention output              ``sbh``     ``/t``; the same storage as the output
                                              projection's input
    log-sum-exp per head, token   ``asb``     ``/t``; the fused kernel's only trace of
                                              the ``s x s`` softmax
    GELU input, GELU output       ``8sbh``    ``/t`` (the GELU output is the MLP
                                              projection's input)
    ============================  ==========  ===========================================

    ``mode`` is the recomputation (:mod:`edu3d.parallel.recompute`). ``none``: all of it,
    ``16sbh + 4sb + asb``. ``selective`` recomputes the attention core from Q, K, V, which
    stay saved (they are its inputs), and its output stays too (the output projection saves
    it): only the ``asb`` log-sum-exps go. ``full`` keeps the block's input, ``sbh`` (``/t``
    with SP). Korthikanti's 16-bit counts (:func:`activation_bytes_per_layer`) have
    ``34sbh``, ``2sbh`` of it dropout masks, and ``5as^2b`` for the unfused scores, softmax
    and its dropout that selective recomputation removes: here a fused kernel never stored
    them. tests/test_recompute.py measures every case on the real modules.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if mode == "full":
        return int(s * b * h * value_bytes / (t if sp else 1))
    whole = 4 * s * b * h + 4 * s * b
    split = 12 * s * b * h + (0 if mode == "selective" else a * s * b)
    values = (whole + split) / t if sp else whole + split / t
    return int(round(values * value_bytes))


def fp8_scale_bytes(s: int, b: int, h: int, t: int = 1, scaling: str = "tensorwise") -> int:
    """What one block's four FP8 layers keep for backward beyond an fp32 block (their fp32
    inputs are the same tensors): the scales of ``x`` and ``w``, one fp32 number each
    (tensorwise), or one per token of ``x`` and per output row of ``w`` (rowwise: ``qkv``
    ``3h/t``, ``fc`` ``4h/t``, the projections ``h`` each). :mod:`edu3d.parallel.fp8`."""
    if scaling == "tensorwise":
        return 4 * 2 * 4
    return 4 * (4 * s * b + 7 * h // t + 2 * h)


def autocast_activation_bytes_per_layer(s: int, b: int, h: int, a: int,
                                        recompute: str | None = None) -> int:
    """What one layer of this course's GPT saves under ``torch.autocast`` (bf16 or fp16,
    fp32 weights: edu3d's ``--precision``), without TP, in bytes.

    The residual stream stays fp32, so the two LayerNorm inputs (``2sbh``) and their
    statistics (``4sb``) are 4-byte; each linear layer saves the 16-bit copy of its input
    it multiplied (QKV and MLP inputs, ``2sbh``) and of its weight (``12h^2`` per layer:
    autocast casts each weight once per forward and backward needs it); Q, K, V, the
    attention output and GELU's input and output are 16-bit (``12sbh``); the log-sum-exps
    fp32 (``asb``). ``"full"`` keeps the fp32 block input (``4sbh``), ``"selective"`` drops
    the log-sum-exps. Checked on CUDA against the engine's meter (tests/test_planner.py).
    """
    if recompute == "full":
        return 4 * s * b * h
    fp32 = 2 * s * b * h + 4 * s * b + (0 if recompute == "selective" else a * s * b)
    half = 2 * s * b * h + 12 * s * b * h + 12 * h * h
    return 4 * fp32 + 2 * half


# ---- mixture of experts: the shapes ------------------------------------------------------------
@dataclass(frozen=True)
class MoESpec(ModelSpec):
    """A :class:`~edu3d.model.shapes.ModelSpec` whose MLPs are (partly) mixtures of experts.

    Block ``i`` is MoE iff ``experts > 0``, ``i >= dense_first`` and ``i % moe_every == 0``
    (``edu3d train``'s rule, plus DeepSeek-V3's first dense blocks). ``mla`` counts the
    parameters of multi-head latent attention, ``(q_rank, kv_rank, qk_nope, qk_rope, v_dim)``
    per head; activations and FLOPs still use standard attention of ``n_heads`` x
    ``d_model``. ``experts=0`` is the dense model, counted exactly as its ModelSpec. The
    shapes are cached (the spec is frozen): read the lists they return, never change them."""

    experts: int = 0
    topk: int = 2
    moe_every: int = 1
    dense_first: int = 0
    shared_experts: int = 0
    expert_ff: int | None = None  # default: the dense MLP's width
    capacity_factor: float = 0.0  # 0: no capacity, every routed token is computed
    mla: tuple[int, int, int, int, int] | None = None

    @property
    def e_ff(self) -> int:
        return self.expert_ff or self.ff

    def is_moe(self, i: int) -> bool:
        return self.experts > 0 and i >= self.dense_first and i % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    @lru_cache(maxsize=4096)  # a search asks the same shapes thousands of times
    def mlp_tensors(self, f: int, t: int = 1) -> list[tuple[str, int, bool]]:
        """One MLP of width ``f``, split ``t`` ways (the tail of ``layer_tensors``)."""
        whole = ModelSpec.layer_tensors(dataclasses.replace(self, d_ff=f), t)
        return whole[max(i for i, (n, _, _) in enumerate(whole) if n.startswith("ln2.")) + 1:]

    @lru_cache(maxsize=4096)
    def layer_tensors(self, t: int = 1) -> list[tuple[str, int, bool]]:
        """A dense block (attention counted as MLA when ``mla`` is set)."""
        out = ModelSpec.layer_tensors(self, t)
        if self.mla is None:
            return out
        qr, kvr, nope, rope, v = self.mla
        h, a = self.d_model, self.n_heads
        q = ([("q_a.w", h * qr, True), ("q_norm.w", qr, False), ("q_b.w", qr * a * (nope + rope)
             // t, True)] if qr else [("q.w", h * a * (nope + rope) // t, True)])
        att = q + [("kv_a.w", h * (kvr + rope), True), ("kv_norm.w", kvr, False),
                   ("kv_b.w", kvr * a * (nope + v) // t, True), ("proj.w", a * v * h // t, True)]
        ln1, ln2 = ([x for x in out if x[0].startswith(n)] for n in ("ln1.", "ln2."))
        return ln1 + att + ln2 + self.mlp_tensors(self.ff, t)

    @lru_cache(maxsize=4096)
    def block_tensors(self, i: int, t: int = 1) -> list[tuple[str, int, bool]]:
        """Block ``i`` on one tp rank, its routed experts left out: a MoE block keeps its
        attention (split ``t`` ways), the router and the shared experts (whole on every tp
        rank: the MoE half runs whole there on the same tokens)."""
        dense = self.layer_tensors(t)
        if not self.is_moe(i):
            return dense
        out = dense[:len(dense) - len(self.mlp_tensors(self.ff, t))]  # a copy
        out.append(("router.w", self.experts * self.d_model, True))
        for j in range(self.shared_experts):
            out += [(f"shared{j}.{n}", k, m) for n, k, m in self.mlp_tensors(self.e_ff)]
        return out

    @lru_cache(maxsize=4096)
    def expert_tensors(self, ep: int = 1) -> list[tuple[str, int, bool]]:
        """The routed experts one rank holds in a MoE block: ``E/ep`` whole MLPs."""
        one = self.mlp_tensors(self.e_ff)
        return [(f"expert{e}.{n}", k, m) for e in range(self.experts // ep) for n, k, m in one]

    @lru_cache(maxsize=4096)
    def expert_params(self) -> int:
        """Parameters of every routed expert of the model."""
        return self.moe_layers * sum(k for _, k, _ in self.expert_tensors())

    @lru_cache(maxsize=4096)
    def num_params(self) -> int:
        """Total parameters: what memory holds."""
        head = self.d_model * (2 if self.norm == "layernorm" else 1)
        emb = self.vocab_size * self.d_model * (1 if self.tied else 2) + (
            self.seq_len * self.d_model if self.learned_pos else 0)
        return self.layer_params() + self.expert_params() + head + emb

    @lru_cache(maxsize=4096)
    def layer_params(self, active: bool = False) -> int:
        """Parameters of the blocks without the routed experts (``active``: plus the ``k``
        each token uses): the ``N`` of ``6N`` FLOPs per token when ``active``."""
        routed = active * self.moe_layers * self.topk * sum(
            k for _, k, _ in self.mlp_tensors(self.e_ff))
        return sum(k for i in range(self.n_layers) for _, k, _ in self.block_tensors(i)) + routed

    def active_params(self) -> int:
        """Parameters one token uses: all but the ``E - k`` routed experts it skips."""
        return self.num_params() - self.expert_params() + (self.layer_params(True)
                                                           - self.layer_params())


def as_moe(spec: ModelSpec) -> MoESpec:
    """Any spec as a :class:`MoESpec` (a dense one has ``experts=0``)."""
    return spec if isinstance(spec, MoESpec) else MoESpec(**dataclasses.asdict(spec))


# ---- mixture of experts and context parallelism: bytes -----------------------------------------
def routed_per_token(spec: MoESpec) -> float:
    """Expert slots per token: ``k``, or with a capacity factor ``C`` the padded ``k·C``."""
    return spec.topk * spec.capacity_factor if spec.capacity_factor else spec.topk


def ep_bytes(tokens: int, k: float, h: int, ep: int, value_bytes: int = 2) -> float:
    """Bytes one rank sends in the EP all-to-alls of one MoE block, forward and backward:
    dispatch and combine each move ``(EP-1)/EP`` of ``T·k·h`` values, and backward moves
    their gradients the same way (4 all-to-alls)."""
    return 4 * (ep - 1) / ep * tokens * k * h * value_bytes


def cp_bytes(impl: str, s: int, b: int, h: int, cp: int, kv_h: int | None = None, t: int = 1,
             value_bytes: int = 2) -> float:
    """Bytes one rank sends for context parallelism in one block, forward and backward;
    ``kv_h`` is K's (and V's) width (``h`` without grouped KV heads), heads split ``t`` ways.

    ``ring``: forward passes its K and V chunk (``2·(s/CP)·b·kv_h`` values) CP-1 times;
    backward passes K and V round again (CP-1 times) and their gradients dK, dV with them,
    CP times, the last hop bringing them home: ``3CP-2`` chunks (chapter 13's count, what the
    trace measures). ``allgather``: all-gather K and V once forward (CP-1 chunks out),
    reduce-scatter dK, dV backward: 2x. ``ulysses``: 4 all-to-alls (Q, K, V in, the output
    back), each ``(CP-1)/CP`` of the rank's ``(s/CP)·b·width``; backward as many: 2x."""
    kv = h if kv_h is None else kv_h
    chunk = 2 * (s / cp) * b * kv / t
    if impl == "ring":
        values = (3 * cp - 2) * chunk if cp > 1 else 0.0
    elif impl == "allgather":
        values = 2 * (cp - 1) * chunk
    elif impl == "ulysses":
        values = 2 * (cp - 1) / cp * (s / cp) * b * (2 * h + 2 * kv) / t
    else:
        raise ValueError(f"cp_impl={impl!r}: choose ring, allgather or ulysses")
    return values * value_bytes


def mlp_activation_bytes(s: int, b: int, h: int, f: int, t: int = 1, mlp: str = "gelu",
                         value_bytes: int = 2, dropout: bool = True) -> float:
    """What a dense MLP half saves: its input (whole on every tp rank), the hidden
    activations (``2sbf`` values for GELU, ``4sbf`` for SwiGLU; split ``t`` ways) and the
    dropout mask (1 byte per value, whole); Korthikanti's ``2 + 16 + 1`` sbh at ``f=4h``."""
    hidden = s * b * f * (4 if mlp == "swiglu" else 2) / t
    return value_bytes * (s * b * h + hidden) + dropout * s * b * h


def moe_mlp_activation_bytes(spec: MoESpec, s: int, b: int, value_bytes: int = 2,
                             dropout: bool = True) -> float:
    """What a MoE block's MLP half saves, whole on every tp rank (balanced routing): its
    input ``sbh``, the router's fp32 logits and probabilities ``2·sbE`` (4 bytes each), the
    ``k`` dispatched copies of each token ``k·sbh``, each routed expert's hidden activations
    for its ``k·sb`` tokens, the experts' outputs ``k·sbh`` (the gate weights' gradient needs
    them), the shared experts' hidden activations and the dropout mask. With ``k = 1`` and
    one expert of width ``f`` this is a dense MLP plus ``2·sbh`` and the router."""
    h, k = spec.d_model, routed_per_token(spec)
    hidden = s * b * spec.e_ff * (4 if spec.mlp == "swiglu" else 2) * (k + spec.shared_experts)
    return (value_bytes * (s * b * h * (1 + 2 * k) + hidden) + 8 * s * b * spec.experts
            + dropout * s * b * h)
