"""What ``edu3d tune`` expects before it measures: this machine's profile, and every candidate
ranked by the performance model.

After reading this file you should understand where a tuner's predictions come from:

* **the profile** (:func:`profile_for`): the one ``--hardware`` names, else this machine's
  own (``this-machine``, written by ``edu3d calibrate``), else a shipped stand-in for the
  device (:data:`STAND_IN`: ``cpu-reference``, measured by ``edu3d calibrate`` on the
  course's reference machine, 2 cores; ``h100-sxm`` on a GPU), with a note that says how to
  measure this one. A stand-in ranks layouts roughly right; only a calibration of *this*
  machine can get the step times right;
* **the rows** (:func:`rows`): every layout the planner enumerates
  (:func:`edu3d.plan.search.candidates`: dp x tp x pp (cp, ep), ZeRO stage, micro-batch
  size and count, recomputation), each with the fullest rank's memory
  (:func:`edu3d.plan.estimate.estimate`), whether it fits, and its step time and the parts of
  it from the performance model (:func:`edu3d.plan.step.predict`: compute, launch overhead,
  bubble, exposed communication per axis, optimizer), fastest first among those that fit.

No torch here: the predictions are arithmetic.
"""

from __future__ import annotations

from edu3d.config.sections import Run
from edu3d.model.shapes import ModelSpec
from edu3d.plan import search as plan_search
from edu3d.plan.estimate import estimate
from edu3d.plan.hardware import USER_PROFILE, Profile, ProfileError, load_profile
from edu3d.plan.step import predict

STAND_IN = {"cpu": "cpu-reference", "cuda": "h100-sxm"}  # when this machine is not calibrated
GB = 1e9


def profile_for(hardware: str | None, device: str) -> tuple[Profile, str | None]:
    """The profile to predict with, and a note when it is not this machine's own."""
    if hardware is not None:
        return load_profile(hardware), None
    try:
        return load_profile(USER_PROFILE), None
    except ProfileError as err:
        if "unknown hardware profile" not in str(err):
            raise  # a calibration exists but cannot be read: say so, do not hide it
    stand_in = STAND_IN[device]
    return load_profile(stand_in), (
        f"this machine is not calibrated: predictions use the {stand_in} profile (another "
        f"machine's); run edu3d calibrate (about a minute) to measure this one")


def rows(spec: ModelSpec, cluster: plan_search.Cluster, global_batch: int, precision: str,
         cp_impl: str, profile: Profile) -> list[dict]:
    """Every candidate the planner enumerates: ``{"setup", "memory", "time", "fits"}``
    (``time``: the predicted parts and their ``total``), those that fit first, fastest first."""
    out = []
    for run in plan_search.candidates(spec, cluster, global_batch, precision, "1f1b",
                                      cp_impl=cp_impl):
        try:
            mem = estimate(spec, run)
            time = time_of(spec, run, profile)
        except ValueError:
            continue
        out.append({"setup": run, "memory": mem, "time": time,
                    "fits": mem["total_bytes"] <= cluster.usable * cluster.gpu_mem_gb * GB})
    out.sort(key=lambda r: (not r["fits"], r["time"]["total"], r["memory"]["total_bytes"]))
    return out


def time_of(spec: ModelSpec, run: Run, profile: Profile) -> dict[str, float]:
    """The predicted step's parts (seconds) and their ``total``."""
    pred = predict(spec, run, profile)
    return {**pred.parts, "total": pred.step_time}
