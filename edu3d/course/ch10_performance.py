"""Chapter 10 (performance and debugging): the runs its notebook launches, and the measures
it draws.

After reading this file you should know how the chapter's numbers are made, each from a
real run of the one :class:`~edu3d.train.trainer.Trainer`:

* :func:`profile_step` wraps one training step in ``torch.profiler`` on every rank, writes
  the profiler's Chrome trace into the run folder (Perfetto opens it) and returns the
  per-operator table and the top-level events, each given a phase (forward, backward,
  optimizer, communication) by where it falls in the step;
* :func:`measure_layouts` trains several layouts inside one launch (every layout of the
  launched world size is a new :class:`~edu3d.distributed.mesh.Mesh` over the same processes) and times
  each step from a barrier to the slowest rank (:func:`edu3d.bench.harness.time_once`);
* :func:`breakdown` cuts a traced step into **compute**, **exposed communication** (the
  part of a collective no forward or backward runs under) and **idle** (bubble, waiting);
  :func:`budget` is the median step's, whole: the bar the chapter draws, and the numbers it
  prints;
* :func:`calibrate` fits this machine's constants from the chapter's runs (the serial step,
  gloo's alpha and bandwidth), which :mod:`edu3d.course.ch10_performance_predict` turns into
  a profile for the course's one performance model (:func:`edu3d.plan.step.predict`): the
  prediction the control panel draws.

The chapter's debugging half, the three classic hangs, is :mod:`edu3d.course.ch10_performance_hangs`.
"""

from __future__ import annotations

import os
import statistics
import time

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from edu3d.bench import harness as bench
from edu3d.bench.bench_comm import fit_alpha_beta
from edu3d.bench.bench_dp import dp_worker
from edu3d.course import lesson_args
from edu3d.distributed import trace
from edu3d.config.layout import Layout, LayoutError
from edu3d.distributed.mesh import Mesh
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.train.data import SyntheticCorpus
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer

#: the layouts the chapter sweeps: name -> (dp, tp, pp)
LAYOUTS = {"dp1": (1, 1, 1), "dp2": (2, 1, 1), "tp2": (1, 2, 1), "pp2": (1, 1, 2),
           "dp4": (4, 1, 1), "dp2-tp2": (2, 2, 1), "dp2-pp2": (2, 1, 2), "tp2-pp2": (1, 2, 2)}
#: overlap off and on for data parallelism: all-reduce after backward in one flat buffer,
#: or small buckets launched as their gradients are ready (edu3d's DDP)
OVERLAP = {"off": {"dp_impl": "flat"}, "on": {"dp_impl": "bucketed", "bucket_mb": 0.1}}
COMPUTE_OPS = ("F", "B", "I", "W")
#: a pipeline receive mostly waits for the previous stage to compute: the bubble, not the wire
WAITS = ("recv", "RECV_F", "RECV_B")


def default_microbatches(name: str) -> int:
    """The micro-batches the chapter gives layout ``name``: 2 per pipeline stage, else 1."""
    pp = LAYOUTS[name][2]
    return 2 * pp if pp > 1 else 1


def layout_options(name: str, overlap: str = "on", microbatches: int | None = None) -> dict:
    """Trainer options of a layout by name (``"dp2-tp2"``), with overlap on or off."""
    dp, tp, pp = LAYOUTS[name]
    opts = {"dp": dp, "tp": tp, "pp": pp, **OVERLAP[overlap]}
    opts["microbatches"] = microbatches or default_microbatches(name)
    return opts


def runnable_microbatches(name: str, most: int = 8) -> list[int]:
    """The micro-batch counts (1 to ``most``) a live run of layout ``name`` accepts, by the
    trainer's own rules (:func:`edu3d.train.preflight.check_args`): each data-parallel rank's
    share of the global batch must split into them. The cost model predicts any count."""
    dp, tp, pp = LAYOUTS[name]
    ok = []
    for m in range(1, most + 1):
        try:
            check_args(lesson_args(dp=dp, tp=tp, pp=pp, microbatches=m))
        except LayoutError:
            continue
        ok.append(m)
    return ok


# ---- interval arithmetic on one rank's events ---------------------------------------------------
def union(spans) -> list[tuple[float, float]]:
    """Merge ``(t0, t1)`` spans into disjoint sorted ones."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(spans) -> float:
    return sum(b - a for a, b in union(spans))


def minus(spans, cut) -> list[tuple[float, float]]:
    """The parts of ``spans`` outside ``cut``."""
    cut, out = union(cut), []
    for a, b in union(spans):
        for c, d in cut:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def breakdown(events: list[dict], case: str | None = None) -> dict:
    """Per step, averaged over ranks: ``step_ms`` (first to last event of the step),
    ``compute_ms`` (F, B, I, W, optimizer), ``comm_ms`` (every collective and send, whole),
    ``exposed_ms`` (communication no F/B/I/W runs under) and ``idle_ms`` (the rest: the
    bubble, and waiting, a pipeline receive's included). Returns
    ``{"steps": {step: {...}}, "median": {...}, "median_step": step}``: ``median`` is the
    median step of those after the first (which warms up), whole, so its parts add up to its
    step; the median of each part alone would not (one step's compute, another's idle)."""
    sel = [e for e in events if (case is None or e.get("case") == case) and not e.get("sim")
           and e.get("lane") in ("compute", "comm") and e.get("step") is not None]
    per: dict[int, list[dict]] = {}
    for (step, rank) in sorted({(e["step"], e["rank"]) for e in sel}):
        evs = [e for e in sel if e["step"] == step and e["rank"] == rank]
        window = (min(e["t0"] for e in evs), max(e["t1"] for e in evs))
        fb = [(e["t0"], e["t1"]) for e in evs if e["lane"] == "compute" and e["op"] in COMPUTE_OPS]
        comm = [(e["t0"], e["t1"]) for e in evs
                if e["lane"] == "comm" and e["op"] not in WAITS]
        exposed = minus(comm, fb)
        compute = minus([(e["t0"], e["t1"]) for e in evs if e["lane"] == "compute"], exposed)
        row = {"step_ms": (window[1] - window[0]) / 1e3, "compute_ms": length(compute) / 1e3,
               "comm_ms": length(comm) / 1e3, "exposed_ms": length(exposed) / 1e3}
        row["idle_ms"] = max(row["step_ms"] - row["compute_ms"] - row["exposed_ms"], 0.0)
        per.setdefault(step, []).append(row)
    steps = {s: {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
             for s, rows in per.items()}
    later = sorted(steps)[1:] or sorted(steps)
    ranked = sorted(later, key=lambda s: steps[s]["step_ms"])  # the lower middle if even
    middle = ranked[(len(ranked) - 1) // 2] if ranked else None
    return {"steps": steps, "median": steps.get(middle, {}), "median_step": middle}


def budget(events: list[dict], case: str | None = None) -> dict:
    """The step budget chapter 10 draws and prints for ``case`` (ms): ``compute``,
    ``exposed``, ``idle`` of the median step (:func:`breakdown`), ``comm`` (its whole
    communication) and ``step``, their sum: the length of the bar."""
    med = breakdown(events, case)["median"]
    row = {"compute": med["compute_ms"], "exposed": med["exposed_ms"], "idle": med["idle_ms"],
           "comm": med["comm_ms"]}
    row["step"] = row["compute"] + row["exposed"] + row["idle"]
    return row


# ---- the runs -----------------------------------------------------------------------------------
def _trainer(mesh, opts: dict):
    args = lesson_args(**opts)
    config = model_config(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    return Trainer(GPT(config, seed=args.training.seed), mesh, args), corpus, args


def _timed_steps(trainer, corpus, args, steps: int, group=None, alone: bool = False):
    """Step times (s, slowest rank) of ``steps`` steps; ``alone``: this rank runs by itself."""
    times = []
    for s in range(1, steps + 1):
        x, y = corpus.batch(s, args.batch.global_batch)
        if alone:
            t0 = time.perf_counter()
            trainer.step(x, y, s)
            times.append(time.perf_counter() - t0)
        else:
            times.append(bench.time_once(lambda: trainer.step(x, y, s), group))
    return times


def measure_layouts(mesh, names: list[str], steps: int = 3, overlap: str = "on",
                    cases: dict | None = None) -> list[dict]:
    """Train each named layout (of this launch's world size, or ``dp1`` on rank 0 while the
    others wait) for ``steps`` steps, traced as ``case=name``; ``cases`` adds named option
    sets (``{"overlap off": {...}}``) run in the launched layout. Returns one row per case:
    its step times (slowest rank) and tokens/s (median of the steps after the first)."""
    world = dist.get_world_size()
    todo = [(n, layout_options(n, overlap)) for n in names] + list((cases or {}).items())
    rows = []
    for name, opts in todo:
        layout = Layout(dp=opts.get("dp", mesh.layout.dp), tp=opts.get("tp", mesh.layout.tp),
                        pp=opts.get("pp", mesh.layout.pp))
        opts = {**opts, "dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
        alone = layout.world_size == 1
        times = None
        with trace.current().context(case=name):
            if alone:
                if dist.get_rank() == 0:
                    trainer, corpus, args = _trainer(None, opts)
                    times = _timed_steps(trainer, corpus, args, steps, alone=True)
                dist.barrier()
            else:
                if layout.world_size != world:
                    raise ValueError(f"{name} needs {layout.world_size} ranks; this launch has "
                                     f"{world}")
                sub = mesh if layout == mesh.layout else Mesh.build(layout)
                trainer, corpus, args = _trainer(sub, opts)
                times = _timed_steps(trainer, corpus, args, steps)
                if sub is not mesh:  # its groups must not outlive the process group
                    del trainer
                    sub.release()
        if dist.get_rank() == 0:
            step_s = statistics.median(times[1:] or times)
            tokens = args.batch.global_batch * model_config(args).seq_len  # global batch
            rows.append({"name": name, "world_size": layout.world_size, "options": opts,
                         "step_s": times, "median_s": step_s, "tokens_per_s": tokens / step_s})
    return rows


def profile_step(mesh, opts: dict | None = None, warmup: int = 2, case: str = "profiled") -> dict:
    """Profile one training step with ``torch.profiler`` on every rank (after ``warmup``
    steps). Writes ``torch-profile-rank{R}.json`` (Chrome trace) into the run folder and
    returns ``{"rank", "path", "table", "events"}``: the operators by self CPU time, and
    the top-level events as edu3d trace events (``op`` = phase, ``name`` = the operator),
    times in microseconds since the step began (a barrier just before it)."""
    trainer, corpus, args = _trainer(mesh, opts or {"dp": mesh.layout.dp, "tp": mesh.layout.tp,
                                                    "pp": mesh.layout.pp})
    with trace.current().context(case=case):
        for s in range(1, warmup + 1):
            trainer.step(*corpus.batch(s, args.batch.global_batch), s)
        x, y = corpus.batch(warmup + 1, args.batch.global_batch)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("edu3d:step_start"):
                pass
            trainer.step(x, y, warmup + 1)
    run_dir = os.environ.get("EDU3D_RUN_DIR")
    path = None
    if run_dir:
        path = os.path.join(run_dir, f"torch-profile-rank{mesh.rank}.json")
        prof.export_chrome_trace(path)
    table = [{"name": a.key, "calls": a.count, "self_ms": a.self_cpu_time_total / 1e3,
              "total_ms": a.cpu_time_total / 1e3}
             for a in prof.key_averages()]
    table.sort(key=lambda r: -r["self_ms"])
    return {"rank": mesh.rank, "path": path, "table": table,
            "events": profiler_events(prof.events(), mesh.rank)}


def phase_of(name: str) -> str | None:
    """The phase a top-level profiler event belongs to by its name alone (None: decided by
    where it falls)."""
    low = name.lower()
    if "gloo" in low or "nccl" in low or "c10d" in low or "record_param_comms" in low:
        return "comm"
    if name.startswith("autograd::engine"):
        return "B"
    if name.startswith("Optimizer."):
        return "optimizer"
    return None


def collective_of(name: str) -> str:
    """The edu3d name of a profiled collective (``c10d::allreduce_`` -> ``all_reduce``)."""
    low = name.lower().replace("_", "")
    for op in ("allreduce", "allgather", "reducescatter", "broadcast", "barrier", "send",
               "recv"):
        if op in low:
            return {"allreduce": "all_reduce", "allgather": "all_gather",
                    "reducescatter": "reduce_scatter"}.get(op, op)
    return "all_reduce"


def profiler_events(function_events, rank: int) -> list[dict]:
    """Top-level profiler events as edu3d trace events: each operator before the first
    backward function is forward (``F``), between the first and the last backward (``B``),
    after it the optimizer (clip, norm, AdamW); collectives go to the comm lane."""
    top = [e for e in function_events if e.cpu_parent is None]
    start = next((e.time_range.start for e in top if e.name == "edu3d:step_start"), None)
    top = [e for e in top if e.name != "edu3d:step_start"]
    if not top:
        return []
    start = min(e.time_range.start for e in top) if start is None else start
    backward = [e.time_range.start for e in top if phase_of(e.name) == "B"]
    first_b, last_b = (min(backward), max(backward)) if backward else (float("inf"),) * 2
    out = []
    for e in top:
        t0 = e.time_range.start
        phase = phase_of(e.name) or ("F" if t0 < first_b else "B" if t0 <= last_b
                                     else "optimizer")
        out.append({"rank": rank, "lane": "comm" if phase == "comm" else "compute",
                    "op": collective_of(e.name) if phase == "comm" else phase,
                    "name": e.name, "t0": t0 - start,
                    "t1": e.time_range.end - start})
    return out


def session_two(mesh, steps: int = 3) -> dict:
    """Chapter 10's 2-rank launch: the profile of a dp2 step, dp2 with overlap off and on,
    the 2-rank layouts and dp1 timed, and ``edu3d bench dp`` on the tiny model."""
    profile = profile_step(mesh, {"dp": 2, **OVERLAP["on"]})
    cases = {f"overlap {k}": {"dp": 2, **v} for k, v in OVERLAP.items()}
    overlap = measure_layouts(mesh, [], steps + 3, cases=cases)  # repetitions for a spread
    sweep = measure_layouts(mesh, ["dp1", "dp2", "tp2", "pp2"], steps)
    report = dp_worker(mesh, model="tiny", global_batch=8, reps=3)
    return {"profile": profile, "overlap": overlap, "sweep": sweep, "bench": report}


def session_four(mesh, steps: int = 3) -> dict:
    """Chapter 10's 4-rank launch: dp4 and dp2-tp2 timed."""
    return {"sweep": measure_layouts(mesh, ["dp4", "dp2-tp2"], steps)}


# ---- calibrating the model: this machine's constants from the chapter's runs -----------------
#: the constants until :func:`calibrate` fits them to a run (the model that uses them is
#: :mod:`edu3d.course.ch10_performance_predict`, on :func:`edu3d.plan.step.predict`)
DEFAULT_COSTS = {"serial_ms": 25.0, "alpha_us": 100.0, "gb_per_s": 1.0}


def calibrate(events: list[dict], sweep: list[dict]) -> dict:
    """Cost-model constants from this machine's runs: the serial step (dp1's median) and
    alpha, beta fitted to the synchronous all-reduces of 2 ranks in the trace
    (:func:`edu3d.bench.bench_comm.fit_alpha_beta`)."""
    costs = dict(DEFAULT_COSTS)
    serial = [r for r in sweep if r["name"] == "dp1"]
    if serial:
        costs["serial_ms"] = serial[0]["median_s"] * 1e3
    ar = [e for e in events if e.get("op") == "all_reduce" and e.get("n") == 2
          and e.get("case") in ("tp2", "overlap off") and e.get("bytes")]
    if len({e["bytes"] for e in ar}) >= 2:
        alpha, beta = fit_alpha_beta([e["bytes"] for e in ar],
                                     [(e["t1"] - e["t0"]) / 1e6 for e in ar], 2)
        if alpha > 0 and beta > 0:
            costs["alpha_us"], costs["gb_per_s"] = alpha * 1e6, 1 / beta / 1e9
    return costs


def measure_one(mesh, name: str, overlap: str = "on", microbatches: int | None = None,
                steps: int = 3) -> list[dict]:
    """The control panel's live run: one layout traced as ``case=name``."""
    return measure_layouts(mesh, [], steps, cases={name: layout_options(name, overlap,
                                                                        microbatches)})


def run_layout(name: str, overlap: str = "on", microbatches: int | None = None,
               steps: int = 3, timeout: float = 300):
    """Launch :func:`measure_one` for ``name``; returns ``(row, budget)`` (:func:`budget`)."""
    dp, tp, pp = LAYOUTS[name]
    layout = Layout(dp=dp, tp=tp, pp=pp)
    if layout.world_size == 1:
        layout = Layout(dp=2)  # dp1 runs on rank 0 of a 2-rank launch
    run = launch(measure_one, max(layout.world_size, 2), kwargs={
        "name": name, "overlap": overlap, "microbatches": microbatches, "steps": steps},
        layout=layout, timeout=timeout, echo=False, name=f"perf-{name}")
    return run.results[0][0], budget(run.events(), name)
