"""Chapter 03 (ZeRO): its panel's predictions and what a run measured.

After reading this file you should know where every bar of chapter 03's panel comes from.
Each knob setting (stage, N) has a **prediction** computed in this process in milliseconds:
:func:`zero_units` (the flat units and their padding to a multiple of N, as
:class:`edu3d.parallel.zero.flat_unit.FlatUnit` builds them) and :func:`zero_prediction` (the
paper's formula :func:`edu3d.plan.formulas.zero_bytes`, the planner's exact count
:func:`edu3d.plan.estimate.state_per_rank`, and the traffic per step 2Ψ / 3Ψ). The button's
run is chapter 02's :func:`edu3d.course.ch02_data_parallel.compare_versions` at that stage,
and :func:`zero_measured` reads what it held and moved.
"""

from __future__ import annotations

import math

from edu3d.course import lesson_args
from edu3d.course.ch02_data_parallel import traffic_per_step
from edu3d.model.gpt import GPT
from edu3d.model.shapes import spec_from_config
from edu3d.parallel.zero.units import model_units
from edu3d.plan import estimate as plan_memory
from edu3d.plan.formulas import zero_bytes
from edu3d.train.preflight import model_config

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
    return model_config(lesson_args())


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
        est = plan_memory.state_per_rank(spec, plan_memory.setup(dp=n, zero=s), 0, 0,
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


# ---- ZeRO-3's rhythm and prefetch, read from a run's trace --------------------------------
def unit_spans(events: list[dict], case: str) -> list[dict]:
    """The trace of ``case`` with each rank's forward and backward cut into one span per unit:
    from the end of the unit's all-gather (its parameters arrive) to the moment they are
    freed (the rank's next drop in resident parameters; in backward, to its reduce-scatter),
    an ``F`` or ``B`` span labelled ``u<unit>``, so gather -> compute -> free shows unit by
    unit."""
    out = [e for e in events if e.get("case") == case and e["op"] not in ("F", "B")]
    for rank in sorted({e["rank"] for e in out}):
        mine = sorted((e for e in events if e.get("case") == case and e["rank"] == rank),
                      key=lambda e: e["t0"])
        back = [(e["t0"], e["t1"]) for e in mine if e["op"] == "B"]
        held = None
        for i, e in enumerate(mine):
            if e["op"] != "all_gather" or e.get("chunk") is None:
                continue
            freed = next((m for m in mine[i + 1:] if m.get("lane") == "mem" and
                          m["op"] == "params" and held is not None and
                          m["mem"]["params"] < held), None)
            held = next((m["mem"]["params"] for m in mine[i + 1:]
                         if m.get("lane") == "mem" and m["op"] == "params"), held)
            if freed is None:
                continue
            bwd = any(a <= e["t0"] <= b for a, b in back)
            # backward's compute ends where its gradients leave (the reduce-scatter)
            scatter = next((m for m in mine[i + 1:] if m["op"] == "reduce_scatter" and
                            m.get("chunk") == e["chunk"]), None) if bwd else None
            end = min(freed["t0"], scatter["t0"]) if scatter else freed["t0"]
            out.append({"rank": rank, "lane": "compute", "op": "B" if bwd else "F",
                        "case": case, "step": e.get("step"), "unit": e["chunk"],
                        "label": f"u{e['chunk']}", "t0": e["t1"], "t1": end})
    return out


def _overlap(spans, others) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in spans for c, d in others)


def prefetch_effect(events: list[dict], steps: int, cases=("zero3", "zero3-prefetch")) -> dict:
    """Per case: the step time (ms; median, min and max over ranks and the steps after the
    first) and the all-gather time spent under a unit's compute (:func:`unit_spans`; ms per
    step, median over ranks and steps): a blocking gather has none, a prefetched one some."""
    out = {}
    for case in cases:
        times, hidden = [], []
        units = unit_spans(events, case)
        for rank in sorted({e["rank"] for e in units}):
            for step in range(2, steps + 1):
                mine = [e for e in events if e.get("case") == case and e["rank"] == rank
                        and e.get("step") == step and e.get("lane") in ("compute", "comm")]
                if not mine:
                    continue
                times.append((max(e["t1"] for e in mine) - min(e["t0"] for e in mine)) / 1e3)
                comp = [(e["t0"], e["t1"]) for e in units if e["rank"] == rank and
                        e.get("step") == step and e["op"] in ("F", "B")]
                gather = [(e["t0"], e["t1"]) for e in mine if e["op"] == "all_gather"]
                hidden.append(_overlap(gather, comp) / 1e3)
        times.sort()
        hidden.sort()
        out[case] = {"step_ms": times[len(times) // 2], "min_ms": times[0],
                     "max_ms": times[-1], "hidden_ms": hidden[len(hidden) // 2]}
    return out


def prefetch_takeaway(effect: dict) -> str:
    """What the run says prefetch did, from its numbers (and what a GPU would show)."""
    a, b = effect["zero3"], effect["zero3-prefetch"]
    verdict = ("faster" if b["max_ms"] < a["min_ms"] else "slower" if b["min_ms"] > a["max_ms"]
               else "no clear difference")
    return (f"all-gather under compute: {b['hidden_ms']:.0f} ms per step with prefetch, "
            f"{a['hidden_ms']:.0f} ms without; step {b['step_ms']:.0f} ms "
            f"({b['min_ms']:.0f}-{b['max_ms']:.0f}) vs {a['step_ms']:.0f} ms "
            f"({a['min_ms']:.0f}-{a['max_ms']:.0f}): {verdict} here.<br>On 2 CPU cores the "
            "gather and the compute share the cores; on a GPU the gather runs on its own "
            "stream and link, so what overlaps is hidden.")
