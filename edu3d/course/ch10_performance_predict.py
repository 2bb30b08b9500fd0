"""Chapter 10's "Predicting a step": the course's one performance model
(:func:`edu3d.plan.step.predict`) on this machine, against this machine's runs and against
published runs of real clusters.

After reading this file you should know how the chapter turns its own measurements into a
hardware profile, what the model's prediction of a step is made of, and how far to trust it:

* :func:`profile_for` calibrates: the shipped CPU profile (``cpu-reference``, written by
  ``edu3d calibrate`` on a 2-core machine: matmul rate by size, memory bandwidth, the eager
  overhead per kernel and per tensor) with this machine's cores, gloo's latency ``alpha`` and
  bandwidth fitted to the chapter's own all-reduces (:func:`edu3d.course.ch10_performance.
  calibrate`), and every compute rate scaled by one factor so that the model's serial step is
  the measured one (this machine's core is faster or slower than the reference's, and busier);
* :func:`predict` weighs a chapter layout on that profile: each op on the roofline plus its
  launch overhead, each collective ``alpha x steps + bytes x factor / bandwidth``, the
  pipeline schedule replayed and data parallelism's buckets overlapped with the backward;
  and sorts the parts into the budget the chapter draws (compute, exposed communication by
  axis, bubble);
* :func:`against_measured` pairs predicted and measured steps of the layouts the chapter ran;
* :func:`published` is the same model against every published measured run
  (:func:`edu3d.plan.validate.validate`): the points of the predicted-vs-measured scatter,
  each with its source, and the rows it misses with the reason.
"""

from __future__ import annotations

import dataclasses
import os
from functools import lru_cache

from edu3d.course import lesson_args
from edu3d.course.ch10_performance import DEFAULT_COSTS, LAYOUTS, layout_options
from edu3d.plan import validate
from edu3d.plan.estimate import spec_of
from edu3d.plan.hardware import Profile, load_profile
from edu3d.plan.step import predict as model_predict

BASE_PROFILE = "cpu-reference"  # edu3d calibrate's profile of the 2-core reference machine
COMM_AXES = ("tp", "pp", "dp", "edp", "cp", "ep")


def run_of(name: str, overlap: str = "on", microbatches: int | None = None):
    """The :class:`~edu3d.config.sections.Run` of chapter layout ``name`` (the lesson's tiny
    model, 8 sequences, fp32, as the chapter trains it); more micro-batches than a data-
    parallel rank has sequences get one sequence each (the batch grows to ``dp·m``)."""
    run = lesson_args(**layout_options(name, overlap, microbatches))
    lay, m = run.layout, run.microbatches
    if run.batch.global_batch < lay.dp * m:
        run = run.replace(global_batch=lay.dp * m)
    return run


def profile_for(costs: dict | None = None, cores: int | None = None) -> Profile:
    """The reference CPU profile calibrated to this machine's ``costs``
    (``serial_ms``, ``alpha_us``, ``gb_per_s``) and ``cores``."""
    c = {**DEFAULT_COSTS, **(costs or {})}
    return _profile(float(c["serial_ms"]), float(c["alpha_us"]), float(c["gb_per_s"]),
                    int(cores or os.cpu_count() or 1))


@lru_cache(maxsize=32)
def _profile(serial_ms: float, alpha_us: float, gb_per_s: float, cores: int) -> Profile:
    base = load_profile(BASE_PROFILE)
    bw = gb_per_s * 1e9
    linked = dataclasses.replace(  # one alpha-beta for every kind: the chapter fits one
        base, cores=cores, intra_alpha=alpha_us * 1e-6, intra_bandwidth=bw,
        intra_gather_bandwidth=bw, collectives={}, gpus_per_node=max(base.gpus_per_node, 64))
    serial = run_of("dp1")
    k = serial_ms / 1e3 / model_predict(spec_of(serial), serial, linked, memory=False).step_time
    return dataclasses.replace(  # every compute term is a rate or an overhead: one factor
        linked, name=f"{BASE_PROFILE} calibrated here",
        peak_flops={p: v / k if v else v for p, v in linked.peak_flops.items()},
        mem_bandwidth=linked.mem_bandwidth / k, kernel_overhead=linked.kernel_overhead * k,
        step_overhead=linked.step_overhead * k, hook_overhead=linked.hook_overhead * k,
        sync_overhead=linked.sync_overhead * k, collective_overhead=linked.collective_overhead * k)


def predict(name: str, overlap: str = "on", microbatches: int | None = None,
            costs: dict | None = None, cores: int | None = None) -> dict:
    """The predicted step of layout ``name`` (ms): ``compute`` (kernels, their launches, the
    optimizer), ``exposed`` communication (``by_axis``; ``comm`` is the same: what the step
    waits for), ``bubble``, and their sum ``step``; also ``parts`` (the model's own, ms)."""
    run = run_of(name, overlap, microbatches)
    profile = profile_for(costs, cores)
    pred = model_predict(spec_of(run), run, profile, memory=False)
    ms = {k: v * 1e3 for k, v in pred.parts.items()}
    by_axis = {a: ms[a] for a in COMM_AXES if ms[a]}
    out = {"compute": ms["compute"] + ms["overhead"] + ms["optimizer"],
           "exposed": sum(by_axis.values()), "bubble": ms["bubble"]}
    out["step"] = pred.step_time * 1e3
    return {"name": name, "overlap": overlap, "microbatches": run.microbatches,
            "world_size": run.world_size, "cores": profile.cores, **out,
            "comm": out["exposed"], "by_axis": by_axis, "parts": ms}


def against_measured(sweep: list[dict], costs: dict | None = None,
                     cores: int | None = None) -> list[dict]:
    """``[{"name", "predicted", "measured", "error"}]`` (ms) for each layout of the chapter's
    measured ``sweep`` (its ``median_s``), predicted with overlap on as the sweep ran."""
    out = []
    for row in sweep:
        if row.get("name") not in LAYOUTS:
            continue
        got = predict(row["name"], "on", costs=costs, cores=cores)["step"]
        measured = row["median_s"] * 1e3
        out.append({"name": row["name"], "predicted": got, "measured": measured,
                    "error": got / measured - 1})
    return out


def published() -> dict:
    """The model against every published run: ``points`` (id, source, framework, metric,
    measured, predicted, error, known miss or None), ``summary`` (per source and overall:
    rows, median and worst error of throughput and memory) and ``misses`` (id -> why)."""
    rows = validate.validate()
    points = [{"id": r.id, "framework": r.framework, "metric": r.metric,
               "measured": r.measured, "predicted": r.predicted, "error": r.error,
               "miss": validate.KNOWN_MISSES.get(r.id)} for r in rows]
    return {"points": points, "summary": validate.summary(rows),
            "misses": dict(validate.KNOWN_MISSES)}
