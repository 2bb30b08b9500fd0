"""``edu3d bench tune-model``: does the performance model predict this machine? Calibrate, tune, grade.

After reading this file you should understand how the model is held to this machine, and why
it is a benchmark and not a test:

* it **calibrates** this machine (:mod:`edu3d.bench.calibration`, about a minute) into a
  temporary profile (the user's own ``this-machine`` is left as it is);
* it **tunes** the tiny model on ``-n`` ranks (default 2) with that profile
  (:func:`edu3d.bench.autotune.tune`: the planner's 8 most varied candidates, each predicted
  by :func:`edu3d.plan.step.predict` and then measured, ``--reps`` timed steps after 2
  warm-up ones);
* it **grades** the model against the goal of issue 35: Spearman's rank correlation of
  predicted and measured step times at least :data:`GOAL_SPEARMAN`, and the median of
  ``|predicted / measured - 1|`` at most :data:`GOAL_ERROR`. Each candidate is a row:
  ``edu3d_s`` the measured step, ``reference_s`` the prediction, ``ratio`` measured over
  predicted;
* it records **the load** the machine was under, before and after (the load average, the
  runnable processes, and the share of a core a busy loop got), and grades twice: against
  each candidate's median step (what ``edu3d tune`` reports) and against its fastest step
  (what other processes' load moves least: every rank that loses its core for a while makes
  the others wait at the next collective). The goal is stated for a machine with nothing
  else running, where the two agree.

The verdict is printed, never asserted: a test's result must not depend on the machine's load.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

from edu3d.bench import autotune, calibration, profile_fit
from edu3d.bench import harness as bench
from edu3d.bench.ranking import format_table, spearman

GOAL_SPEARMAN = 0.8
GOAL_ERROR = 0.30
MODEL = "tiny"


def load() -> dict:
    """The machine's load now: ``/proc/loadavg`` (1-minute average, runnable processes) and
    the share of a core a busy loop gets for 0.3 s (1.0: a core of its own)."""
    out = {}
    try:
        with open("/proc/loadavg") as f:
            fields = f.read().split()
        out.update(load_1min=float(fields[0]), runnable=int(fields[3].split("/")[0]))
    except (OSError, IndexError, ValueError):
        pass
    t0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < 0.3:
        pass
    out["core_share"] = (time.process_time() - c0) / (time.perf_counter() - t0)
    out["cores"] = autotune.cores()
    return out


def grade(candidates: list[dict], key: str) -> dict:
    """Spearman and the median error of the predictions against each measured candidate's
    ``key`` (``"step_s"``: the median step, ``"fastest_s"``: the fastest), and whether they
    meet issue 35's goal (6 or more candidates, Spearman >= 0.8, median error <= 30 %)."""
    done = [c for c in candidates if "measured" in c]
    pred = [c["predicted_step_s"] for c in done]
    meas = [c["measured"][key] for c in done]
    rho = spearman(pred, meas) if len(done) > 1 else math.nan
    err = statistics.median(abs(p / m - 1) for p, m in zip(pred, meas)) if done else math.nan
    return {"spearman": rho, "median_error": err, "met": len(done) >= 6 and rho >= GOAL_SPEARMAN
            and err <= GOAL_ERROR}


def verdict(name: str, g: dict, count: int) -> str:
    """The grade against the goal, in one line."""
    return (f"against the {name}: Spearman {g['spearman']:+.2f} (goal >= {GOAL_SPEARMAN}), "
            f"median step-time error {g['median_error']:.0%} (goal <= {GOAL_ERROR:.0%}) over "
            f"{count} candidates: {'goal met' if g['met'] else 'goal not met'}")


def describe_load(before: dict, after: dict) -> str:
    def one(d):
        return (f"load average {d.get('load_1min', float('nan')):.1f}, "
                f"{d.get('runnable', '?')} runnable, a busy loop got {d['core_share']:.0%} "
                "of a core")
    return f"load before: {one(before)}; after: {one(after)} ({before['cores']} cores)"


def run_benchmark(nprocs: int = 2, json_out: bool = False, reps: int = 10,
                  budget_s: float = 60.0) -> dict:
    """Calibrate, tune the tiny model on ``nprocs`` ranks (``reps`` timed steps each), and
    grade the model's predictions; returns the report (the harness's shape, plus the grade,
    the load and the profile)."""
    before = load()
    with tempfile.TemporaryDirectory(prefix="edu3d-tune-model-") as tmp:
        measured = calibration.measure(budget_s, progress=bench.progress)
        profile = profile_fit.profile_from(measured, calibration.about())
        path = profile_fit.write(profile, Path(tmp) / "this-machine.json")
        rep = autotune.tune(MODEL, nprocs, steps=reps, warmup=2, top=8, hardware=str(path),
                            progress=bench.progress)
    after = load()
    done = [c for c in rep["candidates"] if "measured" in c]
    rows = [bench.result(c["label"], c["measured"]["step_s"],
                         "performance model (edu3d.plan.step.predict, calibrated profile)",
                         c["predicted_step_s"], layout=c["label"].split(" zero")[0],
                         fastest_s=c["measured"]["fastest_s"],
                         predicted_parts_s=c["predicted_parts_s"], error=c["error"])
            for c in done]
    out = bench.report("tune-model", nprocs, rows, layout=f"{MODEL}, {nprocs} ranks")
    median, fastest = grade(rep["candidates"], "step_s"), grade(rep["candidates"], "fastest_s")
    out.update(median_step=median, fastest_step=fastest, candidates_measured=len(done),
               failed=[c["label"] for c in rep["candidates"] if "measured" not in c],
               goal={"spearman": GOAL_SPEARMAN, "median_error": GOAL_ERROR},
               load_before=before, load_after=after, profile=profile)
    if not json_out:
        print(format_table(rep))
        print(describe_load(before, after))
        print(verdict("median step", median, len(done)))
        print(verdict("fastest step", fastest, len(done)))
    return out
