"""The per-rank memory of a 3D layout, by category and pipeline stage: the planner's estimator.

After reading this file you should understand where every byte of a rank goes, stage by
stage, and how the classic answer to "how do I train this model on G GPUs" follows from it:

* **the model's state**: each rank holds the parameters of its pipeline stage(s), cut by
  tensor parallelism (matrices split, LayerNorms and row biases whole), and for each of them
  a gradient and the optimizer's state. Mixed precision (bf16/fp16) keeps 2 + 2 + 12 bytes
  per parameter (16-bit weights and gradients; fp32 master weights and Adam's two moments,
  the ZeRO paper's K = 12); fp32 training 4 + 4 + 8. ZeRO shards the optimizer state
  (stage 1), then the gradients (2), then the weights (3) over the dp ranks, each unit's
  flat buffer padded to a multiple of dp (:mod:`edu3d.parallel.zero.flat_unit`);
* **the activations**: bytes per layer and micro-batch from :mod:`edu3d.plan.formulas`
  (Korthikanti et al. 2022 for real models in 16-bit; the exact fp32 count for this course's
  GPT), times the layers of the stage, plus the first stage's token ids and the last
  stage's LayerNorm, head input and fp32 logits; times the micro-batches the schedule keeps
  alive at once, found by replaying the schedule (:func:`edu3d.schedules.simulate.simulate`):
  1F1B keeps up to ``p`` on the first stage, GPipe all ``m``, interleaved a little more than
  1F1B;
* **at rest and at the peak**: after the optimizer step ZeRO-2/3 hold gradient (and ZeRO-3
  weight) shards only; during the step ``grad_reduce="per-step"`` keeps a stage's full
  gradients (and ZeRO-3 its gathered weights) while its micro-batches run, and
  ``"per-microbatch"`` (the default) only the shards (:mod:`edu3d.plan.zero_modes`). The
  peak is what must fit; the rest is what ``edu3d train`` measures after a step;
* **FP8** (``--precision fp8``): this course's GPT keeps fp32 weights, gradients and
  activations (its blocks' products cast their operands on the fly) plus each FP8 layer's
  scales (:func:`~edu3d.plan.formulas.fp8_scale_bytes`); a real model is counted as bf16
  (torchtitan's FP8 runs inside a bf16 model). ZeRO-3 gathers the FP8 weights in 1 byte
  (:func:`zero3_gather_bytes`) and its matrix products run at the profile's FP8 rate
  (:func:`edu3d.plan.hardware.matmul_rate`);
* **communication buffers**: pipeline receive buffers (edu3d posts all of a step's receives
  at its start) and ZeRO's unit in flight (:func:`~edu3d.plan.zero_modes.in_flight_bytes`);
* **frozen parameters** (``run.memory.freeze``, ``--freeze``'s globs over the serial names): their
  weights stay, whole on every rank (no ZeRO stage shards them), with no gradient and no
  optimizer state; ZeRO's units hold the trainable ones only (:mod:`edu3d.plan.inventory`,
  which lists every rank's tensors by name);
* **experts and context** (``world = dp·cp·tp·pp``; EP folds inside the ``dp·cp`` ranks):
  a MoE block's routed experts are cut ``ep`` ways, whole on every tp rank, replicated over
  the expert-data-parallel group of ``dp·cp/ep`` ranks, over which ZeRO shards them (the
  dense state over ``dp·cp``). CP gives each rank ``s/cp`` tokens of every sequence, so
  every activation is divided by ``cp`` (its queries still see all ``s`` keys: the
  ``5as²b`` term divides once).

The layout search, its cost model and the bytes each rank sends by axis (``traffic``) live
in :mod:`edu3d.plan.search`, the command line (``edu3d plan``) in :mod:`edu3d.commands.plan`.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache, partial

from edu3d.config.sections import Batch, Memory, Precision, Run, Training
from edu3d.plan import formulas as memory
from edu3d.plan import zero_modes
from edu3d.plan.host_pool import brought_back, split
from edu3d.plan.formulas import MoESpec, as_moe, divisors
from edu3d.plan.inventory import (check_freeze, frozen_held, held, named_units,  # noqa: F401
                                  shape_of, units)
from edu3d.schedules.partition import planner_cut
from edu3d.schedules.actions import build, chunks, placement, stage_rank
from edu3d.schedules.simulate import simulate
from edu3d.model.param_globs import frozen
from edu3d.model.shapes import ModelSpec, spec_from

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm", "transient")
CP_IMPLS = ("ring", "allgather", "ulysses")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
RECOMPUTE = ("none", "selective", "full")
MAX_GPUS, MAX_LAYERS, MAX_EXPERTS = 2**20, 1024, 4096  # what the estimator takes (so that
MAX_REPLAY = 8192  # it answers in a second): interleaved replays of pp=32 x vpp=2 at most


# ---- the run the planner weighs --------------------------------------------------------------
def setup(micro_batch: int = 1, microbatches: int = 1, **flags) -> Run:
    """A run as the planner's callers describe one: ``micro_batch`` sequences in each of
    ``microbatches`` micro-batches per data-parallel rank (so the global batch is
    ``dp·m·b``), and any other ``edu3d train`` flag: ``setup(dp=8, zero=1, precision="bf16")``."""
    gb = flags.get("dp", 1) * microbatches * micro_batch
    return Run.of(global_batch=gb, microbatches=microbatches, **flags)


SETUP_KEYS = ("dp", "tp", "pp", "vpp", "zero", "microbatches", "micro_batch", "schedule", "sp",
              "recompute", "precision", "optimizer", "ep", "cp", "cp_impl", "grad_reduce",
              "freeze", "hsdp")  # what the planner weighs of a run: edu3d plan's JSON "setup"


def setup_dict(run: Run) -> dict:
    """The part of ``run`` the planner weighs, by flag name (``edu3d plan --json``'s
    ``setup``; :func:`setup` takes it back)."""
    flat = run.flat()
    return {k: (run.microbatches if k == "microbatches" else run.micro_batch
                if k == "micro_batch" else list(flat[k]) if k == "freeze" else flat[k])
            for k in SETUP_KEYS}


def validate(spec: ModelSpec, run: Run) -> None:
    """Raise ``ValueError`` saying what to change when ``run`` cannot run ``spec``."""
    lay, par = run.layout, run.parallel
    if not 1 <= spec.n_layers <= MAX_LAYERS or as_moe(spec).experts > MAX_EXPERTS:
        raise ValueError(f"{spec.n_layers} layers, {as_moe(spec).experts} experts: the planner "
                         f"takes 1 to {MAX_LAYERS} layers, 0 to {MAX_EXPERTS} experts")
    replay = 2 * min(run.microbatches, 2 * lay.pp) * lay.pp * lay.vpp
    if run.world_size > MAX_GPUS or par.schedule == "interleaved" and replay > MAX_REPLAY:
        raise ValueError(f"{run.world_size} GPUs, interleaved replay of {replay} actions: the "
                         f"planner takes 1 to {MAX_GPUS} GPUs, {MAX_REPLAY} actions (pp=32 x vpp=2)")
    if spec.n_heads % lay.tp or spec.kv_heads % lay.tp and lay.tp % spec.kv_heads:
        raise ValueError(f"tp={lay.tp} must divide n_heads={spec.n_heads} (and KV heads "
                         f"{spec.kv_heads} split or replicate evenly)")
    planner_cut(spec.n_layers, lay, par)  # an unknown partition, or more stages than layers
    if par.zero and lay.dp * lay.cp == 1:
        raise ValueError(f"ZeRO-{par.zero} shards over dp*cp; use dp*cp >= 2")
    check_ep(spec, lay.dp * lay.cp, lay.ep)
    lay.hsdp_sizes(par.hsdp, par.zero)  # HSDP: ZeRO on, R divides dp (and edp), or refused
    if spec.seq_len % lay.cp:
        raise ValueError(f"cp={lay.cp} must divide seq={spec.seq_len}")
    if par.cp_impl == "ulysses" and spec.n_heads % (lay.cp * lay.tp):
        raise ValueError(f"ulysses: cp*tp = {lay.cp * lay.tp} must divide n_heads={spec.n_heads}"
                         "; use --cp-impl ring or a smaller --cp")
    if par.sp and spec.seq_len % lay.tp:
        raise ValueError(f"sequence parallelism: tp={lay.tp} must divide seq={spec.seq_len}")
    if lay.vpp > 1 and par.schedule != "interleaved":
        raise ValueError(f"vpp={lay.vpp} needs the interleaved schedule")
    if par.schedule == "interleaved" and lay.pp > 1 and run.microbatches % lay.pp:
        raise ValueError(f"interleaved: microbatches={run.microbatches} must be a multiple "
                         f"of pp={lay.pp}")
    for name, value, ok in (("precision", run.precision.dtype, PRECISIONS),
                            ("recompute", run.memory.recompute, RECOMPUTE),
                            ("cp_impl", par.cp_impl, CP_IMPLS),
                            ("grad_reduce", par.grad_reduce, zero_modes.GRAD_REDUCE),
                            ("zero", par.zero, (0, 1, 2, 3))):
        if value not in ok:
            raise ValueError(f"{name}={value!r}: choose one of {', '.join(map(str, ok))}")
    check_freeze(spec, run.memory.freeze)


def check_ep(spec: ModelSpec, dpc: int, ep: int) -> None:
    """``ep`` must divide the experts and the ``dp·cp`` ranks it folds into (checked before a
    :class:`~edu3d.config.layout.Layout` is built, whose own error cannot name the experts)."""
    experts = as_moe(spec).experts
    if ep > 1 and (not experts or experts % ep or dpc % ep):
        raise ValueError(f"ep={ep} must divide experts={experts} and dp*cp={dpc}; choose ep "
                         f"in {[e for e in divisors(dpc) if experts % e == 0] if experts else [1]}")


def state_bytes(precision: str, optimizer: str = "adamw",
                autocast: bool = False) -> tuple[int, int, int]:
    """Bytes per parameter of (weights, gradients, optimizer state). ``autocast``: edu3d's
    own recipe (``torch.autocast`` over fp32 weights, gradients and moments: 4 + 4 + 8)."""
    moments = 8 if optimizer == "adamw" else 0
    if precision == "fp32" or autocast:
        return 4, 4, moments
    return 2, 2, 4 + moments  # fp32 master copy + moments: the ZeRO paper's K = 12


def _autocast(spec: ModelSpec, run: Run) -> bool:  # a course model in 16 bits: edu3d's recipe
    return spec.course and run.precision.dtype != "fp32"


def _fp32_numbers(spec: ModelSpec, run: Run) -> bool:
    """Whether what the step keeps is fp32: fp32 training, or FP8 on this course's GPT (only
    its blocks' products are FP8; real models run FP8 inside bf16, torchtitan's recipe)."""
    return run.precision.dtype == "fp32" or spec.course and run.precision.dtype == "fp8"


# ---- parameters per rank: units, held, frozen_held (edu3d.plan.inventory) ----------------------
def state_per_rank(spec: ModelSpec, run: Run, pp_rank: int, dp_index: int = 0,
                   at: str = "peak") -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state on one rank (``at="rest"``: after the
    optimizer step, what ``Trainer.stats`` measures; ``"peak"``: during the step): the dense
    units sharded over ``dp·cp`` ranks, routed experts' over ``dp·cp/ep`` (``--hsdp R``: /R)."""
    return dict(_state_of(spec, _state_setup(run), pp_rank, dp_index, at))


def _state_setup(run: Run) -> Run:  # all the model's state depends on
    m = 1 + (run.microbatches > 1)
    return Run(layout=run.layout, parallel=dataclasses.replace(run.parallel, sp=False),
               batch=Batch(global_batch=run.layout.dp * m, microbatches=m),
               precision=Precision(dtype=run.precision.dtype),
               memory=Memory(freeze=run.memory.freeze),
               training=Training(optimizer=run.training.optimizer))


@lru_cache(maxsize=4096)
def _state_of(spec: ModelSpec, run: Run, pp_rank: int, dp_index: int, at: str) -> dict:
    par, (n, en) = run.parallel, run.layout.hsdp_sizes(run.parallel.hsdp)
    zero = (par.zero, zero_modes.holds_step(par.zero, par.grad_reduce, run.microbatches), at,
            *state_bytes(run.precision.dtype, run.training.optimizer, _autocast(spec, run)))
    dense = memory.zero_unit_bytes(units(spec, run, pp_rank), n, dp_index % n, *zero)
    # frozen weights: whole on every rank, in no unit; no gradient, no optimizer state
    dense["params"] += zero[3] * (frozen_held(spec, run, pp_rank) +
                                  frozen_held(spec, run, pp_rank, experts=True))
    ex = units(spec, run, pp_rank, experts=True)
    if not ex:
        return dense
    expert = memory.zero_unit_bytes(ex, en, dp_index % en, *zero)
    return {c: dense[c] + expert[c] for c in dense}


# ---- activations per rank ------------------------------------------------------------------------
@lru_cache(maxsize=4096)
def stage_activation_bytes(spec: ModelSpec, run: Run, where: str = "device") -> list[float]:
    """Bytes one micro-batch keeps for backward on each global stage (``/cp``), on the device
    or as :func:`edu3d.plan.host_pool.split` says (``"host"``); cached: read, never change."""
    lay, par = run.layout, run.parallel
    s, b, h, a, t = spec.seq_len, run.micro_batch, spec.d_model, spec.n_heads, lay.tp
    spec = as_moe(spec)
    rec = None if run.memory.recompute == "none" else run.memory.recompute
    parts = planner_cut(spec.n_layers, lay, par)
    sp = par.sp and t > 1
    if spec.course and _fp32_numbers(spec, run):
        layer = memory.layer_activation_bytes(s, b, h, a, t, sp, run.memory.recompute)
        if run.precision.dtype == "fp8" and run.memory.recompute != "full":
            layer += memory.fp8_scale_bytes(s, b, h, t, run.precision.fp8_scaling)
        ids = 8 * run.batch.global_batch * s  # a view into the global batch keeps its whole storage
        if t > 1:  # the vocabulary-parallel embedding keeps its local ids and mask
            first = 9 * s * b + 8 * s
            last = (4 * s * b * h + 8 * s * b) / (t if sp else 1) + 4 * s * b * h / (
                t if sp else 1) + 4 * s * b * spec.vocab_rows(t) + 10 * s * b
        else:
            first = ids + 8 * s
            last = 4 * s * b * h + 8 * s * b + 4 * s * b * h + 4 * s * b * spec.vocab_size + ids
    elif _autocast(spec, run) and t == 1:
        layer = memory.autocast_activation_bytes_per_layer(s, b, h, a, rec)
        ids = 8 * run.batch.global_batch * s
        first = ids + 8 * s
        # fp32 final LayerNorm input, the head's 16-bit input and weight copies, its 16-bit
        # logits and the fp32 log-softmax the loss keeps (on CUDA; the CPU keeps no 16-bit
        # logits, 2sbV bytes less)
        last = (4 * s * b * h + 8 * s * b + 2 * s * b * h + 2 * spec.vocab_size * h
                + 6 * s * b * spec.vocab_size + ids)
    else:
        layer = memory.activation_bytes_per_layer(
            s, b, h, a, t, sp, rec, d_ff=spec.ff, kv_heads=spec.kv_heads, mlp=spec.mlp)
        first = 0.0
        # final norm and head inputs (16-bit), fp32 logits for the loss (Korthikanti 4.3)
        last = 4 * s * b * h / (t if sp else 1) + 4 * s * b * spec.vocab_rows(t)
    moe = layer  # a MoE block: the dense MLP half's count out, the MoE half's in
    if spec.moe_layers and run.memory.recompute != "full":
        exact = spec.course and _fp32_numbers(spec, run)
        vb, drop = (4, False) if exact else (2, not spec.course)
        moe = layer - memory.mlp_activation_bytes(s, b, h, spec.ff, 1 if sp else t, spec.mlp, vb,
                                                  drop) / (t if sp else 1)
        moe += memory.moe_mlp_activation_bytes(spec, s, b, vb, drop)
    kept = (4 if run.precision.dtype == "fp32" or _autocast(spec, run) else 2) * s * b * h / (
        t if sp else 1)  # the stage's input (edu3d.plan.host_pool)
    return list(p[where] for p in split(run, parts, [moe if spec.is_moe(j) else layer for j in
                                                      range(spec.n_layers)], kept, first, last))


@lru_cache(maxsize=512)
def in_flight(schedule: str, pp: int, m: int, vpp: int = 1) -> tuple[int, ...]:
    """The most micro-batches each pipeline rank keeps alive: what a replay gives (tests check),
    in closed form where there is one, as a replay costs ``p²``: GPipe ``m``, 1F1B ``min(m,
    p-r)`` on rank ``r``, ZB-H1 ``min(m, p)`` (deferred weight gradients keep their inputs)."""
    if schedule in ("gpipe", "1f1b") or schedule == "zb-h1" and not m % max(1, m // pp):
        return tuple(min(m, {"gpipe": m, "1f1b": pp - r}.get(schedule, pp)) for r in range(pp))
    replay = m if schedule == "zb-h1" else min(m, 2 * pp)  # zb-h1: its build names the error
    return tuple(simulate(build(schedule, pp, replay, chunks(schedule, vpp)), pp).peak_in_flight)


def activations_per_rank(spec: ModelSpec, run: Run, where: str = "device") -> list[float]:
    """Peak activation bytes of each pipeline rank over the step's schedule (or ``"host"``)."""
    lay, par = run.layout, run.parallel
    per_stage = stage_activation_bytes(spec, run, where)
    v = chunks(par.schedule, lay.vpp)
    if v == 1:
        return [n * a for n, a in zip(in_flight(par.schedule, lay.pp, run.microbatches), per_stage)]
    actions = build(par.schedule, lay.pp, min(run.microbatches, 2 * lay.pp), v)  # interleaved
    return list(simulate(actions, lay.pp, activation_bytes=per_stage).peak_activation_bytes)


def comm_per_rank(spec: ModelSpec, run: Run, pp_rank: int) -> float:
    """Pipeline receive buffers and ZeRO's unit in flight (:mod:`edu3d.plan.zero_modes`).

    edu3d posts all of a step's receives at its start (one buffer per micro-batch, chunk and
    direction: see :class:`~edu3d.parallel.pp.engine.PipelineEngine`); Megatron keeps about
    two per direction, which is what the planner assumes for real models. CP adds its K/V
    buffers (ring: the chunk in flight and the next, ``2·2(s/cp)b·kv_h/t``; all-gather: the
    gathered ``2sb·kv_h/t``), EP a dispatch and a combine buffer of ``k·(s/cp)·b·h``."""
    lay, par = run.layout, run.parallel
    act = 4 if run.precision.dtype == "fp32" or _autocast(spec, run) else 2  # the residual stream
    tokens = run.micro_batch * spec.seq_len / lay.cp
    msg = act * tokens * spec.d_model / (lay.tp if par.sp else 1)
    directions = (pp_rank > 0) + (pp_rank < lay.pp - 1) if lay.pp > 1 else 0
    v = chunks(par.schedule, lay.vpp)
    buffers = run.microbatches * v if spec.course else 2
    out = directions * buffers * msg
    kv = 2 * tokens * spec.d_model * spec.kv_heads / spec.n_heads / lay.tp * act
    out += {"ring": 2 * kv, "allgather": lay.cp * kv}.get(par.cp_impl, 0) if lay.cp > 1 else 0
    if lay.ep > 1:
        out += 2 * memory.routed_per_token(as_moe(spec)) * tokens * spec.d_model * act
    pb, gb, _ = state_bytes(run.precision.dtype, run.training.optimizer, _autocast(spec, run))
    return out + zero_modes.in_flight_bytes(_biggest_unit(spec, shape_of(run), pp_rank),
                                            par.zero, par.grad_reduce, run.microbatches, pb, gb)


@lru_cache(maxsize=4096)
def _biggest_unit(spec: ModelSpec, run, pp_rank: int) -> int:
    return max((sum(k for k, _ in u) for _, u in units(spec, run, pp_rank) +
                units(spec, run, pp_rank, experts=True)), default=0)


def transient_per_rank(spec: ModelSpec, run: Run, pp_rank: int) -> float:
    """The loss's backward on the last pipeline rank holds the logits' gradient for a moment
    (``4sbV/t`` bytes in fp32, ``2sbV/t`` in 16-bit): on an H100, GPT-2-small in bf16, the
    allocator's peak rose exactly ``2sbV`` above what was held then (``edu3d.bench.bench_gpu``)."""
    lay = run.layout
    last = stage_rank(2 * lay.pp - 1, lay.pp, placement(run.parallel.schedule))  # V: rank 0
    logit = (4 if _fp32_numbers(spec, run) else 2) * (pp_rank == last)
    held = float(logit * spec.seq_len * run.micro_batch * spec.vocab_rows(lay.tp)) / lay.cp
    return held if not run.memory.offload_activations else max(  # else nothing comes back
        held, brought_back(partial(stage_activation_bytes, spec, run), run, pp_rank))


def activation_model(spec: ModelSpec, run: Run) -> str:
    """Which count the estimate's activations use."""
    if spec.course and _fp32_numbers(spec, run):
        return f"edu3d's GPT in {run.precision.dtype} (exact)"
    return ("edu3d's GPT under autocast (fp32 weights, 16-bit matmuls)" if _autocast(spec, run)
            and run.layout.tp == 1 else "Korthikanti et al. 2022, 16-bit")


# ---- the estimate --------------------------------------------------------------------------------
@lru_cache(maxsize=1024)
def _fullest_states(spec: ModelSpec, run: Run, at: str) -> tuple[dict, ...]:
    """Each pipeline rank's state on its fullest dp rank (ZeRO's shards differ by a few optimizer
    pieces): rank 0 or one in :func:`~edu3d.plan.formulas.shard_starts` (experts': per ``edp``)."""
    lay = run.layout
    (n, edp), out = lay.hsdp_sizes(run.parallel.hsdp), []
    for r in range(lay.pp):
        weigh = {0}  # for real models, rank 0 stands for all
        if run.parallel.zero and spec.course:
            weigh |= memory.shard_starts(units(spec, run, r), n) | {
                i + k * edp for i in memory.shard_starts(units(spec, run, r, True), edp)
                for k in range(n // edp)}
        out.append(max((dict(_state_of(spec, run, r, i, at)) for i in sorted(weigh) if i < n),
                       key=lambda d: sum(d.values())))
    return tuple(out)


def estimate(spec: ModelSpec, run: Run, at: str = "peak") -> dict:
    """Bytes per rank by category for every pipeline rank (``per_stage``), and the most loaded
    one's at the top level (``params_bytes`` ... ``total_bytes``; ``state_bytes``: weights,
    gradients and optimizer state, the ZeRO paper's count)."""
    validate(spec, run)
    acts, host = activations_per_rank(spec, run), activations_per_rank(spec, run, "host")
    per_stage, states = [], _fullest_states(spec, _state_setup(run), at)
    for r in range(run.layout.pp):
        row = {"pp_rank": r, **states[r], "activations": acts[r], "host": host[r],
               "comm": comm_per_rank(spec, run, r) if at == "peak" else 0.0,
               "transient": transient_per_rank(spec, run, r) if at == "peak" else 0.0}
        row["total"] = sum(row[c] for c in CATEGORIES)
        per_stage.append(row)
    top = max(per_stage, key=lambda row: row["total"])
    out = {f"{c}_bytes": top[c] for c in CATEGORIES}
    out.update(total_bytes=top["total"], state_bytes=sum(top[c] for c in CATEGORIES[:3]),
               fullest_pp_rank=top["pp_rank"], per_stage=per_stage, host_bytes=top["host"],
               num_params=spec.num_params(), activation_model=activation_model(spec, run),
               active_params=as_moe(spec).active_params())
    return out


FP8_WEIGHTS = (".attn.qkv.weight", ".attn.proj.weight", ".mlp.fc.weight", ".mlp.proj.weight")


def zero3_gather_bytes(spec: ModelSpec, run: Run, pp_rank: int = 0) -> int:
    """Bytes one all-gather of all of pipeline rank ``pp_rank``'s ZeRO-3 units fills, as the
    trace records it (:func:`edu3d.plan.zero_modes.gather_bytes`; forward and backward each
    gather once per micro-batch, or once per step with ``grad_reduce="per-step"``): fp32
    weights on this course's GPT (2 bytes on a real model), and under ``--precision fp8``
    with tensorwise scaling the blocks' linear weights in 1 byte (each block's in a unit of
    their own, :mod:`edu3d.parallel.fp8.fp8_gather`)."""
    lay, pb = run.layout, state_bytes(run.precision.dtype, run.training.optimizer,
                                      _autocast(spec, run))[0]
    fp8 = run.precision.dtype == "fp8" and run.precision.fp8_scaling == "tensorwise"
    us = [(u, [(k, n.endswith(FP8_WEIGHTS) and ".experts." not in n) for n, k, _ in ts
               if not frozen(n, run.memory.freeze)])
          for u, ts in named_units(spec, run, pp_rank)]
    return zero_modes.gather_bytes([u for u in us if u[1]], lay.dp * lay.cp, pb, fp8)


def estimate_for(run: Run, at: str = "peak") -> dict:
    """The estimate of an ``edu3d train`` run (checked by :func:`edu3d.train.preflight.preflight`):
    what a measured run of the same layout is checked against."""
    return estimate(spec_of(run), run, at=at)


def spec_of(run: Run) -> ModelSpec:
    """The shape of ``run``'s model (``run.model``: a preset of the course's GPT with its
    overrides and mixture of experts), as the planner counts it."""
    m = run.model
    spec = spec_from(m.preset, n_layers=m.layers, n_heads=m.heads, d_model=m.d_model,
                     seq_len=m.seq, vocab_size=m.vocab, tied=m.tie)
    if m.experts:
        spec = MoESpec(**dataclasses.asdict(spec), experts=m.experts, topk=m.topk,
                       moe_every=m.moe_every, shared_experts=m.shared_experts,
                       capacity_factor=m.capacity_factor)
    return spec
