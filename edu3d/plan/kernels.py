"""One layer's work from its shapes: the kernels and collectives a rank runs per micro-batch.

After reading this file you should be able to list what a GPU (or a CPU core) does for one
transformer layer, and see the size of each piece follow from the model and the layout:

* **matmuls** ``(M, N, K)``: ``M`` is the tokens one rank holds (micro-batch x sequence,
  ``/cp``), ``N`` and ``K`` the weight's shape cut ``tp`` ways (QKV and the MLP's first
  matrices by columns, the output projection and the MLP's last by rows). Each costs
  ``2MNK`` FLOPs forward, and twice that backward, kept as two kernels: the input gradient
  ``dX = dY·Wᵀ`` (``I``: the next stage waits for it) and the weight gradient ``dW = Xᵀ·dY``
  (``W``: only the optimizer does). Zero-bubble schedules move ``W`` around;
* **the attention core**: FlashAttention computes ``QKᵀ`` and ``PV`` without storing the
  ``s x s`` scores: ``4·s²·h`` FLOPs per sequence forward, halved by the causal mask (the
  kernels skip the masked blocks), and 2.5 times that backward (it recomputes ``QKᵀ``, then
  five matmuls instead of two). Without it (Megatron 2021-22) the scores are batched matmuls
  over the full square and a softmax that reads and writes ``s²`` values per head;
* **memory-bound operations** (norms, residual adds, rotary embedding, the MLP's activation,
  cross entropy, the optimizer): few FLOPs, so their time is bytes over memory bandwidth.
  Eager PyTorch runs each as separate kernels that re-read their tensors (an RMSNorm written
  in Python is four kernels and six passes); fused code (``torch.compile``, Megatron, TE)
  reads each input once. A backward reads about twice what its forward did;
* **recomputation** runs part of the forward again just before the backward (phase ``R``):
  ``selective`` the attention core, ``op`` (torchtitan's op-level policy) every memory-bound
  op and every second matmul, ``full`` the whole forward, collectives included;
* **collectives inside a layer** (:class:`Comm`): tensor parallelism's all-reduces (or, with
  sequence parallelism, all-gathers and reduce-scatters of the same tokens), context
  parallelism's K/V exchange, expert parallelism's dispatch and combine. Each names the
  matmul it can hide behind when the layout overlaps it.

Nothing here is timed: :mod:`edu3d.plan.roofline` turns an :class:`Op` into seconds and
:mod:`edu3d.plan.links` a :class:`Comm`. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

PHASES = ("F", "R", "I", "W")  # forward, recomputed forward, input grad, weight grad


@dataclass(frozen=True)
class Op:
    """One kernel (or a few fused ones, ``kernels``): FLOPs and bytes moved to memory."""

    name: str
    kind: str  # "matmul", "attention" or "memory"
    phase: str
    flops: float
    bytes: float
    kernels: int = 1
    mnk: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Comm:
    """One collective of a layer: ``kind`` on ``axis``, ``nbytes`` the whole buffer (what
    an all-reduce or reduce-scatter takes in, what an all-gather gives out), issued in
    ``phase``; ``hides`` is the op it may overlap (``None``: always exposed), ``steps``
    how many such messages (a ring's)."""

    axis: str
    kind: str
    nbytes: float
    phase: str
    hides: str | None = None
    steps: int = 1


@dataclass(frozen=True)
class Cut:
    """The shapes one rank sees: ``tokens`` per micro-batch (``b·s/cp``), ``norm_tokens``
    (``/tp`` more under sequence parallelism), heads and widths after the tp cut, bytes per
    activation value (``act``), and the recipe's choices (``flash``, ``fused``, ``fp8``)."""

    tokens: int
    norm_tokens: int
    seq: int
    b: int
    h: int
    head_dim: int
    heads: int  # query heads on this rank
    kv_heads: int  # key/value heads on this rank (replicated when tp > kv heads)
    ff: int  # this rank's MLP width
    vocab: int  # this rank's vocabulary rows
    tp: int
    cp: int
    sp: bool
    act: int
    mlp: str
    norm: str
    rope: bool
    flash: bool = True
    fused: bool = False  # elementwise chains fused (Megatron/TE kernels, torch.compile)
    fused_norm: bool = False  # a fused norm kernel even in eager code (nanotron's Triton one)
    fp8: bool = False
    cp_impl: str = "ring"


def matmul(name: str, m: int, n: int, k: int, act: int, fp8: bool = False,
           weights: bool = True) -> list[Op]:
    """``Y[m,n] = X[m,k]·W[k,n]`` forward, and its two backward kernels. fp8 linears (torchao's
    Float8Linear) first scale and cast both operands: a memory pass each."""
    flops, moved = 2.0 * m * n * k, act * (m * k + k * n + m * n)
    out = [Op(name, "matmul", "F", flops, moved, 1, (m, n, k)),
           Op(name, "matmul", "I", flops, moved, 1, (m, k, n))]
    if weights:
        out.append(Op(name, "matmul", "W", flops, moved, 1, (k, n, m)))
    if fp8:  # amax, scale and cast X and W forward, dY backward: read 2 bytes, write 1
        out += [Op(name + ".cast", "memory", "F", 0.0, 3 * (m * k + k * n), 2),
                Op(name + ".cast", "memory", "I", 0.0, 3 * m * n, 1)]
    return out


def memory(name: str, elements: float, passes: float, act: int, kernels: int = 1) -> list[Op]:
    """An elementwise op over ``elements`` values, ``passes`` reads and writes of them
    forward; its backward reads the gradient and what was saved and writes one: twice."""
    moved = elements * passes * act
    return [Op(name, "memory", "F", 0.0, moved, kernels),
            Op(name, "memory", "I", 0.0, 2 * moved, kernels)]


def norm(name: str, c: Cut) -> list[Op]:
    """LayerNorm is one native kernel (read, write: 2 passes). An RMSNorm written in eager
    PyTorch, ``(x.float() * rsqrt(x.float().pow(2).mean(-1))).type_as(x) * g``, is six kernels
    that move 36 bytes a 16-bit value (upcast 6, square 8, mean 4, scale 8, downcast 6,
    gain 4): 18 passes; fused, one kernel and two passes."""
    eager = c.norm == "rmsnorm" and not (c.fused or c.fused_norm)
    return memory(name, c.norm_tokens * c.h, 18 if eager else 2, c.act, 6 if eager else 1)


def attention_core(c: Cut) -> list[Op]:
    """The attention core of one layer on one rank: FlashAttention (``c.flash``) or the
    scores as tensors (batched matmuls over the full square plus a softmax pass)."""
    q_len, k_len = c.tokens // c.b, c.seq  # a rank's queries see every key of the sequence
    qkvo = c.act * c.tokens * c.head_dim * (2 * c.heads + 2 * c.kv_heads)
    if c.flash:
        fwd = 2.0 * c.b * q_len * k_len * c.heads * c.head_dim  # 4·q·k·d per head, causal /2
        return [Op("attention", "attention", "F", fwd, qkvo),
                Op("attention", "attention", "I", 2.5 * fwd, 2 * qkvo)]
    scores = c.b * c.heads * q_len * k_len  # the s x s square, per head, not skipped
    batched = 2.0 * scores * c.head_dim
    return [Op("scores", "matmul", "F", batched, c.act * scores, c.b * c.heads),
            Op("softmax", "memory", "F", 0.0, 3 * c.act * scores, 1),
            Op("context", "matmul", "F", batched, c.act * scores, c.b * c.heads),
            Op("scores", "matmul", "I", 2 * batched, 2 * c.act * scores, 2 * c.b * c.heads),
            Op("softmax", "memory", "I", 0.0, 4 * c.act * scores, 1),
            Op("context", "matmul", "I", 2 * batched, 2 * c.act * scores, 2 * c.b * c.heads)]


def attention_block(c: Cut) -> list[Op]:
    """Norm, QKV, rotary, the core, the output projection and the residual add."""
    t, hd = c.tokens, c.head_dim
    qkv = hd * (c.heads + 2 * c.kv_heads)
    out = norm("norm1", c) + matmul("qkv", t, qkv, c.h, c.act, c.fp8)
    if c.rope:  # rotate q and k: eager, upcast, complex multiply, downcast (10 passes); fused 2
        out += memory("rotary", t * hd * (c.heads + c.kv_heads), 2 if c.fused else 10, c.act,
                      1 if c.fused else 6)
    out += attention_core(c) + matmul("proj", t, c.h, hd * c.heads, c.act, c.fp8)
    return out + memory("residual1", c.norm_tokens * c.h, 1 if c.fused else 3, c.act)


def mlp_block(c: Cut, ff: int | None = None, tokens: int | None = None, name: str = "mlp",
              count: int = 1) -> list[Op]:
    """An MLP of width ``ff`` on ``tokens`` (default: this rank's cut of the dense MLP):
    GELU's two matrices or SwiGLU's three, and the activation between them."""
    f, t = ff or c.ff, tokens or c.tokens
    mats = (["gate", "up"] if c.mlp == "swiglu" else ["fc"])
    out = []
    for m in mats:
        out += matmul(f"{name}.{m}", t, f, c.h, c.act, c.fp8)
    passes = (3 if c.fused else 5) if c.mlp == "swiglu" else 2  # silu(g)·u: two kernels eager
    out += memory(f"{name}.act", t * f, passes, c.act, 1 if c.fused or c.mlp != "swiglu" else 2)
    out += matmul(f"{name}.down", t, c.h, f, c.act, c.fp8)
    return [Op(o.name, o.kind, o.phase, o.flops * count, o.bytes * count, o.kernels * count,
               o.mnk) for o in out] if count != 1 else out


def dense_layer(c: Cut) -> list[Op]:
    """One dense transformer block: attention half, second norm, MLP half, residual add."""
    return (attention_block(c) + norm("norm2", c) + mlp_block(c)
            + memory("residual2", c.norm_tokens * c.h, 1 if c.fused else 3, c.act))


def moe_layer(c: Cut, experts: int, topk: float, ep: int, expert_ff: int,
              shared: int = 0) -> list[Op]:
    """A mixture-of-experts block: the attention half, then on every tp rank the whole MoE
    half on the rank's tokens (as edu3d runs it): router, permutation, ``E/ep`` local experts
    each on ``T·k·ep/E`` tokens (balanced routing), shared experts, weighted combine."""
    t = c.tokens
    routed = t * topk  # token copies this rank sends, and (balanced) receives
    out = attention_block(c) + norm("norm2", c)
    out += matmul("router", t, experts, c.h, 4)  # fp32 routing
    out += memory("route", t * experts, 6, 4, 4)  # softmax, top-k, normalise
    out += memory("permute", routed * c.h, 2, c.act, 2)
    local = max(1, experts // ep)
    out += mlp_block(c, expert_ff, max(1, round(routed / local)), "experts", local)
    if shared:
        out += mlp_block(c, expert_ff * shared, t, "shared")
    out += memory("combine", routed * c.h, 3, c.act, 2)
    return out + memory("residual2", c.norm_tokens * c.h, 1 if c.fused else 3, c.act)


def head_ops(c: Cut, fused_loss: bool = False) -> list[Op]:
    """The last stage's final norm, LM head (``V/tp`` rows) and cross entropy over the
    logits: eager upcasts to fp32, log-softmax, and the gradient back (~26 bytes a logit);
    a fused loss reads the logits once and writes their gradient once."""
    logits = c.tokens * c.vocab
    loss = [Op("loss", "memory", "F", 0.0, logits * (2 * c.act if fused_loss else 14), 1 if
               fused_loss else 3),
            Op("loss", "memory", "I", 0.0, logits * (2 * c.act if fused_loss else 12), 1 if
               fused_loss else 2)]
    return norm("final_norm", c) + matmul("head", c.tokens, c.vocab, c.h, c.act) + loss


def embedding_ops(c: Cut) -> list[Op]:
    """The first stage's lookup (read and write ``T·h``) and its backward: a dense fp32
    gradient of the whole ``V/tp x h`` table, zeroed and accumulated (3 passes)."""
    return [Op("embedding", "memory", "F", 0.0, 2 * c.act * c.tokens * c.h),
            Op("embedding", "memory", "W", 0.0, 12 * c.vocab * c.h + 4 * c.tokens * c.h, 2)]


def recomputed(ops: list[Op], mode: str) -> list[Op]:
    """The forward ops recomputation runs again (phase ``R``) before a layer's backward."""
    if mode in ("none", None):
        return []
    fwd = [o for o in ops if o.phase == "F"]
    if mode == "selective":  # the attention core (Korthikanti et al. 2022)
        keep = [o for o in fwd if o.name in ("attention", "scores", "softmax", "context")]
    elif mode == "op":  # torchtitan: every memory-bound op, and every second matmul
        mats = [o for o in fwd if o.kind == "matmul"]
        keep = [o for o in fwd if o.kind == "memory"] + mats[1::2]
    elif mode == "full":
        keep = fwd
    else:
        raise ValueError(f"recompute={mode!r}: choose none, selective, op or full")
    return [Op(o.name, o.kind, "R", o.flops, o.bytes, o.kernels, o.mnk) for o in keep]


def layer_comms(c: Cut, ep: int = 1, routed: float = 0.0, moe: bool = False,
                recompute: str = "none") -> list[Comm]:
    """The collectives of one layer and micro-batch (ring algorithms' byte counts in
    :mod:`edu3d.plan.links`). ``moe``: its MLP half runs whole on every tp rank, so tp talks
    only around the attention half."""
    out: list[Comm] = []
    x = c.act * c.tokens * c.h  # the layer's activations, every tp rank's tokens
    halves = (("qkv", "proj"),) + ((("mlp.gate" if c.mlp == "swiglu" else "mlp.fc",
                                     "mlp.down"),) if not moe else ())
    if c.tp > 1:
        for first, last in halves:
            if c.sp:  # gather the tokens before the column layer, scatter after the row one
                out += [Comm("tp", "all_gather", x, "F", first),
                        Comm("tp", "reduce_scatter", x, "F", last),
                        Comm("tp", "reduce_scatter", x, "I", first),
                        Comm("tp", "all_gather", x, "I", last)]
            else:  # g: all-reduce after the row layer; its conjugate f: in backward
                out += [Comm("tp", "all_reduce", x, "F", last),
                        Comm("tp", "all_reduce", x, "I", first)]
    if c.cp > 1:
        kv = c.act * c.tokens * c.head_dim * 2 * c.kv_heads  # this rank's K and V
        if c.cp_impl == "ring":  # K,V go round cp-1 times; backward again, and dK,dV cp times
            out += [Comm("cp", "send", kv, "F", "attention", c.cp - 1),
                    Comm("cp", "send", kv, "I", "attention", 2 * c.cp - 1)]
        elif c.cp_impl == "allgather":
            out += [Comm("cp", "all_gather", kv * c.cp, "F"),
                    Comm("cp", "reduce_scatter", kv * c.cp, "I")]
        else:  # Ulysses: q, k, v in and the output back, as all-to-alls; as many backward
            qkvo = c.act * c.tokens * c.head_dim * (2 * c.heads + 2 * c.kv_heads)
            out += [Comm("cp", "all_to_all", qkvo, "F"), Comm("cp", "all_to_all", qkvo, "I")]
    if moe and ep > 1:
        sent = c.act * routed * c.h
        out += [Comm("ep", "all_to_all", sent, "F"), Comm("ep", "all_to_all", sent, "F"),
                Comm("ep", "all_to_all", sent, "I"), Comm("ep", "all_to_all", sent, "I")]
    if recompute == "full":  # the forward's collectives run again
        out += [Comm(m.axis, m.kind, m.nbytes, "R", m.hides, m.steps) for m in out
                if m.phase == "F"]
    return out


@lru_cache(maxsize=4096)
def layer(c: Cut, recompute: str, moe: tuple | None = None,
          frozen: float = 0.0) -> tuple[tuple[Op, ...], tuple]:
    """A block's ops (forward, recomputation, backward) and its collectives; ``moe`` is
    ``(experts, topk, ep, expert_ff, shared)`` for a mixture-of-experts block; ``frozen`` the
    share of its weights that train not (``--freeze``): their weight gradients are skipped."""
    ops = moe_layer(c, *moe) if moe else dense_layer(c)
    ops = ops + recomputed(ops, recompute)
    if frozen:
        keep = 1.0 - frozen
        ops = [Op(o.name, o.kind, o.phase, o.flops * keep, o.bytes * keep,
                  round(o.kernels * keep), o.mnk) if o.phase == "W" else o for o in ops]
    routed = c.tokens * moe[1] if moe else 0.0
    comms = layer_comms(c, moe[2] if moe else 1, routed, bool(moe), recompute)
    return tuple(ops), tuple(comms)
