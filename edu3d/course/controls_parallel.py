"""The numbers behind chapters 03-05's control panels: predictions at once, measurements on demand.

After reading this file you should know where every bar and ghost of the three panels comes
from. Each knob setting has a **prediction** computed in this process in milliseconds, and a
**launch target** (or an extraction from one) that measures the same quantity on real ranks:

* **ZeRO** (chapter 03) — :func:`zero_units` (the flat units and their padding to a multiple
  of N, as :class:`edu3d.parallel.zero.sharding.FlatUnit` builds them), :func:`zero_prediction` (the
  paper's formula :func:`edu3d.plan.formulas.zero_bytes`, the planner's exact count
  :func:`edu3d.plan.estimate.state_per_rank`, and the traffic per step 2Ψ / 3Ψ),
  :func:`zero_measured` (what a :func:`edu3d.course.ch02_data_parallel.compare_versions` run held and moved);
* **tensor parallelism** (chapter 04) — :func:`tp_split_prediction` (each rank's shards of one
  ``X·W``, cut in this process exactly as :func:`edu3d.course.ch04_tensor_parallel.split_demo` cuts them on the
  ranks), :func:`tp_collectives_prediction` (count and ring bytes of one layer's collectives,
  SP off and on), :func:`tp_activation_prediction` (activation bytes of one layer,
  Korthikanti's count adapted to this model), and :func:`tp_panel_run`, the launch target that
  measures all three;
* **pipelines** (chapter 05) — :func:`pp_problem` (why a schedule setting cannot be drawn or
  run), :func:`pp_bubble_curve` (formula and simulation over the number of micro-batches),
  :func:`pp_run_kwargs` (the live run that :func:`edu3d.course.ch05_pipeline_parallel.run_schedules` makes).
"""

from __future__ import annotations

import math
from collections import Counter
from functools import lru_cache

# ---- ZeRO --------------------------------------------------------------------------------------
#: traffic per step in units of Ψ parameters (the ZeRO paper's count, section 7)
ZERO_TRAFFIC_PSI = {0: 2, 1: 2, 2: 2, 3: 3}
#: the collectives behind it
ZERO_COLLECTIVES = {0: "all-reduce of the gradients",
                    1: "reduce-scatter grads + all-gather params",
                    2: "reduce-scatter grads + all-gather params",
                    3: "all-gather (fwd) + all-gather (bwd) + reduce-scatter"}
#: fp32 Adam (the course's recipe): bytes per parameter of weights, gradients, moments
FP32_ADAM = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}


def zero_formula_text(stage: int) -> str:
    """The per-rank formula of ``stage`` for fp32 Adam (4 + 4 + 8 bytes) and the paper's
    mixed-precision form (K = 12)."""
    return {0: "4Ψ + 4Ψ + 8Ψ = 16Ψ (paper: 2Ψ + 2Ψ + KΨ)",
            1: "4Ψ + 4Ψ + 8Ψ/N (paper: 4Ψ + KΨ/N)",
            2: "4Ψ + (4+8)Ψ/N (paper: 2Ψ + (2+K)Ψ/N)",
            3: "(4+4+8)Ψ/N (paper: (4+K)Ψ/N)"}[stage]


def course_config():
    """The tiny GPT every chapter-03 run trains (``edu3d train``'s defaults)."""
    from edu3d.course import lesson_args
    from edu3d.train.options import config_from_args

    return config_from_args(lesson_args())


_UNITS: dict[str, list[tuple[str, int]]] = {}


def zero_units(config, n: int) -> list[tuple[str, int, int]]:
    """``(name, numel, padded)`` of each flat unit ZeRO builds for ``config`` on ``n`` ranks
    (the model is built once per config; padding rounds each unit up to a multiple of n)."""
    key = repr(config)
    if key not in _UNITS:
        from edu3d.model.gpt import GPT
        from edu3d.parallel.zero.sharding import model_units

        _UNITS[key] = [(name, sum(p.numel() for p in params))
                       for name, _, params in model_units(GPT(config, seed=0))]
    return [(name, numel, math.ceil(numel / n) * n) for name, numel in _UNITS[key]]


def zero_prediction(config, n: int, stage: int) -> dict:
    """Everything the ZeRO panel predicts for ``n`` ranks at ``stage``: Ψ, the formula and
    the planner's count per category for every stage (bytes on rank 0 after a step), and the
    traffic per step in bytes (Ψ counted as 4-byte parameters)."""
    from edu3d.plan import estimate as plan_memory
    from edu3d.plan.formulas import zero_bytes
    from edu3d.model.shapes import spec_from_config

    units = zero_units(config, n)
    psi = sum(numel for _, numel, _ in units)
    spec = spec_from_config(config)
    formula, estimate = {}, {}
    for s in range(4):
        formula[s] = zero_bytes(psi, n, s, **FP32_ADAM)
        est = plan_memory.state_per_rank(spec, plan_memory.Setup(dp=n, zero=s), 0, 0,
                                         at="rest")
        estimate[s] = {**est, "total": sum(est.values())}
    return {"n": n, "stage": stage, "psi": psi, "units": units, "formula": formula,
            "estimate": estimate,
            "traffic": {s: ZERO_TRAFFIC_PSI[s] * 4 * psi for s in range(4)}}


def zero_versions(stage: int) -> dict:
    """The one version :func:`edu3d.course.ch02_data_parallel.compare_versions` trains for ``stage``."""
    return {f"zero{stage}": {"zero": stage}}


def zero_measured(run, stage: int, steps: int) -> dict:
    """What a :func:`edu3d.course.ch02_data_parallel.compare_versions` run of :func:`zero_versions` held and
    moved: bytes per category on every rank, rank 0's traffic in the last step (the paper's
    count, :func:`edu3d.widgets.overlap.traffic_per_step`), the run's units, and whether its
    losses equal the serial model's."""
    from edu3d.widgets.overlap import traffic_per_step

    name = f"zero{stage}"
    res = run.results[0]
    events = run.events()
    losses, serial = res[name]["losses"], res["serial"]
    return {"stage": stage, "n": len(run.results), "psi": res[name]["psi"],
            "memory": {rank: r[name]["memory"] for rank, r in enumerate(run.results)},
            "traffic": traffic_per_step(events, name, steps),
            "units": res[name].get("units"),
            "loss_rel_err": max(abs(a - b) / abs(b) for a, b in zip(losses, serial))}


# ---- tensor parallelism ------------------------------------------------------------------------
#: the split the panel draws: 4 tokens, 8 -> 8 features (8 divides by every tp it offers)
SPLIT = {"rows": 4, "d_in": 8, "d_out": 8, "seed": 0}


def tp_layer_config():
    """Chapter 04's one-layer model: 8 heads, d = 128, s = 64 (b = 2 in every measurement)."""
    from edu3d.model.gpt import GPTConfig

    return GPTConfig(n_layers=1, n_heads=8, d_model=128, seq_len=64, vocab_size=64)


def tp_split_prediction(t: int, rows: int = 4, d_in: int = 8, d_out: int = 8,
                        seed: int = 0) -> list[dict]:
    """Each of ``t`` ranks' tensors for the column and the row split of one ``nn.Linear``,
    cut here with ``chunk`` from the same seeded layer and input
    :func:`edu3d.course.ch04_tensor_parallel.split_demo` builds on every rank: what the ranks will hold."""
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    x = torch.randn(rows, d_in)
    lin = nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        w = lin.weight.detach().t()  # [d_in, d_out]
        serial = x @ w
        col_w, row_w, xs = w.chunk(t, 1), w.chunk(t, 0), x.chunk(t, -1)
        col_parts = [x @ cw for cw in col_w]
        row_parts = [xi @ rw for xi, rw in zip(xs, row_w)]
        col_result, row_result = torch.cat(col_parts, -1), sum(row_parts)
    return [{"x": x, "serial": serial,
             "column": {"x": x, "w": col_w[r].clone(), "partial": col_parts[r],
                        "result": col_result},
             "row": {"x": xs[r].clone(), "w": row_w[r].clone(), "partial": row_parts[r],
                     "result": row_result}} for r in range(t)]


def split_difference(measured: list[dict], predicted: list[dict], kind: str) -> float:
    """Largest |difference| between the ranks' tensors and the prediction."""
    return max(float((m[kind][k] - p[kind][k]).abs().max())
               for m, p in zip(measured, predicted) for k in ("x", "w", "partial", "result"))


#: one layer's collectives, from the operators in edu3d.parallel.tp (f, g and the SP pairs)
TP_COLLECTIVES = {False: {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}},
                  True: {"forward": {"all_gather": 2, "reduce_scatter": 2},
                         "backward": {"all_gather": 4, "reduce_scatter": 2}}}
#: bytes a rank sends on a ring, per byte of the full buffer S, times t/(t-1)
RING_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


def tp_collectives_prediction(config, batch: int, t: int, sp: bool) -> dict:
    """``{phase: {op: {"count", "bytes", "ring_bytes"}}}`` for one layer on ``t`` ranks:
    ``bytes`` is the full buffer S = b·s·h·4 of each collective summed (what the trace
    records), ``ring_bytes`` what one rank sends on a ring (all-reduce 2(t-1)/t·S,
    all-gather and reduce-scatter (t-1)/t·S)."""
    s_bytes = batch * config.seq_len * config.d_model * 4
    out = {}
    for phase, ops in TP_COLLECTIVES[sp].items():
        out[phase] = {op: {"count": n, "bytes": n * s_bytes,
                           "ring_bytes": n * RING_FACTOR[op] * (t - 1) / t * s_bytes}
                      for op, n in ops.items()}
    return out


def tp_activation_prediction(config, batch: int, t: int, sp: bool) -> dict:
    """Activation bytes one layer keeps per rank: this model's count (fp32, no dropout,
    fused attention) and Korthikanti et al.'s 16-bit count for the paper's layer."""
    from edu3d.plan.formulas import activation_bytes_per_layer, layer_activation_bytes

    s, h, a = config.seq_len, config.d_model, config.n_heads
    return {"model_formula": layer_activation_bytes(s, batch, h, a, t, sp),
            "korthikanti_16bit": activation_bytes_per_layer(s, batch, h, a, t, sp)}


def tp_panel_run(mesh, config, batch: int = 2, sp: bool = False) -> dict:
    """Launch target (``Layout(tp=t)``): the split demo, one layer's collectives counted and
    summed from the trace (forward and backward, SP as asked), and the activation bytes the
    layer saved, measured with ``saved_tensors_hooks``."""
    import torch

    from edu3d.distributed import trace
    from edu3d.course.ch04_tensor_parallel import split_demo
    from edu3d.parallel.tp.activations import tp_block, block_input, measure_layer

    block = tp_block(config, mesh, sp, 0)
    x = block_input(config, batch, mesh, sp, 0)
    phases = {}
    with trace.use(trace.Recorder(mesh.rank)) as rec:
        y = block(x)
        phases["forward"] = [e for e in rec.events if e["lane"] == "comm"]
        rec.events.clear()
        y.backward(torch.ones_like(y))
        phases["backward"] = [e for e in rec.events if e["lane"] == "comm"]
    t = mesh.size("tp")
    collectives = {}
    for phase, evs in phases.items():
        counts = Counter(e["op"] for e in evs)
        collectives[phase] = {
            op: {"count": n, "bytes": sum(e["bytes"] for e in evs if e["op"] == op),
                 "ring_bytes": sum(RING_FACTOR.get(op, 0) * (t - 1) / t * e["bytes"]
                                   for e in evs if e["op"] == op)}
            for op, n in sorted(counts.items())}
    return {"split": split_demo(mesh, **SPLIT), "collectives": collectives,
            "memory": {**measure_layer(mesh, config, batch, sp),
                       **tp_activation_prediction(config, batch, t, sp)}}


# ---- pipelines ---------------------------------------------------------------------------------
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def pp_problem(schedule: str, pp: int, m: int, vpp: int) -> str | None:
    """Why ``schedule`` with ``pp`` ranks, ``m`` micro-batches and ``vpp`` chunks per rank
    cannot be drawn (None if it can)."""
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}"
    if pp < 1 or m < 1 or vpp < 1:
        return "pp, micro-batches and vpp must be at least 1"
    if vpp > 1 and schedule != "interleaved":
        return (f"vpp = {vpp} chunks per rank needs the interleaved schedule: {schedule} "
                "runs one chunk per rank (set vpp = 1, or choose interleaved)")
    if schedule == "interleaved" and vpp == 1:
        return ("interleaved with vpp = 1 is plain 1F1B: give each rank at least 2 chunks "
                "(vpp >= 2)")
    if schedule == "interleaved" and m % pp:
        return (f"interleaved sends micro-batches through the chunks in groups of pp: "
                f"m = {m} must be a multiple of pp = {pp} (try m = {pp * max(1, m // pp)})")
    from edu3d.schedules.actions import build

    try:  # the generators' own limits (ZB-H1 groups its micro-batches like interleaving)
        build(schedule, pp, m, vpp)
    except ValueError as err:
        return f"{schedule} with pp = {pp}, m = {m} cannot be built ({err})"
    return None


def pp_run_problem(schedule: str, pp: int, m: int, vpp: int, max_ranks: int = 8) -> str | None:
    """Why the live run of that setting cannot go (None if it can)."""
    bad = pp_problem(schedule, pp, m, vpp)
    if bad:
        return bad
    if pp > max_ranks:
        return f"the live run is limited to {max_ranks} ranks on this machine (pp = {pp})"
    return None


def pp_run_kwargs(schedule: str, pp: int, m: int, vpp: int, steps: int = 2) -> dict:
    """Options of :func:`edu3d.course.ch05_pipeline_parallel.run_schedules` for one schedule: one layer per
    global stage (at least 4), chapter 05's sizes (d = 128, s = 64, 2 rows per micro-batch),
    so compute, not message overhead, fills most of a step."""
    return {"layers": max(4, pp * vpp), "d_model": 128, "seq": 64, "rows": 2, "steps": steps}


@lru_cache(maxsize=256)
def pp_bubble_curve(schedule: str, pp: int, vpp: int, ms: tuple, p2p: float = 0.0) -> dict:
    """Bubble fraction for each m in ``ms``: the formula and the simulation (F = 1, B = 2,
    I = W = 1, ``p2p`` per message in the same unit); settings that cannot run are left
    out."""
    from edu3d.schedules.actions import build
    from edu3d.schedules.simulate import Costs, bubble_formula, simulate

    out = {"m": [], "formula": [], "simulated": []}
    for m in ms:  # a tuple, so the curve is computed once per setting
        if pp_problem(schedule, pp, m, vpp):
            continue
        sim = simulate(build(schedule, pp, m, vpp), pp, Costs(F=1, B=2, I=1, W=1, p2p=p2p))
        out["m"].append(m)
        out["formula"].append(bubble_formula(schedule, pp, m, vpp))
        out["simulated"].append(sim.bubble)
    return out
