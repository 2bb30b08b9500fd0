"""Chapter 03 (ZeRO): its panel's predictions, what a run measured, and exercise 03's grader.

After reading this file you should know where every bar of chapter 03's panel comes from.
Each knob setting (stage, N) has a **prediction** computed in this process in milliseconds:
:func:`zero_units` (the flat units and their padding to a multiple of N, as
:class:`edu3d.parallel.zero.flat_unit.FlatUnit` builds them) and :func:`zero_prediction` (the
paper's formula :func:`edu3d.plan.formulas.zero_bytes`, the planner's exact count
:func:`edu3d.plan.estimate.state_per_rank`, and the traffic per step 2Ψ / 3Ψ). The button's
run is chapter 02's :func:`edu3d.course.ch02_data_parallel.compare_versions` at that stage,
and :func:`zero_measured` reads what it held and moved. :func:`grade_zero1_exercise` runs the
learner's ZeRO-1 step against one serial SGD step.
"""

from __future__ import annotations

import math

import torch

from edu3d.course import grading, lesson_args
from edu3d.course.ch02_data_parallel import traffic_per_step
from edu3d.distributed import trace
from edu3d.model.gpt import GPT, config_from
from edu3d.model.shapes import spec_from_config
from edu3d.parallel.zero.units import model_units
from edu3d.plan import estimate as plan_memory
from edu3d.plan.formulas import zero_bytes
from edu3d.train.data import SyntheticCorpus, shard_rows
from edu3d.train.options import config_from_args

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
    return config_from_args(lesson_args())


_UNITS: dict[str, list[tuple[str, int]]] = {}


def zero_units(config, n: int) -> list[tuple[str, int, int]]:
    """``(name, numel, padded)`` of each flat unit ZeRO builds for ``config`` on ``n`` ranks
    (the model is built once per config; padding rounds each unit up to a multiple of n)."""
    key = repr(config)
    if key not in _UNITS:
        _UNITS[key] = [(name, sum(p.numel() for p in params))
                       for name, _, params in model_units(GPT(config, seed=0))]
    return [(name, numel, math.ceil(numel / n) * n) for name, numel in _UNITS[key]]


def zero_prediction(config, n: int, stage: int) -> dict:
    """Everything the ZeRO panel predicts for ``n`` ranks at ``stage``: Ψ, the formula and
    the planner's count per category for every stage (bytes on rank 0 after a step), the
    traffic per step in bytes (Ψ counted as 4-byte parameters), and the words the chart
    writes beside them (each stage's formula, its traffic in Ψ and its collectives)."""
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
            "traffic": {s: ZERO_TRAFFIC_PSI[s] * 4 * psi for s in range(4)},
            "traffic_psi": ZERO_TRAFFIC_PSI, "collectives": ZERO_COLLECTIVES,
            "formula_text": {s: zero_formula_text(s) for s in range(4)}}


def zero_versions(stage: int) -> dict:
    """The one version :func:`edu3d.course.ch02_data_parallel.compare_versions` trains for ``stage``."""
    return {f"zero{stage}": {"zero": stage}}


def zero_measured(run, stage: int, steps: int) -> dict:
    """What a :func:`edu3d.course.ch02_data_parallel.compare_versions` run of :func:`zero_versions` held and
    moved: bytes per category on every rank, rank 0's traffic in the last step (the paper's
    count, :func:`edu3d.course.ch02_data_parallel.traffic_per_step`), the run's units, and whether its
    losses equal the serial model's."""
    name = f"zero{stage}"
    res = run.results[0]
    events = run.events()
    losses, serial = res[name]["losses"], res["serial"]
    return {"stage": stage, "n": len(run.results), "psi": res[name]["psi"],
            "memory": {rank: r[name]["memory"] for rank, r in enumerate(run.results)},
            "traffic": traffic_per_step(events, name, steps),
            "units": res[name].get("units"),
            "loss_rel_err": max(abs(a - b) / abs(b) for a, b in zip(losses, serial))}


def grade_zero1_exercise(mesh, lr: float = 0.1) -> bool:
    """Run the learner's ``zero1_sgd_step`` (exercises/zero1.py) on this rank's rows of a
    global batch, traced as ``case=exercise``; True when the parameters equal one serial SGD
    step on the whole batch (False, never an exception, when the code is unfinished)."""
    mod = grading.load("zero1")
    config = config_from("tiny", layers=1, d_model=35, heads=5, vocab=100)  # 23,345 = 3k + 2
    x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0).batch(1, 6)
    serial = GPT(config, seed=0)
    serial(x, y)[1].backward()
    with torch.no_grad():
        want = [p - lr * p.grad for p in serial.parameters()]
    model = GPT(config, seed=0)
    n, index = mesh.size("dp"), mesh.index("dp")
    model(shard_rows(x, index, n), shard_rows(y, index, n))[1].backward()
    try:
        with trace.current().context(case="exercise"):
            mod.zero1_sgd_step(list(model.parameters()), lr, mesh.dp)
    except NotImplementedError:
        return False
    return all(torch.allclose(p, w, rtol=1e-5, atol=1e-7)
               for p, w in zip(model.parameters(), want))
