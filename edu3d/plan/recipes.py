"""Memory recipes: how each framework keeps a model's state, and what that costs per rank.

After reading this file you should understand why two frameworks training the same model on
the same layout need different memory, and which few choices make the difference:

* **what a parameter costs**: the 16-bit weight the forward uses, its gradient (16-bit, or
  accumulated in fp32: Megatron's main gradients, nanotron's ``ACCUMULATE_GRAD_IN_FP32``,
  DeepSpeed's BF16_Optimizer), an fp32 master copy, and Adam's two fp32 moments. The ZeRO
  paper's mixed-precision count is 2 + 2 + 12 = 16 bytes; Megatron and nanotron keep 2 + 4 +
  12 = 18, DeepSpeed's BF16_Optimizer 2 + 2 + 4 + 12 = 20 (its fp32 gradient buffer is never
  sharded). FSDP2 (torchtitan) shards fp32 weights, fp32 gradients and the moments:
  16 bytes / N, plus the 16-bit copy of the unit being computed;
* **what ZeRO shards** (``run.parallel.zero``): stage 1 the master copy and moments, 2 also
  the gradients, 3 also the weights, over the ``dp·cp`` ranks;
* **activations** (:func:`activation_bytes_per_layer` of :mod:`edu3d.plan.formulas`, 16-bit):
  FlashAttention never stores the ``s²`` scores, so every framework recipe counts the
  selective form; torchtitan's op-level recomputation keeps the outputs of every second
  matmul and of the attention core only; full recomputation keeps each block's input; the
  loss keeps fp32 logits unless it is fused (chunked) or compiled (torchtitan compiles it with
  the model since d1f62be, Feb 2025: 16-bit logits saved, a 16-bit gradient, no fp32 copy);
* **what FSDP2 keeps gathered**: torchtitan wraps each block, then the model itself, whose
  root unit (embedding, final norm, output head) is gathered before the output's backward and
  freed after the embedding's, its head's 16-bit gradient held that long too
  (``fully_shard(model, ...)`` in torchtitan's parallelize_llama.py, at 9dec370 and e7c0cae);
* **what the allocator and runtime add**: PyTorch's caching allocator reserves more than it
  allocates (``allocator_factor``, "max reserved" / "max allocated"), and the CUDA context,
  cuBLAS and NCCL take ``runtime_memory`` before any tensor (a fit check counts it; torch's
  "max reserved" does not).

``edu3d`` is this course's own recipe (fp32 weights under autocast for its models, the
ZeRO paper's 16 bytes for real ones): it is :func:`edu3d.plan.estimate.estimate`, exact
byte for byte against edu3d's own runs. The others are presets, and each also names the
compute choices a framework makes (fused kernels, a fused loss, whether gradients reduce
in fp32, and which collectives overlap), which :mod:`edu3d.plan.step` uses. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from edu3d.config.sections import Run
from edu3d.model.shapes import ModelSpec
from edu3d.plan import estimate as edu3d_estimate
from edu3d.plan import formulas
from edu3d.plan.formulas import as_moe
from edu3d.plan.hardware import Profile
from edu3d.plan.inventory import held
from edu3d.schedules.actions import chunks, placement, stages_of
from edu3d.schedules.partition import planner_cut

GIB = 2**30


@dataclass(frozen=True)
class Recipe:
    """A framework's choices. Bytes per parameter: ``weight`` (the copy the forward uses),
    ``grad`` (the accumulation buffer), ``master`` (fp32 copy; 0 when the weights are it),
    ``moments`` (Adam's); ``reduce``/``gather``: bytes per value a gradient reduction and a
    weight all-gather move; ``grad_unsharded``: the gradient buffer stays whole under ZeRO."""

    name: str
    about: str
    weight: int = 2
    grad: int = 2
    master: int = 4
    moments: int = 8
    reduce: int = 2
    gather: int = 2
    grad_unsharded: bool = False
    fused: bool = False  # elementwise ops fused (Megatron/TE kernels); compile=True also fuses
    fused_norm: bool = False  # a fused norm kernel in otherwise eager code
    fused_loss: bool = False  # cross entropy without fp32 logits
    compiled_loss: bool = False  # with precision.compile, the loss compiled too (16-bit logits)
    root_unit: bool = False  # FSDP2's root unit (embedding, head) gathered through the backward
    overlap_dp: bool = True  # gradient buckets reduce while backward runs
    overlap_gather: bool = False  # ZeRO-1/2 weight all-gather hidden behind the next forward
    prefetch: bool = True  # ZeRO-3 gathers the next unit while one computes
    host: float = 0.0  # seconds of the framework's own Python per kernel launched (fitted)


RECIPES = {
    "edu3d": Recipe("edu3d", "edu3d's own runs (estimate.py, exact): autocast over fp32 weights "
                    "for the course's models, the ZeRO paper's 2 + 2 + 12 for real ones",
                    overlap_dp=False, prefetch=False),
    "megatron": Recipe("megatron", "Megatron-LM: bf16 weights, fp32 main gradients (reduced in "
                       "fp32), distributed optimizer (ZeRO-1), fused kernels, DP and TP overlap",
                       grad=4, reduce=4, fused=True, overlap_gather=True),
    "nanotron": Recipe("nanotron", "nanotron: bf16 weights and gradients plus an fp32 "
                       "accumulation buffer and master copy, ZeRO-0/1, eager kernels but a "
                       "fused (Triton) RMSNorm; ~90 us of Python around each kernel (fitted)",
                       grad=6, reduce=4, fused_norm=True, host=90e-6),
    "torchtitan": Recipe("torchtitan", "torchtitan (FSDP2): fp32 sharded weights, gradients and "
                         "moments, bf16 compute copies, fp32 gradient reduce-scatter",
                         weight=4, grad=4, master=0, reduce=4, root_unit=True),
    "torchtitan-2025": Recipe("torchtitan-2025", "torchtitan from d1f62be (Feb 2025): as "
                              "torchtitan, and with torch.compile the loss compiled too",
                              weight=4, grad=4, master=0, reduce=4, root_unit=True,
                              compiled_loss=True),
    "deepspeed": Recipe("deepspeed", "DeepSpeed BF16_Optimizer (BLOOM): ZeRO-1, bf16 weights "
                        "and gradients, an unsharded fp32 gradient buffer, fused kernels",
                        grad=6, reduce=4, grad_unsharded=True, fused=True),
}


def recipe_of(name: str) -> Recipe:
    """A recipe by name, refused in one line listing the known ones."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]


# ---- activations of a framework recipe ------------------------------------------------------
def layer_activations(spec: ModelSpec, run: Run, recompute: str) -> float:
    """Bytes one 16-bit layer keeps for backward per micro-batch, FlashAttention (no scores,
    no dropout masks): Korthikanti's selective count, torchtitan's op-level count (the block's
    input, the outputs of every second matmul: Q, V, the MLP's first matrix and the block's
    output, and the attention output) or full recomputation's block input; ``/cp``."""
    lay, sp = run.layout, run.parallel.sp and run.layout.tp > 1
    s, b, h, t = spec.seq_len, run.micro_batch, spec.d_model, lay.tp
    if recompute == "full":
        whole = 2 * s * b * h / (t if sp else 1)
    elif recompute == "op":
        kv = spec.kv_heads / spec.n_heads
        split = s * b * (2 * h * (2 + kv) + 2 * spec.ff)  # q, v, attention out, MLP first
        whole = 2 * s * b * h * 2 / (t if sp else 1) + split / t  # block input and output
    else:
        whole = formulas.activation_bytes_per_layer(
            s, b, h, spec.n_heads, t, sp, "selective", d_ff=spec.ff, kv_heads=spec.kv_heads,
            mlp=spec.mlp) - s * b * h * (2 / (t if sp else 1))  # no dropout masks
    return whole / lay.cp


def activations(spec: ModelSpec, run: Run, recipe: Recipe, recompute: str) -> list[float]:
    """Peak activation bytes of each pipeline rank: per stage, times the micro-batches its
    schedule keeps in flight (:func:`edu3d.plan.estimate.in_flight`)."""
    lay, par = run.layout, run.parallel
    v = chunks(par.schedule, lay.vpp)
    parts = planner_cut(spec.n_layers, lay, par)
    layer = layer_activations(spec, run, recompute)
    t, sp = lay.tp, par.sp and lay.tp > 1
    tokens = run.micro_batch * spec.seq_len / lay.cp
    logits = loss_bytes(run, recipe, tokens * spec.vocab_rows(t))[0]
    last = 2 * tokens * spec.d_model / (t if sp else 1) + logits
    stage = [(hi - lo) * layer + (last if i == len(parts) - 1 else 0)
             for i, (lo, hi) in enumerate(parts)]
    flight = edu3d_estimate.in_flight(par.schedule, lay.pp, run.microbatches, lay.vpp)
    style = placement(par.schedule)
    return [sum(stage[s] for s in stages_of(r, lay.pp, lay.pp * v, style)) * flight[r]
            for r in range(lay.pp)]


def state(spec: ModelSpec, run: Run, recipe: Recipe, pp_rank: int) -> dict[str, float]:
    """Weights, gradients and optimizer state on one rank of ``pp_rank``: dense parameters
    sharded over ``dp·cp``, routed experts over ``dp·cp/ep`` (no padding: real models). ZeRO-3
    that reduces once per step (per-step mode, or under a pipeline, as torchtitan does) also
    holds the stage's gathered 16-bit weights and their 16-bit gradients for the step."""
    lay, par = run.layout, run.parallel
    zero = par.zero
    holds = zero >= 3 and (lay.pp > 1 or par.grad_reduce == "per-step")
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for experts, n in ((False, lay.dp * lay.cp), (True, lay.edp)):
        psi = held(spec, run, pp_rank, experts)
        n = n if zero else 1
        out["params"] += recipe.weight * psi / (n if zero >= 3 else 1) + 2 * psi * holds
        grad_n = 1 if recipe.grad_unsharded else n if zero >= 2 else 1
        out["grads"] += recipe.grad * psi / grad_n + 2 * psi * holds
        out["optimizer"] += (recipe.master + recipe.moments) * psi / n
    return out


def loss_bytes(run: Run, recipe: Recipe, logits: float) -> tuple[float, float]:
    """``(saved, at the backward)`` bytes of the loss over ``logits`` values: eager, the fp32
    log-softmax saved and two more fp32 tensors in its backward; compiled, the 16-bit logits
    saved and one 16-bit gradient; fused (chunked), nothing the size of the logits."""
    if recipe.fused_loss:
        return 0.0, 0.0
    if recipe.compiled_loss and run.precision.compile:
        return 2 * logits, 2 * logits
    return 4 * logits, 2 * 4 * logits


def root_held(spec: ModelSpec, run: Run, recipe: Recipe, pp_rank: int) -> float:
    """FSDP2's root unit at the backward's peak (one pipeline stage, ZeRO-3 with the
    weights resharded after forward): the embedding's and head's 16-bit weights, gathered,
    and the head's 16-bit gradient, both held until the embedding's backward ends."""
    lay = run.layout
    if not recipe.root_unit or run.parallel.zero < 3 or lay.pp > 1:
        return 0.0
    rows = spec.vocab_rows(lay.tp) * spec.d_model
    return 2 * rows * (1 if spec.tied else 2) + 2 * rows


def transient(spec: ModelSpec, run: Run, recipe: Recipe, last: bool) -> float:
    """What lives for a moment at the backward's peak: on the last stage the loss's backward
    (the log-softmax output it saved, counted in the activations, meets its gradient and the
    logits' gradient, two more fp32 ``T·V/tp`` tensors, unless the loss is fused); under full
    or op-level recomputation, one layer's recomputed activations while its backward runs."""
    tokens = run.micro_batch * spec.seq_len / run.layout.cp
    loss = loss_bytes(run, recipe, tokens * spec.vocab_rows(run.layout.tp))[1] if last else 0.0
    layer = 0.0
    if run.memory.recompute in ("full", "op"):
        layer = layer_activations(spec, run, "selective")
    return max(loss, layer)


def memory(spec: ModelSpec, run: Run, recipe: str | Recipe, profile: Profile | None = None
           ) -> dict:
    """The fullest rank's bytes by category (``params grads optimizer activations comm``),
    ``allocated`` (their sum), ``reserved`` (times the profile's allocator factor) and
    ``device`` (plus its runtime memory: what must fit). ``edu3d``: the exact estimate."""
    rec = recipe_of(recipe) if isinstance(recipe, str) else recipe
    if rec.name == "edu3d":
        est = edu3d_estimate.estimate(spec, run)
        out = {c: est[f"{c}_bytes"] for c in edu3d_estimate.CATEGORIES}
        out["allocated"] = est["total_bytes"]
    else:
        out = framework_memory(spec, run, rec)
    factor = profile.allocator_factor if profile else 1.0
    out["reserved"] = out["allocated"] * factor
    out["device"] = out["reserved"] + (profile.runtime_memory if profile else 0.0)
    return out


def framework_memory(spec: ModelSpec, run: Run, rec: Recipe) -> dict:
    """A framework recipe's fullest pipeline rank (state + activations + buffers)."""
    lay, par = run.layout, run.parallel
    recompute = run.memory.recompute
    acts = activations(as_moe(spec), run, rec, recompute)
    rows = []
    for r in range(lay.pp):
        row = state(spec, run, rec, r)
        row["activations"] = acts[r]
        biggest = max((sum(k for _, k, _ in as_moe(spec).block_tensors(i, lay.tp))
                       for i in range(spec.n_layers)), default=0)
        # ZeRO-3: this unit's and the next one's 16-bit weights, and its fp32 gradients
        # before the reduce-scatter; pipeline buffers: two activations per direction
        row["comm"] = (biggest * (2 * 2 + rec.reduce) if par.zero >= 3 else 0.0) + (
            4 * 2 * run.micro_batch * spec.seq_len * spec.d_model / lay.cp if lay.pp > 1 else 0)
        row["transient"] = transient(spec, run, rec, r == lay.pp - 1)
        row["comm"] += root_held(spec, run, rec, r)
        rows.append(row)
    top = max(rows, key=lambda x: sum(x.values()))
    top["allocated"] = sum(top.values())
    return top
