"""The CPU terms of a profile: what ranks on a laptop cost beyond their kernels, fitted from Trainer steps.

After reading this file you should understand how ``edu3d calibrate`` turns the same narrow
Trainer steps, run serially, on data-parallel and tensor-parallel ranks, side by side and with
recomputation, into the handful of host constants :mod:`edu3d.plan.cpu` charges (a GPU
profile has none of them):

* **a line through times, weighted by relative error** (:func:`line`), which every fit here
  and in :mod:`edu3d.bench.profile_fit` uses: ``t = per_step + m·per_microbatch`` over the
  micro-batch counts;
* **data parallelism's hooks and step** (:func:`hook_fit`, :func:`sync_fit`): the
  data-parallel steps' slope and intercept beyond the serial ones, per parameter tensor;
* **ranks beside each other** (:func:`corun_fit`): the same serial steps on every rank at
  once, their median on the wall clock against the fastest alone;
* **the host around a collective** (:func:`collective_fit`): tensor-parallel steps' slope
  beyond the serial one, shared by the collectives a micro-batch issues
  (:func:`collectives_per_microbatch`);
* **a recomputed region** (:func:`checkpoint_fit`): the steps with every block checkpointed,
  less the serial steps and less the launches of the kernels they recompute, per region:
  ``torch.utils.checkpoint``'s own machinery (saved-tensor hooks, the inputs and RNG state
  kept, the forward re-run from Python), ~0.3-0.4 ms a region on the 2-core VM, which the
  kernels of a tiny model's attention core are not.

:func:`terms` writes them as constants with their sources. No torch.
"""

from __future__ import annotations

import math

from edu3d.config.sections import Run
from edu3d.plan import recipes, trainer_comm
from edu3d.plan.estimate import spec_of
from edu3d.plan.stage_costs import cut_of


class CalibrationError(ValueError):
    """Measurements a fit cannot use; the message says which and what to do."""


def line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(a, b)`` of ``y = a + b·x`` minimising the relative residuals ``(y - a - b·x) / y``."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise CalibrationError(f"a line needs two or more distinct x, got {sorted(set(xs))}")
    if any(not (math.isfinite(y) and y > 0) for y in ys):
        raise CalibrationError(f"times must be finite and > 0, got {ys}")
    w = [1 / y**2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return (sy - b * sx) / sw, b



def hook_fit(microbatches: list[int], seconds: list[float], serial_per_microbatch: float,
             tensors: int) -> float:
    """Seconds per parameter tensor per micro-batch that data parallelism adds: the slope of
    data-parallel steps over ``microbatches`` beyond the serial one, never below 0."""
    _, per_mb = line([float(m) for m in microbatches], seconds)
    return max(0.0, (per_mb - serial_per_microbatch) / tensors)


def sync_fit(microbatches: list[int], seconds: list[float], serial_per_step: float,
             tensors: int) -> float:
    """Seconds per parameter tensor per step that data parallelism adds once per step: the
    intercept of data-parallel steps over ``microbatches`` beyond the serial one, never below 0."""
    per_step, _ = line([float(m) for m in microbatches], seconds)
    return max(0.0, (per_step - serial_per_step) / tensors)


def corun_fit(together: list[float], alone: list[float]) -> float:
    """``together`` (wall clock, every rank at once) over ``alone`` (CPU time), at least 1."""
    return max(1.0, sum(together) / sum(alone))


def collectives_per_microbatch(run: Run) -> int:
    """Collectives one more micro-batch of ``run`` (of one sequence per rank) issues on
    rank 0, as the model counts them (:func:`edu3d.plan.trainer_comm.count`)."""
    spec, calls = spec_of(run), []
    for m in (1, 2):
        one = run.replace(global_batch=m * run.layout.dp, microbatches=m)
        cut = cut_of(spec, one, recipes.recipe_of("edu3d"))
        calls.append(sum(trainer_comm.count(spec, one, cut, 0, spec.n_layers, True,
                                            True).values()))
    return calls[1] - calls[0]


def collective_fit(microbatches: list[int], seconds: list[float], serial_per_microbatch: float,
                   collectives: int, inside: float) -> float:
    """Host seconds per collective beyond its own: the slope of tensor-parallel steps over
    ``microbatches`` beyond the serial one, shared by the ``collectives`` each micro-batch
    issues, less the CPU time ``inside`` a call (already in its measured time); never below 0."""
    _, per_mb = line([float(m) for m in microbatches], seconds)
    return max(0.0, (per_mb - serial_per_microbatch) / max(1, collectives) - inside)


def dp_text(dp: dict) -> str:
    return ", ".join(f"m={k}: {t * 1e3:.2f} ms" for k, t in zip(dp["microbatches"],
                                                               dp["seconds"])) + median_text(dp)


def checkpoint_fit(microbatches: list[int], seconds: list[float], serial_per_microbatch: float,
                   recomputed_kernels: float, per_kernel: float, regions: int) -> float:
    """Seconds each checkpointed region costs a micro-batch beyond the kernels it recomputes:
    the slope of the recomputing steps beyond the serial one, less ``recomputed_kernels``
    launches at ``per_kernel``, shared by its ``regions``; never below 0."""
    _, per_mb = line([float(m) for m in microbatches], seconds)
    return max(0.0, (per_mb - serial_per_microbatch - recomputed_kernels * per_kernel)
               / max(1, regions))


def median_text(steps: dict) -> str:
    """The median of the same steps, for the record (absent from older measurements)."""
    return ("; median " + ", ".join(f"{t * 1e3:.2f}" for t in steps["median"]) + " ms"
            if "median" in steps else "")


def terms(m: dict, eager: dict, about: str) -> dict:
    """The CPU constants of the profile (``hook_overhead``, ``sync_overhead``, and where they
    were measured ``corun``, ``collective_overhead``, ``checkpoint_overhead``), each with its
    source, from :func:`edu3d.bench.calibration.measure`'s ``m`` and the serial fit ``eager``
    (:func:`edu3d.bench.profile_fit.eager_fit`)."""
    n, dp = m["collectives"]["ranks"], m["collectives"]["data_parallel"]
    hooks = hook_fit(dp["microbatches"], dp["seconds"], eager["per_microbatch"],
                     m["eager"]["tensors"])
    sync = sync_fit(dp["microbatches"], dp["seconds"], eager["per_step"], m["eager"]["tensors"])
    together = m["collectives"].get("together")  # absent: measured before it was
    shared = together and corun_fit(together.get("median", together["seconds"]),
                                    m["eager"]["seconds"])
    tp = m["collectives"].get("tensor_parallel")  # absent: measured before it was
    inside = [p[3] for k in ("all_reduce", "all_gather", "reduce_scatter")
              for p in m["collectives"]["ops"].get(k, [])[:1] if len(p) > 3]
    wrap = collective_fit(tp["microbatches"], tp["seconds"], eager["per_microbatch"],
                          tp["collectives"], sum(inside) / max(1, len(inside))) if tp else None
    rec = m.get("recompute")  # absent: measured before it was
    extra = rec and rec["kernels"] - m["eager"]["kernels"]
    region = rec and checkpoint_fit(rec["microbatches"], rec["seconds"], eager["per_microbatch"],
                                    extra, eager["per_kernel"], rec["regions"])
    return {
        "hook_overhead": constant(hooks, "s per parameter tensor per micro-batch",
                                  f"{about}: the same Trainer steps on {n} data-parallel ranks "
                                  f"of that launch ({dp_text(dp)}): "
                                  f"{(hooks * m['eager']['tensors'] + eager['per_microbatch']) * 1e6:.0f}"
                                  f" us per micro-batch against {eager['per_microbatch'] * 1e6:.0f} "
                                  f"serially, over {m['eager']['tensors']} parameter tensors "
                                  "(the gradient hooks data parallelism adds to every backward)"),
        "sync_overhead": constant(sync, "s per parameter tensor per step", (
            f"{about}: the same data-parallel Trainer steps ({dp_text(dp)}): the intercept of "
            f"t = per_step + m x per_microbatch, {(sync * m['eager']['tensors'] + eager['per_step']) * 1e6:.0f}"
            f" us against {eager['per_step'] * 1e6:.0f} serially, over {m['eager']['tensors']} "
            "parameter tensors (what a data-parallel step costs once per step beyond its "
            "hooks: the last buckets reduced, the main thread's share of the collectives)")),
        **({"corun": constant(shared, "ratio", (
            f"{about}: the same serial Trainer steps run on all {n} ranks of that launch at "
            f"once, on the wall clock ({dp_text(together)}): their median against the fastest "
            f"alone ({', '.join(f'{t * 1e3:.2f}' for t in m['eager']['seconds'])} ms, CPU time): "
            "what a rank's work meets beside the others (shared caches, the cores' time with "
            "their helper threads, the loop's steps' spread, whatever else runs here)"))}
           if together else {}),
        **({"collective_overhead": constant(wrap, "s per collective", (
            f"{about}: the same Trainer steps on {n} tensor-parallel ranks with sequence "
            f"parallelism ({dp_text(tp)}): the slope beyond the serial one, shared by the "
            f"{tp['collectives']} collectives a micro-batch issues (edu3d.plan.trainer_comm."
            f"count), less the {sum(inside) / max(1, len(inside)) * 1e6:.0f} us of this "
            "thread's CPU inside a small call (in its measured time already): what a rank's "
            "host spends around each collective (autograd wrappers, copies, waking up)"))}
           if tp else {}),
        **({"checkpoint_overhead": constant(region, "s per recomputed region per micro-batch", (
            f"{about}: the serial Trainer steps again with every block's attention core "
            f"checkpointed ({dp_text(rec)}): the slope beyond the serial one, less the "
            f"{extra:g} kernels they recompute at the launch overhead, over {rec['regions']} "
            "regions a micro-batch (torch.utils.checkpoint's saved-tensor hooks, the inputs "
            "and RNG state kept, the forward re-run from Python)"))} if rec else {}),
    }


def constant(value: float, unit: str, source: str) -> dict:
    """A profile constant: ``{"value", "unit", "source"}``."""
    return {"value": value, "unit": unit, "source": source}


