"""``edu3d plan``: will it fit, and which layout? The per-rank memory of a 3D layout.

After reading this file you should understand where every byte of a rank goes, stage by
stage, and how the classic answer to "how do I train this model on G GPUs" follows from it:

* **the model's state**: each rank holds the parameters of its pipeline stage(s), cut by
  tensor parallelism (matrices split, LayerNorms and row biases whole), and for each of them
  a gradient and the optimizer's state. Mixed precision (bf16/fp16) keeps 2 + 2 + 12 bytes
  per parameter (16-bit weights and gradients; fp32 master weights and Adam's two moments,
  the ZeRO paper's K = 12); fp32 training 4 + 4 + 8. ZeRO shards the optimizer state
  (stage 1), then the gradients (2), then the weights (3) over the dp ranks, each unit's
  flat buffer padded to a multiple of dp (:mod:`edu3d.parallel.zero`);
* **the activations**: bytes per layer and micro-batch from :mod:`edu3d.memory`
  (Korthikanti et al. 2022 for real models in 16-bit; the exact fp32 count for this course's
  GPT), times the layers of the stage, plus the first stage's token ids and the last
  stage's LayerNorm, head input and fp32 logits; times the micro-batches the schedule keeps
  alive at once, found by replaying the schedule (:func:`edu3d.parallel.pp.simulate.simulate`):
  1F1B keeps up to ``p`` on the first stage, GPipe all ``m``, interleaved a little more than
  1F1B;
* **at rest and at the peak**: after the optimizer step ZeRO-2/3 hold gradient (and ZeRO-3
  weight) shards only; during the step edu3d keeps a stage's full gradients (and ZeRO-3 its
  gathered weights) while its micro-batches run, so traffic does not grow with ``m``. The
  peak is what must fit; the rest is what ``edu3d train`` measures after a step;
* **communication buffers**: pipeline receive buffers (edu3d posts all of a step's receives
  at its start) and ZeRO's flat gradient of one unit before its reduce-scatter.

The layout search and its cost model live in :mod:`edu3d.plan_search`; the command line at
the end of this file.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from edu3d import memory
from edu3d.parallel.pp.partition import uniform
from edu3d.parallel.pp.schedules import build, chunks
from edu3d.parallel.pp.simulate import simulate

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm")
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's published shape (enough to count every byte)."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
    d_ff: int | None = None  # default 4 * d_model
    n_kv_heads: int | None = None  # grouped-query attention (LLaMA-2 70B: 8)
    mlp: str = "gelu"  # or "swiglu" (three matrices)
    norm: str = "layernorm"  # or "rmsnorm" (a gain, no bias)
    bias: bool = True
    tied: bool = False
    learned_pos: bool = True  # a position table (GPT); RoPE has none
    course: bool = False  # edu3d's own GPT: the exact fp32 activation count applies
    global_batch: int = 8  # sequences per step (the published batch for real models)

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def layer_tensors(self, t: int = 1) -> list[tuple[str, int, bool]]:
        """``(name, elements on one tp rank, is a matrix)`` of one layer, in module order."""
        h, f, hd = self.d_model, self.ff, self.d_model // self.n_heads
        qkv = h + 2 * self.kv_heads * hd  # output features of the fused q|k|v
        norm = [("w", h, False)] + ([("b", h, False)] if self.norm == "layernorm" else [])
        bias = self.bias
        out = [(f"ln1.{n}", k, m) for n, k, m in norm]
        out += [("qkv.w", qkv * h // t, True)] + ([("qkv.b", qkv // t, False)] if bias else [])
        out += [("proj.w", h * h // t, True)] + ([("proj.b", h, False)] if bias else [])
        out += [(f"ln2.{n}", k, m) for n, k, m in norm]
        if self.mlp == "swiglu":
            out += [("gate.w", f * h // t, True), ("up.w", f * h // t, True),
                    ("down.w", h * f // t, True)]
        else:
            out += [("fc.w", f * h // t, True)] + ([("fc.b", f // t, False)] if bias else [])
            out += [("fc2.w", h * f // t, True)] + ([("fc2.b", h, False)] if bias else [])
        return out

    def vocab_rows(self, t: int = 1) -> int:
        """Vocabulary rows on one tp rank (padded to a multiple of tp, as Megatron does)."""
        return math.ceil(self.vocab_size / t)

    def num_params(self) -> int:
        """Parameters of the whole model (a tied head counted once)."""
        layer = sum(n for _, n, _ in self.layer_tensors())
        norm = self.d_model * (2 if self.norm == "layernorm" else 1)
        emb = self.vocab_size * self.d_model + (self.seq_len * self.d_model
                                                if self.learned_pos else 0)
        return self.n_layers * layer + norm + emb + (0 if self.tied else
                                                     self.vocab_size * self.d_model)


def _course(name: str, tie: bool | None = None) -> ModelSpec:
    from edu3d.model import PRESETS

    c = PRESETS[name]
    return ModelSpec(name, c.n_layers, c.d_model, c.n_heads, c.seq_len, c.vocab_size,
                     tied=c.tie_weights if tie is None else tie, course=True)


def _gpt2(name, layers, d, heads):
    return ModelSpec(name, layers, d, heads, 1024, 50257, tied=True, global_batch=512)


def _llama2(name, layers, d, heads, ff, kv=None):
    return ModelSpec(name, layers, d, heads, 4096, 32000, d_ff=ff, n_kv_heads=kv, mlp="swiglu",
                     norm="rmsnorm", bias=False, learned_pos=False, global_batch=1024)


COURSE_PRESETS = ("tiny", "small", "medium", "gpt2-small")
REAL = {  # published shapes; PUBLISHED_PARAMS is what the papers report
    "gpt2": _gpt2("gpt2", 12, 768, 12), "gpt2-medium": _gpt2("gpt2-medium", 24, 1024, 16),
    "gpt2-large": _gpt2("gpt2-large", 36, 1280, 20), "gpt2-xl": _gpt2("gpt2-xl", 48, 1600, 25),
    "llama2-7b": _llama2("llama2-7b", 32, 4096, 32, 11008),
    "llama2-13b": _llama2("llama2-13b", 40, 5120, 40, 13824),
    "llama2-70b": _llama2("llama2-70b", 80, 8192, 64, 28672, kv=8),
    "gpt3-175b": ModelSpec("gpt3-175b", 96, 12288, 96, 2048, 50257, tied=True,
                           global_batch=1536),
}
PUBLISHED_PARAMS = {"gpt2": 124e6, "gpt2-medium": 355e6, "gpt2-large": 774e6,
                    "gpt2-xl": 1.56e9, "llama2-7b": 6.74e9, "llama2-13b": 13.0e9,
                    "llama2-70b": 69.0e9, "gpt3-175b": 175e9}
PRESETS = (*COURSE_PRESETS, *REAL)


def spec_from(preset: str, **overrides) -> ModelSpec:
    """A preset with fields overridden (``None`` keeps the preset's value): ``n_layers``,
    ``n_heads``, ``d_model``, ``seq_len``, ``vocab_size``, ``tied``, ``n_kv_heads``, ``d_ff``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model {preset!r}; choose one of {', '.join(PRESETS)}")
    spec = _course(preset) if preset in COURSE_PRESETS else REAL[preset]
    spec = dataclasses.replace(spec, **{k: v for k, v in overrides.items() if v is not None})
    if spec.d_model % spec.n_heads or spec.n_heads % spec.kv_heads:
        raise ValueError(f"n_heads={spec.n_heads} must divide d_model={spec.d_model} and be a "
                         f"multiple of n_kv_heads={spec.kv_heads}")
    return spec


def spec_for_params(n: float, seq: int = 2048, vocab: int = 50257) -> ModelSpec:
    """A GPT-3-shaped model of about ``n`` parameters: ``12·L·h²`` with ``h = 128·L``
    (GPT-3's width per layer), ``h`` a multiple of 128, heads of 128 dimensions."""
    if n < 1e6:
        raise ValueError(f"--params {n:g}: give at least 1e6 parameters (e.g. 7e9)")
    h = max(128, round((n * 128 / 12) ** (1 / 3) / 128) * 128)
    layers = max(1, round((n - 2 * vocab * h) / (12 * h * h)))
    return ModelSpec(f"{n / 1e9:.3g}B", layers, h, h // 128, seq, vocab, global_batch=1024)


# ---- the layout --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """How the model is trained: the layout, the batch and the recipe."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    zero: int = 0
    microbatches: int = 1
    micro_batch: int = 1  # sequences per micro-batch
    schedule: str = "1f1b"
    sp: bool = False
    recompute: str = "none"
    precision: str = "fp32"
    optimizer: str = "adamw"

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.dp * self.microbatches * self.micro_batch


def validate(spec: ModelSpec, st: Setup) -> None:
    """Raise ``ValueError`` saying what to change when ``st`` cannot run ``spec``."""
    if spec.n_heads % st.tp or spec.kv_heads % st.tp and st.tp % spec.kv_heads:
        raise ValueError(f"tp={st.tp} must divide n_heads={spec.n_heads} (and KV heads "
                         f"{spec.kv_heads} split or replicate evenly)")
    if st.pp * chunks(st.schedule, st.vpp) > spec.n_layers:
        raise ValueError(f"pp*vpp = {st.pp * st.vpp} stages for {spec.n_layers} layers")
    if st.zero and st.dp == 1:
        raise ValueError(f"ZeRO-{st.zero} shards over dp; use dp >= 2")
    if st.sp and spec.seq_len % st.tp:
        raise ValueError(f"sequence parallelism: tp={st.tp} must divide seq={spec.seq_len}")
    if st.vpp > 1 and st.schedule != "interleaved":
        raise ValueError(f"vpp={st.vpp} needs the interleaved schedule")
    if st.schedule == "interleaved" and st.pp > 1 and st.microbatches % st.pp:
        raise ValueError(f"interleaved: microbatches={st.microbatches} must be a multiple "
                         f"of pp={st.pp}")
    for name, value, ok in (("precision", st.precision, PRECISIONS),
                            ("recompute", st.recompute, RECOMPUTE),
                            ("zero", st.zero, (0, 1, 2, 3))):
        if value not in ok:
            raise ValueError(f"{name}={value!r}: choose one of {', '.join(map(str, ok))}")


def state_bytes(precision: str, optimizer: str = "adamw") -> tuple[int, int, int]:
    """Bytes per parameter of (weights, gradients, optimizer state)."""
    moments = 8 if optimizer == "adamw" else 0
    if precision == "fp32":
        return 4, 4, moments
    return 2, 2, 4 + moments  # fp32 master copy + moments: the ZeRO paper's K = 12


# ---- parameters per rank -------------------------------------------------------------------------
def units(spec: ModelSpec, st: Setup, pp_rank: int) -> list[tuple[str, list[tuple[int, bool]]]]:
    """``(unit, [(elements, is a matrix)])`` this pipeline rank holds on one tp rank, in the
    order ZeRO builds its flat buffers (:func:`edu3d.parallel.zero.model_units`)."""
    t, h, v = st.tp, spec.d_model, chunks(st.schedule, st.vpp)
    parts = uniform(spec.n_layers, st.pp * v)
    n_stages = len(parts)
    tok = (spec.vocab_rows(t) * h, True)
    norm = [(h, False)] * (2 if spec.norm == "layernorm" else 1)
    layer = [(n, m) for _, n, m in spec.layer_tensors(t)]
    out = []
    for s in range(pp_rank, n_stages, st.pp):
        first, last = s == 0, s == n_stages - 1
        tied_here = spec.tied and (first or last)
        if tied_here and (n_stages > 1 or first):
            out.append(("tied", [tok]))
        if first:
            emb = ([] if spec.tied else [tok]) + ([(spec.seq_len * h, True)]
                                                  if spec.learned_pos else [])
            if emb:
                out.append(("embed", emb))
        out += [(f"block{i}", layer) for i in range(*parts[s])]
        if last:
            out.append(("head", norm + ([] if spec.tied else [tok])))
    return out


def _shard(unit: list[tuple[int, bool]], n: int, index: int) -> tuple[int, int, int]:
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


def state_per_rank(spec: ModelSpec, st: Setup, pp_rank: int, dp_index: int = 0,
                   at: str = "peak") -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state on one rank (``at="rest"``: after the
    optimizer step, what ``Trainer.stats`` measures; ``"peak"``: during the step)."""
    pb, gb, ob = state_bytes(st.precision, st.optimizer)
    step_bytes = 4 if ob else 0  # AdamW's step counter: one fp32 scalar per tensor it updates
    us = units(spec, st, pp_rank)
    full = sum(k for _, u in us for k, _ in u)
    tensors = sum(len(u) for _, u in us)
    if not st.zero:
        return {"params": pb * full, "grads": gb * full,
                "optimizer": ob * full + step_bytes * tensors * bool(ob)}
    n = st.dp
    shards = [_shard(u, n, dp_index) for _, u in us]
    padded = sum(p for p, _, _ in shards)
    shard = sum(s for _, s, _ in shards)
    covered = sum(min(s, max(0, sum(k for k, _ in u) - dp_index * s))
                  for (_, u), (_, s, _) in zip(us, shards))
    optimizer = ob * covered + step_bytes * sum(p for _, _, p in shards)
    biggest = max(p for p, _, _ in shards)
    held_full = st.microbatches > 1 or st.pp > 1  # edu3d reduces once per step
    params = pb * (padded if st.zero < 3 else shard)
    grads = gb * (padded if st.zero < 2 else shard)
    if at == "peak" and st.zero >= 2:
        grads += gb * (padded if held_full else biggest)
    if at == "peak" and st.zero == 3:
        params += pb * (padded if held_full else 2 * biggest)  # gathered (and prefetched)
    return {"params": params, "grads": grads, "optimizer": optimizer}


# ---- activations per rank ------------------------------------------------------------------------
def stage_activation_bytes(spec: ModelSpec, st: Setup) -> list[float]:
    """Bytes one micro-batch keeps for backward on each global stage."""
    s, b, h, a, t = spec.seq_len, st.micro_batch, spec.d_model, spec.n_heads, st.tp
    rec = None if st.recompute == "none" else st.recompute
    parts = uniform(spec.n_layers, st.pp * chunks(st.schedule, st.vpp))
    sp = st.sp and t > 1
    if spec.course and st.precision == "fp32":
        layer = memory.course_activation_bytes_per_layer(s, b, h, a, t, sp, rec)
        ids = 8 * st.global_batch * s  # a view into the global batch keeps its whole storage
        if t > 1:  # the vocabulary-parallel embedding keeps its local ids and mask
            first = 9 * s * b + 8 * s
            last = (4 * s * b * h + 8 * s * b) / (t if sp else 1) + 4 * s * b * h / (
                t if sp else 1) + 4 * s * b * spec.vocab_rows(t) + 10 * s * b
        else:
            first = ids + 8 * s
            last = 4 * s * b * h + 8 * s * b + 4 * s * b * h + 4 * s * b * spec.vocab_size + ids
    else:
        layer = memory.activation_bytes_per_layer(
            s, b, h, a, t, sp, rec, d_ff=spec.ff, kv_heads=spec.kv_heads, mlp=spec.mlp)
        first = 0.0
        # final norm and head inputs (16-bit), fp32 logits for the loss (Korthikanti 4.3)
        last = 4 * s * b * h / (t if sp else 1) + 4 * s * b * spec.vocab_rows(t)
    out = []
    for i, (lo, hi) in enumerate(parts):
        out.append((hi - lo) * layer + (first if i == 0 else 0) +
                   (last if i == len(parts) - 1 else 0))
    return out


def _replayed(schedule: str, pp: int, m: int) -> int:
    """How many micro-batches to replay: past ``2p`` (a multiple of ``p``) nothing changes
    in the steady state of 1F1B, interleaved or ZB-H1 (a test checks it), and the replay
    grows with ``m``; GPipe holds every micro-batch, so its peak is ``m`` itself."""
    return m if schedule == "gpipe" else min(m, 2 * pp)


@lru_cache(maxsize=512)
def in_flight(schedule: str, pp: int, m: int, vpp: int = 1) -> tuple[int, ...]:
    """The most micro-batches each pipeline rank keeps alive, from replaying the schedule."""
    if schedule == "gpipe":
        return (m,) * pp
    replay = _replayed(schedule, pp, m)
    return tuple(simulate(build(schedule, pp, replay, chunks(schedule, vpp)), pp).peak_in_flight)


def activations_per_rank(spec: ModelSpec, st: Setup) -> list[float]:
    """Peak activation bytes of each pipeline rank over the step's schedule."""
    per_stage = stage_activation_bytes(spec, st)
    if st.pp == 1:  # gradient accumulation: one micro-batch at a time
        return [sum(per_stage)]
    v = chunks(st.schedule, st.vpp)
    if v == 1:
        return [n * a for n, a in zip(in_flight(st.schedule, st.pp, st.microbatches), per_stage)]
    actions = build(st.schedule, st.pp, _replayed(st.schedule, st.pp, st.microbatches), v)
    return list(simulate(actions, st.pp, activation_bytes=per_stage).peak_activation_bytes)


def comm_per_rank(spec: ModelSpec, st: Setup, pp_rank: int) -> float:
    """Pipeline receive buffers and ZeRO's flat gradient of one unit before its reduce-scatter.

    edu3d posts all of a step's receives at its start (one buffer per micro-batch, chunk and
    direction: see :class:`~edu3d.parallel.pp.engine.PipelineEngine`); Megatron keeps about
    two per direction, which is what the planner assumes for real models."""
    act = 2 if st.precision != "fp32" else 4
    msg = act * st.micro_batch * spec.seq_len * spec.d_model / (st.tp if st.sp else 1)
    directions = (pp_rank > 0) + (pp_rank < st.pp - 1) if st.pp > 1 else 0
    v = chunks(st.schedule, st.vpp)
    buffers = st.microbatches * v if spec.course else 2
    out = directions * buffers * msg
    if st.zero >= 2:
        _, gb, _ = state_bytes(st.precision, st.optimizer)
        out += gb * max(sum(k for k, _ in u) for _, u in units(spec, st, pp_rank))
    return out


# ---- the estimate --------------------------------------------------------------------------------
def estimate(spec: ModelSpec, st: Setup, at: str = "peak") -> dict:
    """Bytes per rank by category for every pipeline rank (``per_stage``), and the most loaded
    one's at the top level (``params_bytes`` ... ``total_bytes``)."""
    validate(spec, st)
    acts = activations_per_rank(spec, st)
    per_stage = []
    for r in range(st.pp):
        # ZeRO's shards differ by a few optimizer pieces between dp ranks: the fullest counts
        indices = range(st.dp if st.zero and spec.course else 1)
        worst = max((state_per_rank(spec, st, r, i, at) for i in indices),
                    key=lambda d: sum(d.values()))
        row = {"pp_rank": r, **worst, "activations": acts[r],
               "comm": comm_per_rank(spec, st, r) if at == "peak" else 0.0}
        row["total"] = sum(row[c] for c in CATEGORIES)
        per_stage.append(row)
    top = max(per_stage, key=lambda row: row["total"])
    out = {f"{c}_bytes": top[c] for c in CATEGORIES}
    out.update(total_bytes=top["total"], fullest_pp_rank=top["pp_rank"], per_stage=per_stage,
               num_params=spec.num_params(), activation_model=(
                   "edu3d fp32 (exact)" if spec.course and st.precision == "fp32"
                   else "Korthikanti et al. 2022, 16-bit"))
    return out


def from_train_args(args) -> tuple[ModelSpec, Setup]:
    """The model and setup of an ``edu3d train`` run (options checked by
    :func:`edu3d.options.check_args`): what the planner predicts for that very run."""
    spec = spec_from(args.model, n_layers=args.layers, n_heads=args.heads,
                     d_model=args.d_model, seq_len=args.seq, vocab_size=args.vocab,
                     tied=args.tie)
    m = args.microbatches or args.pp
    st = Setup(dp=args.dp, tp=args.tp, pp=args.pp, vpp=args.vpp, zero=args.zero,
               microbatches=m, micro_batch=args.global_batch // (args.dp * m),
               schedule=args.schedule, sp=args.sp, recompute=args.recompute,
               precision=args.precision, optimizer=args.optimizer)
    return spec, st


# ---- edu3d plan ----------------------------------------------------------------------------------
def add_arguments(parser):
    """``edu3d plan``'s options."""
    from edu3d.options import _number, positive_int

    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", choices=PRESETS, help="a preset: the course's or a real model")
    what.add_argument("--params", type=_number(1e6, True, "7e9"),
                      help="a GPT-3-shaped model of about this many parameters")
    m = parser.add_argument_group("model overrides")
    for flag, kw in (("--layers", "n_layers"), ("--heads", "n_heads"), ("--d-model", "d_model"),
                     ("--seq", "seq_len"), ("--vocab", "vocab_size"),
                     ("--kv-heads", "n_kv_heads"), ("--ffn", "d_ff")):
        m.add_argument(flag, dest=kw, type=positive_int, help=f"override {kw}")
    m.add_argument("--tie", action="store_true", default=None, help="tie the head to the embedding")
    lay = parser.add_argument_group("layout (without --gpus, or to check one layout on them)")
    for flag in ("--dp", "--tp", "--pp", "--vpp"):
        lay.add_argument(flag, type=positive_int, default=None, help=f"{flag[2:]} degree")
    lay.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage")
    lay.add_argument("--microbatches", type=positive_int, help="micro-batches per step")
    lay.add_argument("--micro-batch-size", type=positive_int, help="sequences per micro-batch")
    lay.add_argument("--global-batch", type=positive_int,
                     help="sequences per step (default: the preset's published batch; 8 for "
                          "the course's models, as edu3d train)")
    lay.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "zb-h1"),
                     default="1f1b")
    lay.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    lay.add_argument("--recompute", choices=RECOMPUTE, default="none")
    lay.add_argument("--precision", choices=PRECISIONS, default=None,
                     help="fp32 (4+4+8 bytes/param) or mixed bf16/fp16 (2+2+12); default fp32 "
                          "for the course's models, bf16 otherwise")
    lay.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    cl = parser.add_argument_group("cluster and cost model (with --gpus, the layout search)")
    cl.add_argument("--gpus", type=positive_int, help="GPUs to plan for: search every layout")
    cl.add_argument("--gpu-mem", type=_number(0, False, "80"), default=None,
                    help="GB per GPU (default with --gpus: 80)")
    cl.add_argument("--gpus-per-node", type=positive_int, default=8)
    cl.add_argument("--peak-tflops", type=_number(0, False, "989"), default=989.0)
    cl.add_argument("--mfu", type=_number(0, False, "0.45"), default=0.45)
    cl.add_argument("--intra-gbps", type=_number(0, False, "300"), default=300.0,
                    help="GB/s inside a node (NVLink)")
    cl.add_argument("--inter-gbps", type=_number(0, False, "25"), default=25.0,
                    help="GB/s per GPU across nodes (InfiniBand)")
    cl.add_argument("--top", type=positive_int, default=8, help="layouts listed")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return parser


def add_subcommand(sub):
    """Register ``plan`` on ``edu3d``'s subcommands."""
    p = sub.add_parser("plan", help="will it fit? per-rank memory of a layout, and the best "
                                    "layout for a cluster",
                       description="Per-rank memory by category and pipeline stage for a "
                                   "layout; with --gpus, every layout ranked by an estimated "
                                   "step time, and the recommended one with its reasons.")
    add_arguments(p)
    p.set_defaults(func=main_from_args)
    return p


def setup_from_args(args) -> tuple[ModelSpec, Setup]:
    """The model and the layout ``edu3d plan``'s options describe (``ValueError`` if they
    cannot work together)."""
    over = {k: getattr(args, k) for k in ("n_layers", "n_heads", "d_model", "seq_len",
                                          "vocab_size", "n_kv_heads", "d_ff")}
    if args.params is not None:
        spec = dataclasses.replace(spec_for_params(args.params),
                                   **{k: v for k, v in over.items() if v is not None})
    else:
        spec = spec_from(args.model, tied=args.tie, **over)
    dp, tp, pp = (getattr(args, k) or 1 for k in ("dp", "tp", "pp"))
    gb, m, b = args.global_batch, args.microbatches, args.micro_batch_size
    if m and b:
        gb = dp * m * b
    gb = gb or spec.global_batch
    if not m:
        m = gb // (dp * b) if b else (pp if spec.course else max(1, gb // dp))
    b = b or gb // (dp * m)
    if gb != dp * m * b or b < 1:
        raise ValueError(f"global batch {gb} does not split into dp={dp} x {m} micro-batches "
                         "of whole sequences; change --global-batch, --microbatches or "
                         "--micro-batch-size")
    precision = args.precision or ("fp32" if spec.course else "bf16")
    st = Setup(dp=dp, tp=tp, pp=pp, vpp=args.vpp or 1, zero=args.zero, microbatches=m,
               micro_batch=b, schedule=args.schedule, sp=args.sp, recompute=args.recompute,
               precision=precision, optimizer=args.optimizer)
    validate(spec, st)
    return spec, st


def describe(spec: ModelSpec, st: Setup) -> str:
    pb, gb, ob = state_bytes(st.precision, st.optimizer)
    return (f"dp={st.dp} tp={st.tp} pp={st.pp}" + (f" vpp={st.vpp}" if st.vpp > 1 else "")
            + f" ZeRO-{st.zero}, {st.microbatches} micro-batch(es) of {st.micro_batch} x "
            f"{spec.seq_len} tokens, {st.schedule}, recompute {st.recompute}, {st.precision} "
            f"({pb}+{gb}+{ob} bytes/param)" + (", SP" if st.sp else ""))


def table(est: dict) -> str:
    """Per-stage bytes as a text table (GB when large, MB otherwise)."""
    big = est["total_bytes"] > 1e9
    unit, div = ("GB", 1e9) if big else ("MB", 1e6)
    cols = CATEGORIES + ("total",)
    lines = [f"{'per rank (' + unit + ')':<18}" + "".join(f"{c:>13}" for c in cols)]
    n = len(est["per_stage"])
    for row in est["per_stage"]:
        r = row["pp_rank"]
        name = f"pp rank {r}" + (" first" if r == 0 and n > 1 else "") + (
            " last" if r == n - 1 and n > 1 else "")
        lines.append(f"{name:<18}" + "".join(f"{row[c] / div:>13.3f}" for c in cols))
    return "\n".join(lines)


def _json_setup(st: Setup) -> dict:
    return dataclasses.asdict(st)


def main_from_args(args) -> int:
    """``edu3d plan``: 0 when it fits (or nothing was asked to fit), 1 when it does not,
    2 for options that cannot work together."""
    import json
    import sys

    from edu3d import plan_search

    try:
        spec, st = setup_from_args(args)
    except ValueError as err:
        print(f"edu3d plan: {err}", file=sys.stderr)
        return 2
    searching = args.gpus is not None and not any((args.dp, args.tp, args.pp))
    mem_gb = args.gpu_mem or (80.0 if args.gpus else None)
    if args.gpus is not None and not searching and st.gpus != args.gpus:
        print(f"edu3d plan: dp*tp*pp = {st.gpus} but --gpus {args.gpus}; give a layout whose "
              "product is the GPU count, or leave --dp/--tp/--pp out to search",
              file=sys.stderr)
        return 2
    cluster = plan_search.Cluster(args.gpus or st.gpus, mem_gb or 80.0, args.gpus_per_node,
                                  args.peak_tflops, args.mfu, args.intra_gbps, args.inter_gbps)
    out = {"model": dataclasses.asdict(spec), "num_params": spec.num_params()}
    if searching:
        rows = plan_search.search(spec, cluster, st.global_batch, st.precision, st.schedule)
        if not rows or not rows[0]["fits"]:
            print(f"edu3d plan: no layout of {spec.name} fits {args.gpus} GPUs of {mem_gb:g} GB"
                  + (f" (the best needs {rows[0]['memory']['total_bytes'] / 1e9:.1f} GB)"
                     if rows else ""), file=sys.stderr)
            return 1
        best = rows[0]
        why = plan_search.reasons(spec, cluster, rows)
        st = best["setup"]
        out["recommended"] = {**_json_setup(st), "reasons": why,
                              "step_time_s": best["time"]}
        out["candidates"] = [{**_json_setup(r["setup"]), "total_bytes": r["memory"]["total_bytes"],
                              "step_time_s": r["time"]["total"], "fits": r["fits"]}
                             for r in rows[:args.top]]
        out["cost_model"] = plan_search.__doc__.split("The cost model")[1].strip()
        out["cluster"] = dataclasses.asdict(cluster)
    est = estimate(spec, st)
    out.update(est)
    out["setup"] = _json_setup(st)
    fits = None if mem_gb is None else est["total_bytes"] <= cluster.usable * mem_gb * 1e9
    out["fits"] = fits
    if args.json:
        print(json.dumps(out))
        return 0 if fits is not False else 1
    print(f"{spec.name}: {spec.num_params() / 1e9:.3f} B parameters; activations: "
          f"{est['activation_model']}")
    if searching:
        print(f"cluster: {cluster.describe()}")
        print(f"{len(rows)} layouts, {sum(r['fits'] for r in rows)} fit; fastest first:")
        for r in rows[:args.top]:
            print(f"  {r['time']['total']:9.2f} s/step  {r['memory']['total_bytes'] / 1e9:6.1f} GB"
                  f"  {'fits' if r['fits'] else 'too big'}  {describe(spec, r['setup'])}")
        print("recommended: " + describe(spec, st))
        for line in why:
            print(f"  - {line}")
    else:
        print("layout: " + describe(spec, st))
    print(table(est))
    verdict = "" if fits is None else (
        f"  {'FITS' if fits else 'DOES NOT FIT'} in {cluster.usable * mem_gb:.1f} GB usable of "
        f"{mem_gb:g} GB")
    size = (f"{est['total_bytes'] / 1e9:.3f} GB" if est["total_bytes"] > 1e9 else
            f"{est['total_bytes'] / 1e6:.3f} MB")
    print(f"fullest: pp rank {est['fullest_pp_rank']}, {size}" + verdict)
    return 0 if fits is not False else 1


def plan_main(argv: list[str] | None = None) -> int:
    """``edu3d plan ...`` as a function (returns the exit code)."""
    import argparse

    return main_from_args(add_arguments(argparse.ArgumentParser(prog="edu3d plan")).parse_args(argv))
