"""The model against published measurements: every row of ``published_runs.json``, predicted.

After reading this file you should know how far to trust a prediction, and why "MFU" must be
compared in the source's own convention:

* each published run (:mod:`edu3d.plan.published`) becomes a model shape and a
  :class:`~edu3d.config.sections.Run`; where the source left a detail out, a stated rule fills
  it (:data:`RULES`) and the row says so, never a per-row constant;
* the prediction is compared on what the source measured: tokens/s per GPU where it printed
  them, else its iteration time, else its TFLOP/s per GPU **counted its way** (Megatron's
  ``72·B·s·l·h²·(1 + s/6h + V/12lh)`` model FLOPs, Narayanan et al.'s and BLOOM's hardware
  FLOPs that include the recomputed forward), else its MFU. Converting the model's time
  into the source's count is exact; converting the source's MFU into tokens/s would need
  its FLOP count, which is the thing the sources disagree on;
* the error is ``predicted / measured - 1`` on throughput (positive: the model is too
  optimistic); memory is compared with what the source read (``max reserved``: the
  allocator's reservation, ``max allocated``: the tensors) where it published one;
* the summary gives, per framework and overall, the median and the worst absolute error.
  Every row counts: a row the model gets wrong stays in the table with its error.

``edu3d plan --validate`` prints this table; ``tests/test_validation.py`` holds its errors.
No torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from edu3d.config.sections import Run
from edu3d.model.shapes import ModelSpec
from edu3d.plan.formulas import MoESpec
from edu3d.plan.hardware import Profile, load_profile
from edu3d.plan.published import RUNS_FILE, PublishedRun, load_runs
from edu3d.plan.step import Prediction, predict

GIB = 2**30
PRE_FLASH = ("Korthikanti", "Narayanan", "BigScience")  # sources before FlashAttention
TP_OVERLAP = ("NVIDIA Megatron-LM README",)  # ran with --tp-comm-overlap (AsyncTP rows: by id)
RULES = {
    "micro_batch": "micro-batch not published: 1 sequence",
    "vpp": "interleaved schedule without its chunk count: 2 chunks per rank",
    "zero": "ZeRO stage not published: 1 (sharded optimizer state)",
    "sp": "sequence parallelism not published: on with tensor parallelism",
    "recompute": "recomputation not published: none",
    "recipe": "memory recipe not published: megatron's",
    "schedule": "pipeline schedule not published: 1f1b (all-forward-all-backward would hold "
                "every micro-batch's activations, more than the memory the source measured)",
    "attn": "published before FlashAttention reached its framework: explicit attention scores",
}

# rows the model misses by more than 30 %, each with what it leaves out (they stay counted).
# None today: Llama 3's long-context run (-30.5 % under the 2-chunk rule) left it when its
# pipeline cut was read from the paper's text (one layer per model chunk, 8 chunks per rank).
KNOWN_MISSES: dict[str, str] = {}


@dataclass
class Row:
    """One run, predicted beside measured (``metric`` in the source's unit)."""

    id: str
    framework: str
    hardware: str
    metric: str
    measured: float
    predicted: float
    error: float
    memory_measured: float | None
    memory_predicted: float | None
    memory_error: float | None
    assumed: list[str]
    prediction: Prediction


def spec_of(run: PublishedRun) -> ModelSpec:
    """The row's model: Llama-shaped (RMSNorm, RoPE, no biases) or GPT-shaped."""
    m = run.model
    gpt = m.norm == "layernorm"
    kw = dict(d_ff=m.d_ff, n_kv_heads=m.n_kv_heads, mlp=m.mlp, norm=m.norm, bias=gpt,
              tied=m.tied, learned_pos=gpt, global_batch=run.global_batch)
    args = (m.name, m.n_layers, m.d_model, m.n_heads, run.seq_len, m.vocab_size)
    if m.experts:
        return MoESpec(*args, **kw, experts=m.experts, topk=m.topk)
    return ModelSpec(*args, **kw)


def run_of(row: PublishedRun) -> tuple[Run, str, list[str]]:
    """The row as an edu3d run, its recipe, and the rules that filled what it left out."""
    lay, assumed = row.layout, []

    def given(value, key, default):
        if value is None:
            assumed.append(key)
            return default
        return value

    b = given(row.micro_batch, "micro_batch", 1)
    schedule = given(lay.schedule, "schedule", "1f1b") if lay.pp > 1 else "1f1b"
    schedule = {"afab": "gpipe", "zbv": "zb-h1"}.get(schedule, schedule)
    vpp = given(lay.vpp, "vpp", 2) if schedule == "interleaved" else 1
    flags = dict(dp=lay.dp, tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep, vpp=vpp,
                 zero=given(lay.zero, "zero", 1) if lay.dp * lay.cp > 1 else 0,
                 sp=given(lay.sp, "sp", lay.tp > 1) and lay.tp > 1, schedule=schedule,
                 global_batch=row.global_batch, partition=lay.partition,
                 microbatches=row.global_batch // (lay.dp * b), precision=row.precision,
                 recompute=given(row.recompute, "recompute", "none"), compile=row.compile,
                 tp_overlap="asynctp" in row.id or row.source.startswith(TP_OVERLAP))
    if row.source.startswith(PRE_FLASH):
        flags["attn"] = "explicit"
        assumed.append("attn")
    recipe = given(row.recipe, "recipe", "megatron")
    if flags["zero"] == 0 and recipe.startswith("torchtitan"):
        flags["zero"] = 3
    return Run.of(**flags), recipe, assumed


def source_flops(row: PublishedRun, spec: ModelSpec, pred: Prediction) -> float:
    """FLOP/s per GPU of the predicted step, counted the source's way."""
    B, s, l, h, V = row.global_batch, row.seq_len, spec.n_layers, spec.d_model, spec.vocab_size
    if row.source.startswith(("Narayanan",)):
        per_step = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    elif row.source.startswith("BigScience"):
        per_step = 8 * spec.num_params() * s * B
    elif row.framework == "megatron-lm":
        per_step = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * h * l))
    else:
        per_step = pred.model_flops_per_token * B * s
    return per_step / pred.step_time / row.gpus


def compare(row: PublishedRun, profile: Profile | None = None) -> Row:
    """One row predicted (on ``profile``, default the row's own) beside what it measured."""
    spec = spec_of(row)
    run, recipe, assumed = run_of(row)
    prof = profile or load_profile(row.hardware)
    pred = predict(spec, run, prof, recipe)
    got = row.measured
    if got.tokens_per_s_per_gpu is not None:
        metric, measured, value = "tokens/s/GPU", got.tokens_per_s_per_gpu, pred.tokens_per_s_per_gpu
    elif got.step_time_s is not None:
        metric, measured, value = "step s", got.step_time_s, pred.step_time
    elif got.tflops_per_gpu is not None:
        metric, measured, value = "TFLOP/s/GPU", got.tflops_per_gpu, source_flops(row, spec, pred) / 1e12
    else:
        metric, measured, value = "MFU", got.mfu, pred.mfu
    error = measured / value - 1 if metric == "step s" else value / measured - 1
    mem, mem_pred, mem_err = got.memory_gib, None, None
    if mem is not None:
        kind = "allocated" if got.memory_kind == "max allocated" else "reserved"
        mem_pred = pred.memory[kind] / GIB
        mem_err = mem_pred / mem - 1
    return Row(row.id, row.framework, row.hardware, metric, measured, value, error, mem,
               mem_pred, mem_err, assumed, pred)


def validate(hardware: str | None = None, runs_file=RUNS_FILE) -> list[Row]:
    """Every published row of ``runs_file`` (``hardware``: only those measured on that
    profile, which may be a file whose ``name`` is the rows' hardware)."""
    profile = load_profile(hardware) if hardware else None
    rows = [r for r in load_runs(runs_file) if profile is None or r.hardware == profile.name]
    if profile is not None and not rows:
        raise ValueError(f"no published run was measured on {profile.name!r}; its profile's "
                         "name must be a row's hardware (e.g. h100-sxm)")
    return [compare(r, profile) for r in rows]


def summary(rows: list[Row]) -> dict:
    """Median and worst absolute error, per framework and overall, on throughput and on
    memory (where published)."""
    def stats(values):
        values = [abs(v) for v in values]
        return {"rows": len(values), "median": statistics.median(values) if values else None,
                "worst": max(values) if values else None}
    out = {"overall": {"throughput": stats(r.error for r in rows),
                       "memory": stats(r.memory_error for r in rows if r.memory_error is not None)}}
    for fw in sorted({r.framework for r in rows}):
        mine = [r for r in rows if r.framework == fw]
        out[fw] = {"throughput": stats(r.error for r in mine),
                   "memory": stats(r.memory_error for r in mine if r.memory_error is not None)}
    return out


def table(rows: list[Row]) -> str:
    """The rows as text: id, metric, measured, predicted, error, memory, assumptions."""
    lines = [f"{'run':<58} {'metric':<12} {'measured':>9} {'predicted':>9} {'error':>7}"
             f" {'mem GiB':>7} {'pred':>6} {'error':>6}  assumed"]
    for r in rows:
        mem = (f" {r.memory_measured:7.1f} {r.memory_predicted:6.1f} {r.memory_error:+6.0%}"
               if r.memory_measured is not None else " " * 22)
        lines.append(f"{r.id[:58]:<58} {r.metric:<12} {r.measured:9.4g} {r.predicted:9.4g} "
                     f"{r.error:+7.1%}{mem}  {', '.join(r.assumed)}")
    lines += [f"  {r.id}: {KNOWN_MISSES[r.id]}" for r in rows if r.id in KNOWN_MISSES]
    lines += [f"  assumed {key}: {RULES[key]}" for key in RULES
              if any(key in r.assumed for r in rows)]
    s = summary(rows)
    for key, v in s.items():
        t, m = v["throughput"], v["memory"]
        lines.append(f"{key:<16} throughput: {t['rows']} rows, median {t['median']:.1%}, worst "
                     f"{t['worst']:.1%}" + (f"; memory: {m['rows']} rows, median "
                                            f"{m['median']:.1%}, worst {m['worst']:.1%}"
                                            if m["rows"] else ""))
    return "\n".join(lines)
