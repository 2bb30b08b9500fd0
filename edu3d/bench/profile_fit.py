"""From timings to a hardware profile: the fits behind ``edu3d calibrate``, and the file.

After reading this file you should understand how a handful of measured times become the few
constants a performance model needs, each with its source:

* **a line through times, weighted by relative error** (:func:`line`): a 4-byte collective
  takes microseconds and a 4 MiB one milliseconds; an ordinary least-squares fit would see
  only the large ones. Minimising *relative* residuals ``(t - a - b·x) / t`` weighs every
  measurement alike;
* **the roofline of a matmul** (:func:`matmul_fit`): ``t = c + F / R`` over several shapes.
  ``R`` is the rate a large matmul reaches (on a CPU there is no datasheet peak: the measured
  asymptote *is* the peak, at efficiency 1); ``c`` is what any matmul costs beyond its
  arithmetic. A bare dispatch (a 1x1 matmul) is part of ``c`` and already counted as launch
  overhead, so the rest becomes ``matmul_half_flops = (c - dispatch)·R``: the FLOPs at which
  a matmul reaches half its asymptotic rate (:mod:`edu3d.plan.roofline`'s form);
* **alpha-beta** (:func:`alpha_beta`): a collective of ``S`` bytes over ``n`` ranks takes
  ``alpha·steps + S·factor / bandwidth`` (ring all-reduce ``2(n-1)`` steps and ``2(n-1)/n``
  of the buffer; all-gather and reduce-scatter ``n-1`` and ``(n-1)/n``; a send 1 and 1);
  the fitted ``bandwidth`` is nccl-tests' *bus bandwidth*. Each kind is fitted by itself
  (gloo's reduce-scatter is a full all-reduce), on the median times (the minima's fit is
  kept in the source);
* **eager overhead** (:func:`eager_fit`): a training step of ``m`` micro-batches of a model so
  narrow that its arithmetic is nil takes ``per_step + m·per_microbatch``; the slope over the
  kernels one micro-batch launches (as :mod:`edu3d.plan.kernels` counts them) is the launch
  overhead per kernel, the intercept over the parameter tensors the per-step cost (the
  optimizer, the norm and the clip loop over tensors in eager PyTorch); the same steps on
  data-parallel ranks, less the serial slope, give the hooks' cost per tensor (:func:`hook_fit`)
  and, less the serial intercept, what the step costs once beyond them (:func:`sync_fit`),
  and on tensor-parallel ranks with SP, shared by the collectives a micro-batch issues, what
  the host spends around each beyond the call itself (:func:`collective_fit`);
* **elementwise ops** (:func:`elementwise_fit`): whole blocks timed, less what the model
  already counts for their matmuls, attention and launches, leave the norms, GELU and residual
  adds: the rate at which they moved the model's bytes, as a fraction of the streaming copy's.

:func:`profile_from` assembles the fits into the schema of :mod:`edu3d.plan.hardware` (every
constant ``{"value", "unit", "source"}``), each source saying when, where and with which
torch it was measured, and how it was fitted. Nothing here imports torch: the fits are tested
on synthetic measurements.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from edu3d.bench import cpu_fit
from edu3d.bench.cpu_fit import CalibrationError, constant, line, median_text
from edu3d.plan.hardware import PRECISIONS


# ---- fits --------------------------------------------------------------------------------------
def matmul_fit(shapes: list[tuple[int, int, int]], seconds: list[float],
               dispatch: float) -> dict:
    """``{"rate", "fixed", "half_flops", "worst"}`` of ``t = fixed + 6MNK / rate`` over linear
    layers' forward + backward (three matmuls each) of ``shapes`` (``(M, N, K)``);
    ``dispatch`` is the same at 1x1x1, launch overhead that the model counts per kernel, so a
    matmul's own fixed cost is ``(fixed - dispatch) / 3`` and ``half_flops`` that times the
    rate (at least 1e3); ``worst`` the largest relative error of the fit over the shapes."""
    flops = [6.0 * m * n * k for m, n, k in shapes]
    fixed, slope = line(flops, seconds)
    if slope <= 0:
        raise CalibrationError("matmul times do not grow with their FLOPs: the machine was "
                               "too busy to measure; rerun edu3d calibrate when it is quieter")
    rate, fixed = 1 / slope, max(fixed, 0.0)
    worst = max(abs(fixed + f * slope - t) / t for f, t in zip(flops, seconds))
    return {"rate": rate, "fixed": fixed, "half_flops": max(1e3, (fixed - dispatch) / 3 * rate),
            "worst": worst}


def elementwise_fit(layers: list[dict], rate: float, half_flops: float, attention: float,
                    per_kernel: float) -> dict:
    """``{"bandwidth", "shares"}``: the rate (B/s, in :mod:`edu3d.plan.kernels`' bytes) at which a
    real block's memory-bound ops (norms, GELU, residual adds) ran, from whole blocks timed
    forward + backward (``layers``: ``{"shape", "seconds", "ops": [[kind, flops, bytes,
    kernels]]}``), once the model's own matmul, attention and launch times are taken out;
    ``shares``: that rest's share of each block's time."""
    moved = rest = 0.0
    shares = []
    for layer in layers:
        known = 0.0
        for kind, flops, nbytes, kernels in layer["ops"]:
            known += kernels * per_kernel
            if kind == "matmul" and flops:
                known += (flops + kernels * half_flops) / rate
            elif kind == "attention":
                known += flops / (rate * attention)
            else:
                moved += nbytes
        left = layer["seconds"] - known
        if left <= 0:
            raise CalibrationError(f"a block at {layer['shape']} ran faster than its matmuls, "
                                   "attention and launches: the machine was too busy to "
                                   "measure; rerun edu3d calibrate")
        rest += left
        shares.append(left / layer["seconds"])
    return {"bandwidth": moved / rest, "shares": shares}


def ring(kind: str, n: int) -> tuple[int, float]:
    """Steps and the fraction of the buffer each rank sends, of ``kind`` over ``n`` ranks
    (the ring algorithms' counts, :mod:`edu3d.distributed.algorithms`)."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return n - 1, (n - 1) / n
    if kind == "send_recv":
        return 1, 1.0
    raise CalibrationError(f"collective {kind!r}: choose all_reduce, all_gather, "
                           "reduce_scatter or send_recv")


def alpha_beta(kind: str, n: int, sizes: list[float], seconds: list[float]) -> dict:
    """``{"alpha", "bandwidth", "worst"}``: seconds per ring step and bus bandwidth (B/s) of
    ``t = alpha·steps + S·factor / bandwidth`` for ``kind`` over ``n`` ranks. When noise
    tilts the line (a slope <= 0, or a negative intercept), alpha is the smallest message's
    time per step and the bandwidth the largest message's rate after it."""
    steps, factor = ring(kind, n)
    a, b = line([s * factor for s in sizes], seconds)
    if b <= 0 or a <= 0:
        small, large = min(range(len(sizes)), key=sizes.__getitem__), \
            max(range(len(sizes)), key=sizes.__getitem__)
        a = seconds[small]
        b = max(seconds[large] - a, 1e-12) / (sizes[large] * factor)
    worst = max(abs(a + s * factor * b - t) / t for s, t in zip(sizes, seconds))
    return {"alpha": a / steps, "bandwidth": 1 / b, "worst": worst}


def eager_fit(microbatches: list[int], seconds: list[float], kernels: float,
              tensors: int) -> dict:
    """``{"per_kernel", "per_tensor", "per_microbatch", "per_step"}`` of
    ``t = per_step + m·per_microbatch`` for a model whose micro-batch launches ``kernels``
    kernels and whose optimizer walks ``tensors`` parameter tensors."""
    per_step, per_mb = line([float(m) for m in microbatches], seconds)
    if per_mb <= 0:
        raise CalibrationError("step times do not grow with the micro-batches: the machine "
                               "was too busy to measure; rerun edu3d calibrate")
    per_step = max(per_step, 0.0)
    return {"per_kernel": per_mb / kernels, "per_tensor": per_step / tensors,
            "per_microbatch": per_mb, "per_step": per_step}


# ---- the profile -------------------------------------------------------------------------------
def profile_from(m: dict, about: str) -> dict:
    """The profile (:mod:`edu3d.plan.hardware`'s schema, plus ``cores`` and ``step_overhead``)
    from the measurements ``m`` that :func:`edu3d.bench.calibration.measure` returns; ``about``
    starts every source ("measured by edu3d calibrate on <date>, <host>, <torch>")."""
    mm = {p: matmul_fit([tuple(s) for s in v["shapes"]], v["seconds"], v["dispatch_s"])
          for p, v in m["matmul"].items()}
    main = m["dtype"]  # what this machine trains in: fp32 on a CPU, bf16 on a GPU
    peak = mm[main]["rate"]
    attention = min(1.0, m["attention"]["flops"] / m["attention"]["seconds"] / peak)
    eager = eager_fit(m["eager"]["microbatches"], m["eager"]["seconds"],
                      m["eager"]["kernels"], m["eager"]["tensors"])
    elementwise = elementwise_fit(m["layers"], peak, mm[main]["half_flops"], attention,
                                  eager["per_kernel"])
    n = m["collectives"]["ranks"]
    # a step sums dozens of collectives: its time follows their mean, which a heavy tail (a
    # rank woken late) puts well above the median; profiles measured before kept no mean
    def fitted(i: int) -> dict:  # each kind fitted on column i: 1 median, 2 minimum, 4 mean
        return {k: alpha_beta(k, n, [p[0] for p in v], [p[i if i < len(p) else 1] for p in v])
                for k, v in m["collectives"]["ops"].items()}

    comm, typical, idle = fitted(4), fitted(1), fitted(2)
    stream = 2 * m["stream"]["bytes"] / m["stream"]["seconds"]

    def mm_source(p):
        f = mm[p]
        return (f"{about}: least-squares fit (relative errors) of t = c + 6MNK/R over "
                f"{len(m['matmul'][p]['shapes'])} {p} linear layers, forward + backward (three "
                f"matmuls each, as autograd runs them), M x N x K = "
                f"{', '.join('x'.join(map(str, s)) for s in m['matmul'][p]['shapes'])} "
                f"({m['clock']}, minimum of repetitions): R = {f['rate'] / 1e9:.1f} GFLOP/s, "
                f"c = {f['fixed'] * 1e6:.1f} us, worst shape off by {f['worst']:.0%}")

    peaks = {}
    for p in PRECISIONS:
        if p in mm:
            peaks[p] = constant(mm[p]["rate"], "FLOP/s", mm_source(p) + (
                "; the asymptote R is the peak (a CPU core has no datasheet figure edu3d can "
                "read)" if m["device"] == "cpu" else ""))
        else:
            peaks[p] = constant(None, "FLOP/s", f"{about}: not measured ({p} is not a "
                                                f"precision edu3d trains in on this device)")
    ar, ag = comm["all_reduce"], comm["all_gather"]
    backend = m["collectives"]["backend"]

    def link_source(kind):
        f, pts, best, mid = comm[kind], m["collectives"]["ops"][kind], idle[kind], typical[kind]
        mean = len(pts[0]) > 4
        return (f"{about}: {backend} {kind} on {n} ranks of one real edu3d launch, repeated "
                "between slices of arithmetic as in a step (no barrier), "
                f"{'mean' if mean else 'median'} of the repetitions at "
                f"{', '.join(f'{p[0]:,.0f}' for p in pts)} bytes, fitted as "
                f"t = alpha x steps + S x factor / busbw (ring counts): alpha = "
                f"{f['alpha'] * 1e6:.1f} us per step, busbw = {f['bandwidth'] / 1e9:.3f} GB/s, "
                f"worst size off by {f['worst']:.0%}"
                + (f"; the mean, because a step sums dozens of collectives and a sum follows "
                   f"their mean: the median of the same repetitions gives "
                   f"{mid['alpha'] * 1e6:.1f} us and {mid['bandwidth'] / 1e9:.3f} GB/s"
                   if mean else "")
                + f"; their minimum (the machine with nothing else running) gives "
                f"{best['alpha'] * 1e6:.1f} us and {best['bandwidth'] / 1e9:.3f} GB/s")

    link = {"alpha": constant(ar["alpha"], "s", link_source("all_reduce")),
            "bandwidth": constant(ar["bandwidth"], "B/s", link_source("all_reduce")),
            "gather_bandwidth": constant(ag["bandwidth"], "B/s", link_source("all_gather"))}
    one = "one machine: no second node, so the inter-node link repeats the intra-node one"
    out = {
        "name": m["name"], "description": m["description"],
        "peak_flops": peaks,
        "mem_bandwidth": constant(stream, "B/s", f"{about}: a streaming copy of "
                                  f"{m['stream']['bytes'] / 2**20:.0f} MiB, read + write over the "
                                  f"minimum of repetitions ({m['clock']})"),
        "memory": constant(m["memory_bytes"], "B", f"{about}: {m['memory_from']}"),
        "matmul_efficiency": constant(1.0, f"fraction of {main} peak", f"{about}: the peak "
                                      f"is the measured asymptote of {main} matmuls, so large "
                                      "ones reach it by definition"),
        "matmul_half_flops": constant(mm[main]["half_flops"], "FLOP", mm_source(main) + (
            f"; (c - {m['matmul'][main]['dispatch_s'] * 1e6:.1f} us of the same layer at 1x1x1, "
            "launches the model counts per kernel) / 3 matmuls x R")),
        "attention_efficiency": constant(min(1.0, attention), f"fraction of {main} peak",
                                         f"{about}: scaled_dot_product_attention, causal, "
                                         f"forward + backward at {m['attention']['shape']}: "
                                         "3.5 x 2·b·s²·heads·head_dim FLOPs (edu3d.plan.kernels' "
                                         f"count) in {m['attention']['seconds'] * 1e3:.2f} ms "
                                         f"({m['clock']})"),
        "sustained": constant(1.0, "fraction", f"{about}: every rate here is the minimum "
                              "time of repeated real kernels on this machine, which is what a "
                              "run sustains (a GPU profile's fraction is fitted to published "
                              "runs instead)"),
        "mem_efficiency": constant(min(1.0, max(0.05, elementwise["bandwidth"] / stream)),
                                   "fraction of mem_bandwidth", elementwise_source(
                                       m, elementwise, stream, about)),
        "kernel_overhead": constant(eager["per_kernel"], "s", eager_source(m, eager, about)),
        "step_overhead": constant(eager["per_tensor"], "s per parameter tensor",
                                  eager_source(m, eager, about)),
        **cpu_fit.terms(m, eager, about),
        "runtime_memory": constant(m["collectives"]["runtime_bytes"], "B", f"{about}: resident "
                                   f"memory of a {backend} rank after init_process_group "
                                   "(VmRSS: Python, torch, the backend), before any tensor"),
        "allocator_factor": constant(m["allocator_factor"], "ratio", f"{about}: "
                                     f"{m['allocator_from']}"),
        "gpus_per_node": constant(m["ranks_per_node"], "count", f"{about}: "
                                  f"{m['ranks_per_node_from']}"),
        "link": {"intra": link,
                 "inter": {**{k: constant(v["value"], v["unit"], v["source"] + "; " + one)
                              for k, v in link.items()},
                           "falloff": constant(0.0, "fraction per doubling", f"{about}: {one}")}},
    }
    if m["device"] == "cpu":
        out["cores"] = constant(m["cores"], "count", f"{about}: os.sched_getaffinity, the "
                                "cores this process (and so each rank) may run on")
    for kind in comm:
        out.setdefault("collectives", {})[kind] = {
            "alpha": constant(comm[kind]["alpha"], "s", link_source(kind)),
            "bandwidth": constant(comm[kind]["bandwidth"], "B/s", link_source(kind))}
    return out


def elementwise_source(m: dict, fit: dict, stream: float, about: str) -> str:
    blocks = "; ".join(f"{b['shape']}: {b['seconds'] * 1e3:.2f} ms" for b in m["layers"])
    return (f"{about}: whole GPT blocks forward + backward ({blocks}, {m['clock']}) less the "
            f"model's matmul, attention and launch times leave "
            f"{', '.join(f'{x:.0%}' for x in fit['shares'])} of them to the memory-bound ops "
            "(norms, GELU, residual adds), which moved edu3d.plan.kernels' bytes at "
            f"{fit['bandwidth'] / 1e9:.2f} GB/s: this fraction of the streaming copy's "
            f"{stream / 1e9:.1f} GB/s (eager elementwise kernels, GELU's erf above all, are "
            "bound by arithmetic on a CPU core, not by memory); kept within [0.05, 1]")


def eager_source(m: dict, eager: dict, about: str) -> str:
    e = m["eager"]
    return (f"{about}: serial edu3d Trainer steps of {e['model']} (arithmetic nil), "
            f"{', '.join(f'm={k}: {t * 1e3:.2f} ms' for k, t in zip(e['microbatches'], e['seconds']))}"
            f" ({m['clock']}, the fastest of the steps of edu3d.train.loop.loop, as edu3d train "
            f"runs them{median_text(e)}), fitted t = per_step + m x per_microbatch: "
            f"{eager['per_microbatch'] * 1e6:.0f} us per micro-batch over the {e['kernels']:g} "
            f"kernels edu3d.plan.kernels counts in it = {eager['per_kernel'] * 1e6:.2f} us per kernel "
            f"(it launches {e['dispatches']} aten ops: {eager['per_microbatch'] / e['dispatches'] * 1e6:.2f}"
            f" us each); {eager['per_step'] * 1e6:.0f} us per step over its {e['tensors']} "
            f"parameter tensors = {eager['per_tensor'] * 1e6:.2f} us per tensor (optimizer, norm, "
            "clip)")


# ---- where it lives ----------------------------------------------------------------------------
def write(profile: dict, path: Path) -> Path:
    """Write ``profile`` to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile, indent=1) + "\n")
    os.replace(tmp, path)
    return path
