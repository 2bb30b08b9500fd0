"""Chapter 07's auto-tuner: the planner's best layouts for a small model, measured live.

After reading this file you should know where the chapter's last table and chart come from:

* :func:`run` is ``edu3d tune`` at the chapter's size (:data:`SETTINGS`: the tiny model cut
  to 2 layers of width 32, 2 ranks, 6 candidates, 1 warm-up and 3 timed steps each, all in
  one launch): :func:`edu3d.bench.autotune.tune`, whose report the chapter keeps;
* :func:`points` turns a report into what the chart draws for one metric, step time or
  peak memory: the planner's value and the measured one per candidate, their ranks (ties
  averaged), Spearman's correlation of the two (:mod:`edu3d.bench.ranking`), the winner and
  the candidate the model misranked most on that metric;
* :func:`describe` is one candidate in a line: its predicted step split into the cost
  model's parts against the measured step, its memory, and the ``edu3d train`` command
  that reruns it alone.

The control panel redraws from a recorded report with these; only its button launches.
"""

from __future__ import annotations

import math

from edu3d.bench import autotune
from edu3d.bench.ranking import ranks, spearman

SETTINGS = dict(model="tiny", gpus=2, top=6, steps=3, warmup=1, layers=2, d_model=32, seq=32)
METRICS = {  # name -> (predicted key, measured key, scale, unit)
    "step time": ("predicted_step_s", "step_s", 1e3, "ms"),
    "peak memory": ("predicted_bytes", "peak_bytes", 1 / 2**20, "MiB"),
}


def run(progress=None, **changes) -> dict:
    """Tune the chapter's model live (:data:`SETTINGS`, with ``changes``); the report."""
    return autotune.tune(**{**SETTINGS, **changes}, progress=progress)


def points(report: dict, metric: str = "step time") -> dict:
    """The measured candidates of ``report`` as the chart draws them for ``metric``."""
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r}: choose one of {', '.join(METRICS)}")
    want, got, scale, unit = METRICS[metric]
    done = [c for c in report["candidates"] if "measured" in c]
    pred = [c[want] * scale for c in done]
    meas = [c["measured"][got] * scale for c in done]
    rp, rm = ranks(pred), ranks(meas)
    rho = spearman(pred, meas) if len(done) > 1 else math.nan
    worst = max(range(len(done)), key=lambda i: abs(rp[i] - rm[i]), default=None)
    return {"metric": metric, "unit": unit, "labels": [c["label"] for c in done],
            "predicted": pred, "measured": meas, "predicted_rank": rp, "measured_rank": rm,
            "spearman": rho, "winner": report["winner"],
            "misranked": None if worst is None else done[worst]["label"],
            "world_size": report["world_size"], "device": report["device"]}


def describe(report: dict, label: str) -> str:
    """One candidate of ``report`` in a line: prediction by part, measurement, command."""
    c = next((c for c in report["candidates"] if c["label"] == label), None)
    if c is None:
        return f"{label}: not in this tuning"
    parts = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in c["predicted_parts_s"].items() if v)
    head = (f"{label}: predicted {c['predicted_step_s'] * 1e3:.2f} ms ({parts}), "
            f"{c['predicted_bytes'] / 2**20:.2f} MiB")
    m = c.get("measured")
    if m is None:
        return f"{head}; failed: {c.get('error', 'not run')}"
    return (f"{head}; measured {m['step_s'] * 1e3:.1f} ms "
            f"({m['step_s'] / c['predicted_step_s']:.0f}x), {m['peak_bytes'] / 2**20:.2f} MiB, "
            f"place {c['measured_rank']:g} (predicted {c['predicted_rank']:g}); rerun alone: "
            f"{c['command']}")
