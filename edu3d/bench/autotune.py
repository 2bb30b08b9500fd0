"""``edu3d tune``: the planner's best layouts, each run for a few steps, and the cost model graded.

After reading this file you should understand how an auto-tuner turns the planner's guesses
into measurements, and how well the guesses ranked:

* **candidates** come from the planner (:func:`edu3d.plan.search.search`): every layout
  ``dp x tp x pp`` (``cp``, ``ep`` where the model has them) of the world size, ZeRO stage,
  micro-batch size and count, and recomputation, ranked by its predicted step time. The top
  of that list is usually one layout in a dozen near-identical variants, so :func:`pick`
  takes the best row of every layout first, then of every ZeRO stage, micro-batch size and
  recomputation of those layouts: the tuner compares choices, not copies. With several
  ``bucket_mb`` sizes, every data-parallel candidate without ZeRO is tried at each (the
  model tells them apart: edu3d's buckets all-reduce while the backward runs, all but the
  last);
* **the performance model** (:mod:`edu3d.bench.predicted`): every candidate's step time
  from :func:`edu3d.plan.step.predict` on this machine's profile (``edu3d calibrate`` writes
  it; without one, a shipped stand-in and a note saying how to make one);
* **measurement**: every candidate runs on the same ``N`` ranks, one after another, in
  **one launch** (start-up paid once): each builds its mesh's process groups
  (:meth:`~edu3d.distributed.mesh.Mesh.build`, reused by the candidates of the same layout),
  the library's :class:`~edu3d.train.trainer.Trainer` and :func:`edu3d.train.loop.loop`, as
  ``edu3d train`` does; the first ``warmup`` steps are dropped, a step's time is its slowest
  rank's, and the candidate's time is the median step (its fastest is kept too: what other
  processes' load moves least). Memory is the fullest rank's peak:
  CUDA's ``max_memory_allocated`` on a GPU, the tracked tensors (weights, gradients,
  optimizer state, and the step's peak of activations: ``Trainer.stats``) on CPU. Rank 0
  reports each candidate as it finishes (one ``@tune`` JSON line), so the parent prints
  progress, and a candidate that fails loses only itself: the next launch goes on from the
  one after it;
* **the grade**: Spearman's rank correlation between predicted and measured step times
  (:mod:`edu3d.bench.ranking`: 1 = the model ordered them perfectly, 0 = no better than
  chance, ties averaged), each candidate's error (predicted over measured, minus 1) and their
  median, and the candidate it misranked most.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import statistics
import sys
from typing import Callable

import torch
import torch.distributed as dist

from edu3d.distributed import runtime
from edu3d.config.layout import Layout, LayoutError
from edu3d.distributed.mesh import Mesh
from edu3d.launch import LaunchError, launch
from edu3d.model.gpt import GPT
from edu3d.plan import fit
from edu3d.plan import search as plan_search
from edu3d.plan.estimate import setup_dict, spec_of
from edu3d.plan.hardware import Profile
from edu3d.config.sections import Run
from edu3d.train.preflight import PRESET_NAMES, check_args, model_config
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import loop
from edu3d.train.trainer import Trainer
from edu3d.bench import predicted
from edu3d.bench.ranking import grade

MARK = "@tune "  # rank 0's report lines, read by :func:`measure`
RANKS_PER_CORE = 4  # beyond this, ranks mostly wait for a core (train.preflight.oversubscribed)


# ---- the machine -------------------------------------------------------------------------------
def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gpu_count() -> int:
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def max_ranks() -> int:
    """The most ranks this machine hosts: one per GPU, or a few per CPU core."""
    return max(gpu_count() if fit.on_gpus(1) else 0, RANKS_PER_CORE * cores())


def cluster_for(gpus: int, gpu_mem_gb: float | None = None) -> plan_search.Cluster:
    """The planner's machine for the candidates' memory: ``gpus`` ranks on one node, memory
    per rank ``gpu_mem_gb`` (default 80 GB on a GPU, the available host memory shared by the
    ranks on CPU). Their times come from the performance model (:mod:`.predicted`)."""
    if fit.on_gpus(gpus):
        return plan_search.Cluster(gpus, gpu_mem_gb or 80.0, gpus_per_node=gpus)
    if gpu_mem_gb is None:
        gpu_mem_gb = (fit.available_memory() or 8e9) / gpus / 1e9
    return plan_search.Cluster(gpus, gpu_mem_gb, gpus_per_node=gpus, usable=1.0)


def check_request(model: str, gpus: int, gpu_mem_gb: float | None = None, steps: int = 3,
                  top: int = 8, warmup: int = 1) -> None:
    """Refuse (``ValueError``, one line) what cannot be tuned here, before any process."""
    if model not in PRESET_NAMES:
        raise ValueError(f"--model {model!r}: edu3d tune trains the course's GPTs; choose one "
                         f"of {', '.join(PRESET_NAMES)}")
    limit = max_ranks()
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= limit:
        raise ValueError(f"--gpus {gpus}: this machine hosts 1 to {limit} ranks ("
                         f"{gpu_count() or 'no'} GPU{'' if gpu_count() == 1 else 's'}, "
                         f"{cores()} CPU core{'' if cores() == 1 else 's'})")
    if gpu_mem_gb is not None and not (math.isfinite(gpu_mem_gb) and gpu_mem_gb > 0):
        raise ValueError(f"--gpu-mem {gpu_mem_gb}: must be a number of GB > 0 (e.g. 80)")
    for flag, value, low in (("--steps", steps, 1), ("--top", top, 1), ("--warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{flag} {value}: must be an integer >= {low}")


# ---- the candidates ------------------------------------------------------------------------------
def layout_key(st) -> tuple:
    return (st.layout.dp, st.layout.tp, st.layout.pp, st.layout.cp, st.layout.ep)


def pick(rows: list[dict], top: int) -> list[dict]:
    """Up to ``top`` of the planner's ``rows`` (best first), varied: the best row of each
    layout, then, in turns, the best row that brings a layout a ZeRO stage, a micro-batch
    size or a recomputation it does not have yet, then the rest in the planner's order;
    returned in the planner's order."""
    chosen: list[int] = []
    top = min(top, len(rows))  # --top 1000000000 means every row, not a billion turns
    turns = [lambda st: (layout_key(st), st.parallel.zero), lambda st: (layout_key(st), st.micro_batch),
             lambda st: (layout_key(st), st.memory.recompute)]

    def first_new(key) -> int | None:
        seen = {key(rows[i]["setup"]) for i in chosen}
        return next((i for i, r in enumerate(rows)
                     if i not in chosen and key(r["setup"]) not in seen), None)

    for key in [layout_key] * top + turns * top + [lambda st: st] * top:
        i = first_new(key) if len(chosen) < top else None
        if i is not None:
            chosen.append(i)
    return [rows[i] for i in sorted(chosen)]


def label(st, bucket_mb: float | None = None) -> str:
    """``dp2 tp1 pp1 zero1 m2x2 rec none`` (micro-batches x their size; cp/ep when used)."""
    axes = f"dp{st.layout.dp} tp{st.layout.tp} pp{st.layout.pp}" + "".join(
        f" {k}{v}" for k, v in (("cp", st.layout.cp), ("ep", st.layout.ep)) if v > 1)
    return (f"{axes} zero{st.parallel.zero} m{st.microbatches}x{st.micro_batch} "
            f"rec {st.memory.recompute}"
            + (f" bucket {bucket_mb:g}MB" if bucket_mb is not None else ""))


def options_for(base: Run, st, steps: int, bucket_mb: float) -> Run:
    """``edu3d train``'s options that run the planner's setup ``st`` (checked)."""
    lay, par = st.layout, st.parallel
    args = base.replace(
        dp=lay.dp, tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep, zero=par.zero,
        microbatches=st.microbatches, sp=par.sp, recompute=st.memory.recompute,
        schedule=par.schedule, precision=st.precision.dtype, grad_reduce=par.grad_reduce,
        bucket_mb=bucket_mb, steps=steps, json=True)
    check_args(args)
    return args


def train_command(args: Run) -> str:
    """The ``edu3d train`` command line that runs ``args`` (the options that differ from the
    defaults), so a learner can rerun one candidate alone."""
    out = ["edu3d train"]
    defaults = Run().flat()
    for key, value in args.flat().items():
        if key == "json" or value == defaults[key]:
            continue
        if key == "freeze":
            value = ",".join(value)
        flag = "--" + key.replace("_", "-")
        out.append(flag if value is True else f"{flag} {value:g}" if isinstance(value, float)
                   else f"{flag} {value}")
    return " ".join(out)


def plan(base: Run, gpus: int, gpu_mem_gb: float | None = None, top: int = 8,
         steps: int = 4, bucket_mb=(25.0,), profile: Profile | None = None) -> dict:
    """The candidates to run: ``{"cluster", "candidates": [...], "skipped": [...]}``; each
    candidate has its label, setup, the predicted step time (on ``profile``, default
    :func:`.predicted.profile_for`'s) and bytes, and the options."""
    cluster = cluster_for(gpus, gpu_mem_gb)
    precision = "bf16" if fit.on_gpus(gpus) else "fp32"
    spec = spec_of(base)
    if profile is None:
        profile, _ = predicted.profile_for(None, "cuda" if fit.on_gpus(gpus) else "cpu")
    rows = predicted.rows(spec, cluster, base.batch.global_batch, precision,
                          base.parallel.cp_impl, profile)
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        need = min((r["memory"]["total_bytes"] for r in rows), default=0.0)
        raise ValueError(f"--gpu-mem {cluster.gpu_mem_gb:g}: no layout of {spec.name} fits "
                         f"{gpus} rank(s) of {cluster.gpu_mem_gb:g} GB (the smallest needs "
                         f"{need / 1e9:.4f} GB); raise --gpu-mem or --gpus")
    def bucketed(r) -> bool:  # plain data parallelism: its gradients go in buckets
        lay = r["setup"].layout
        return r["setup"].parallel.zero == 0 and lay.dp * lay.cp > 1

    picked = pick(fitting, top)
    if len(bucket_mb) > 1 and not any(map(bucketed, picked)):  # sizes asked for: try them
        picked = [r for r in fitting if r in picked or r is next(filter(bucketed, fitting),
                                                                  None)]
    out, skipped = [], []
    for r in picked:
        st = r["setup"]
        sizes = bucket_mb if bucketed(r) else (None,)
        for size in sizes:
            name = label(st, size if len(bucket_mb) > 1 else None)
            try:
                args = options_for(base, st, steps, size or base.parallel.bucket_mb)
                if not fit.on_gpus(gpus):
                    fit.check_fit(spec, st)  # the ranks share this host's memory
            except (LayoutError, ValueError) as err:
                skipped.append({"label": name, "reason": str(err).splitlines()[0]})
                continue
            time = predicted.time_of(spec, args, profile) if size else r["time"]
            out.append({"label": name, "setup": setup_dict(st),
                        "bucket_mb": size, "predicted_step_s": time["total"],
                        "predicted_parts_s": {k: v for k, v in time.items() if k != "total"},
                        "predicted_bytes": r["memory"]["total_bytes"],
                        "planner_fits": r["fits"], "command": train_command(args),
                        "options": args.flat()})
    return {"cluster": dataclasses.asdict(cluster), "candidates": out, "skipped": skipped,
            "layouts_searched": len(rows), "profile": profile.name}


# ---- the launched ranks ------------------------------------------------------------------------
class OnDevice:
    """The corpus with its batches on this rank's GPU (pinned, copied without waiting)."""

    def __init__(self, corpus: SyntheticCorpus):
        self.corpus = corpus

    def batch(self, step: int, rows: int):
        return tuple(t.pin_memory().to(runtime.device(), non_blocking=True)
                     for t in self.corpus.batch(step, rows))


def worker(mesh, runs: list[dict], warmup: int, first: int = 0) -> None:
    """Launch target: candidates ``first, first+1, ...`` of ``runs`` (options as dicts), one
    after another on these ranks; rank 0 prints one ``@tune`` JSON line as each starts and
    ends (median step of the slowest rank after ``warmup`` steps, the fullest rank's peak)."""
    cuda = dist.is_initialized() and dist.get_backend() == "nccl"
    meshes = {mesh.layout: mesh}
    try:
        for i in range(first, len(runs)):
            measure_one(i, Run.of(**runs[i]), meshes, warmup, cuda)
    finally:
        for m in meshes.values():
            if m is not mesh:
                m.release()  # no group may outlive the process group


def measure_one(i: int, args: Run, meshes: dict, warmup: int, cuda: bool) -> None:
    """Candidate ``i`` on these ranks (its mesh built once per layout, kept in ``meshes``)."""
    layout = args.layout
    if layout not in meshes:
        meshes[layout] = Mesh.build(layout)
    rank = dist.get_rank()
    if rank == 0:
        print(MARK + json.dumps({"start": i}), flush=True)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    config = model_config(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    trainer = Trainer(GPT(config, seed=args.training.seed).to(runtime.device()), meshes[layout],
                      args)
    records = loop(trainer, OnDevice(corpus) if cuda else corpus, args)
    tokens = args.batch.global_batch * config.seq_len
    seconds = torch.tensor([tokens / r["tokens_per_s"] for r in records],
                           dtype=torch.float64, device=runtime.device())
    peak = torch.tensor([float(torch.cuda.max_memory_allocated()) if cuda else
                         float(records[-1]["mem_bytes"]["total"])],
                        dtype=torch.float64, device=runtime.device())
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # bookkeeping: the slowest rank's
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    timed = seconds.tolist()[warmup:]
    step_s = statistics.median(timed)
    if rank == 0:
        print(MARK + json.dumps({
            "done": i, "step_s": step_s, "fastest_s": min(timed), "tokens_per_s": tokens / step_s,
            "peak_bytes": int(peak.item()), "steps_timed": len(records) - warmup,
            "loss": records[-1]["loss"]}), flush=True)
    del trainer, records
    gc.collect()


def measure(candidates: list[dict], gpus: int, warmup: int,
            progress: Callable[[str], None] | None = None, timeout: float = 600) -> None:
    """Run every candidate on ``gpus`` ranks (filling in ``measured`` or ``error``); one
    launch, and one more after each candidate that fails."""
    runs = [c["options"] for c in candidates]
    n, first = len(runs), 0
    say = progress or (lambda line: None)
    while first < n:
        now = {"i": first}

        def echo(rank, stream, line):
            if rank == 0 and line.startswith(MARK):
                event = json.loads(line[len(MARK):])
                if "start" in event:
                    now["i"] = event["start"]
                    return
                c = candidates[event.pop("done")]
                c["measured"] = event
                say(f"candidate {now['i'] + 1}/{n}: {c['label']} ... "
                    f"{event['step_s'] * 1e3:.1f} ms/step, {event['tokens_per_s']:,.0f} tokens/s")

        try:
            launch(worker, gpus, args=(runs, warmup, first), layout=Layout(dp=gpus),
                   timeout=timeout, echo=echo, name="tune")
            return
        except LaunchError as err:
            c = candidates[now["i"]]
            if "measured" in c:  # it finished; what failed came after it
                now["i"] += 1
                if now["i"] == n:
                    return
                c = candidates[now["i"]]
            c["error"] = str(err).splitlines()[0]
            say(f"candidate {now['i'] + 1}/{n}: {c['label']} ... failed: {c['error']}")
            first = now["i"] + 1


def tune(model: str = "tiny", gpus: int = 2, gpu_mem_gb: float | None = None, steps: int = 3,
         top: int = 8, warmup: int = 1, global_batch: int = 8, bucket_mb=(25.0,),
         progress: Callable[[str], None] | None = None, timeout: float = 600,
         hardware: str | None = None, **model_overrides) -> dict:
    """Plan, run and grade: the report ``edu3d tune --json`` prints. ``hardware``: the
    profile to predict with (a name or a file; default this machine's calibration, else a
    stand-in, :func:`.predicted.profile_for`). ``model_overrides``: ``edu3d train``'s model
    options (``layers``, ``d_model``, ``seq``, ``experts`` ...)."""
    check_request(model, gpus, gpu_mem_gb, steps, top, warmup)
    base = Run.of(model=model, global_batch=global_batch, **model_overrides)
    check_args(base)
    device = "cuda" if fit.on_gpus(gpus) else "cpu"
    profile, note = predicted.profile_for(hardware, device)
    planned = plan(base, gpus, gpu_mem_gb, top, warmup + steps, tuple(bucket_mb), profile)
    if not planned["candidates"]:
        raise ValueError(f"no layout of {model} runs on {gpus} rank(s) here: "
                         + "; ".join(s["reason"] for s in planned["skipped"][:2]))
    if progress and note:
        progress(note)
    if progress:
        progress(f"{len(planned['candidates'])} candidates of {planned['layouts_searched']} "
                 f"layouts, {gpus} rank(s) on {device}, {warmup} warm-up + {steps} timed "
                 "steps each")
    measure(planned["candidates"], gpus, warmup, progress, timeout)
    budget = (cluster_for(gpus, gpu_mem_gb).usable * gpu_mem_gb * 1e9
              if gpu_mem_gb is not None else None)
    config = model_config(base)
    return {"model": model, "config": dataclasses.asdict(config), "world_size": gpus,
            "device": device, "memory_measured": "cuda max_memory_allocated" if
            device == "cuda" else "tracked tensors (weights, grads, optimizer, peak "
            "activations)", "warmup": warmup, "steps": steps,
            "global_batch": global_batch, "profile_note": note, **planned,
            **grade(planned["candidates"], budget)}


def main_progress(line: str) -> None:
    print(f"tune: {line}", file=sys.stderr, flush=True)
