"""Chapters 02 and 03: data parallelism and ZeRO, run live.

After reading this file you should know how the chapters' runs are made: every version is
``edu3d train``'s own :class:`~edu3d.train.trainer.Trainer` with a few options changed
(:func:`compare_versions`), each traced as its own ``case``; :func:`traffic_per_step`
reads the bytes a step moved back from the trace.

Chapter 02's bucket panel: :func:`simulate_dp_step` cuts the model's gradients into buckets
with :func:`edu3d.parallel.dp.data_parallel.make_buckets` itself (on ``meta`` tensors: sizes,
no memory), lets backward produce them last layer first, launches each bucket's all-reduce
when its last gradient is ready and every earlier bucket has gone, and prices the
all-reduces with the alpha-beta model (:func:`edu3d.course.ch01_collectives.ring_all_reduce_s`);
:func:`dp_step` runs the real bucketed data-parallel step. The simulated events use the trace
schema with ``"sim": True``, so one renderer draws theory and measurement on the same lanes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from edu3d.course import lesson_args  # chapter 02 reads dp.lesson_args() too
from edu3d.course.ch01_collectives import ring_all_reduce_s
from edu3d.distributed import meter, trace
from edu3d.model.gpt import GPT, num_params
from edu3d.parallel.dp.compress import HOOKS
from edu3d.parallel.dp.data_parallel import make_buckets
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import train_step
from edu3d.train.optim import make_optimizer
from edu3d.train.preflight import model_config
from edu3d.train.trainer import Trainer


def compare_versions(mesh, versions: dict[str, dict], steps: int = 3, **common) -> dict:
    """Train the same model with each version (trainer options by name) for ``steps`` steps,
    traced as ``case=name``; rank 0 also trains the serial reference.

    Returns ``{"serial": losses, name: {"losses", "step_s", "launch_log", "psi", "memory"
    (measured bytes per category after the last step), "units" (ZeRO: name, numel, padded
    size of each flat unit)}}``.
    """
    out = {}
    base = lesson_args(**common)
    config = model_config(base)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=base.training.seed)
    if dist.get_rank() == 0:
        model = GPT(config, seed=base.training.seed)
        opt = make_optimizer(model, base)
        out["serial"] = [train_step(model, opt, *corpus.batch(s, base.batch.global_batch), s,
                                    base)["loss"] for s in range(1, steps + 1)]
    for name, options in versions.items():
        args = lesson_args(**{**common, **options})
        model = GPT(config, seed=args.training.seed)
        trainer = Trainer(model, mesh, args)
        losses, times = [], []
        with trace.current().context(case=name):
            for s in range(1, steps + 1):
                t0 = time.perf_counter()
                losses.append(trainer.step(*corpus.batch(s, args.batch.global_batch), s)["loss"])
                times.append(time.perf_counter() - t0)
        log = getattr(trainer.par.dp, "launch_log", [])
        out[name] = {"losses": losses, "step_s": statistics.median(times),
                     "launch_log": list(log), "psi": num_params(model),
                     "memory": meter.measure(trainer.tensors())}
        if trainer.par.zero is not None:
            out[name]["units"] = [(u.name, u.numel, u.padded) for u in trainer.par.zero.units]
    return out


def compression_error(mesh, hooks=("none",) + HOOKS, steps: int = 10, **common) -> dict:
    """Train with each hook (traced as ``case=name``) and compare with uncompressed training:
    ``{name: {"losses", "max_loss_rel_diff", "param_rel_diff"}}`` (differences against
    ``"none"``, which must come first)."""
    out, ref_params = {}, None
    for name in hooks:
        args = lesson_args(**{**common, "compress": name})
        config = model_config(args)
        corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
        model = GPT(config, seed=args.training.seed)
        trainer = Trainer(model, mesh, args)
        with trace.current().context(case=name):
            losses = [trainer.step(*corpus.batch(s, args.batch.global_batch), s)["loss"]
                      for s in range(1, steps + 1)]
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if ref_params is None:
            ref_params, ref_losses = flat, losses
        out[name] = {"losses": losses,
                     "max_loss_rel_diff": max(abs(a - b) / abs(b)
                                              for a, b in zip(losses, ref_losses)),
                     "param_rel_diff": float((flat - ref_params).norm() / ref_params.norm())}
    return out


# ---- chapter 02's panel: buckets on the backward timeline -------------------------------------
#: gloo's own all-reduce (what data parallelism calls) on the same machine, 2 ranks
GLOO_ALPHA_S = 1.5e-4
GLOO_BETA_S_PER_BYTE = 1 / 1.3e9


@dataclass(frozen=True)
class StepCosts:
    """Compute times of one DP step (the tiny GPT, 4 rows per rank, measured on this machine)
    and gloo's alpha-beta."""

    forward_s: float = 3e-3
    backward_s: float = 9e-3
    alpha: float = GLOO_ALPHA_S
    beta: float = GLOO_BETA_S_PER_BYTE


def backward_sizes(config) -> list[tuple[str, int]]:
    """``(name, numel)`` of every parameter, in registration order (what the buckets cut)."""
    with torch.device("meta"):
        model = GPT(config)
    return [(name, p.numel()) for name, p in model.named_parameters()]


def _compute_weight(name: str, numel: int) -> float:
    """A gradient's share of backward: proportional to its size (a matmul's backward is
    ``2·tokens·numel`` FLOPs), except the embeddings, whose backward is a cheap scatter."""
    return 0.0 if name.endswith("emb.weight") else float(numel)


def simulate_dp_step(params: list[tuple[str, int]], bucket_mb: float, reverse: bool, n: int,
                     costs: StepCosts = StepCosts()) -> dict:
    """The events of one bucketed DP step on each of ``n`` ranks, as edu3d's
    :class:`~edu3d.parallel.dp.data_parallel.DataParallel` would run it.

    Backward produces the gradients last-registered first; gradient ``p`` is ready after its
    share of ``backward_s``. Buckets come from :func:`edu3d.parallel.dp.data_parallel.make_buckets` (in
    reverse order, or forward order when ``reverse`` is False) and are launched strictly in
    bucket order, each when its last gradient is ready. All-reduces share one link, one after
    the other, each ``2(N-1)α + 2(N-1)/N·S·β``; an all-reduce's event is its time on that
    link (a trace can only show launch to wait, which hides when the bytes moved).
    Returns ``{"events", "buckets" (bytes each), "launch_log", "backward_end_s",
    "step_end_s", "exposed_s"}``.
    """
    tensors = [torch.empty(numel, device="meta") for _, numel in params]
    index = {id(t): i for i, t in enumerate(tensors)}
    buckets = make_buckets(tensors, bucket_mb, reverse=reverse, first_bucket_mb=1.0)
    members = [[index[id(p)] for p in b.params] for b in buckets]

    weights = [_compute_weight(name, numel) for name, numel in params]
    total = sum(weights) or 1.0
    ready, t = [0.0] * len(params), costs.forward_s
    for i in reversed(range(len(params))):  # backward: last registered first
        t += costs.backward_s * weights[i] / total
        ready[i] = t
    b_end = costs.forward_s + costs.backward_s

    launches, log, link_free = [], [], 0.0
    order = sorted(range(len(params)), key=lambda i: ready[i])
    for k, group in enumerate(members):
        at = max([ready[i] for i in group] + (launches[-1:] or [0.0]))
        launches.append(at)
        log.append((k, sum(1 for i in order if ready[i] <= at)))
    wire, waited = [], b_end
    sizes = [sum(params[i][1] for i in g) * 4 for g in members]
    for at, size in zip(launches, sizes):
        start = max(at, link_free)  # one link: a bucket waits for the one before it
        link_free = start + ring_all_reduce_s(size, n, costs.alpha, costs.beta)
        wire.append((start, link_free))
        waited = max(waited, link_free)
    events = []
    for rank in range(n):
        events.append({"rank": rank, "lane": "compute", "op": "F", "t0": 0.0,
                       "t1": costs.forward_s * 1e6, "sim": True})
        events.append({"rank": rank, "lane": "compute", "op": "B", "t0": costs.forward_s * 1e6,
                       "t1": b_end * 1e6, "sim": True})
        for k, ((start, end), size) in enumerate(zip(wire, sizes)):
            events.append({"rank": rank, "lane": "comm", "op": "all_reduce", "group": "dp",
                           "n": n, "bytes": size, "chunk": k, "t0": start * 1e6,
                           "t1": end * 1e6, "sim": True})
    return {"events": events, "buckets": sizes, "launch_log": log, "grads": len(params),
            "backward_end_s": b_end,
            "step_end_s": waited, "exposed_s": waited - b_end}


def dp_step(mesh, bucket_mb: float = 0.1, reverse: bool = True, steps: int = 2,
            global_batch: int = 8) -> dict:
    """``steps`` steps of the tiny GPT with edu3d's bucketed data parallelism (the trainer of
    ``edu3d train``), traced as ``case="panel"``; the last one is the warm one to draw."""
    args = lesson_args(dp_impl="bucketed", bucket_mb=bucket_mb, reverse_buckets=reverse,
                       global_batch=global_batch)
    config = model_config(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    trainer = Trainer(GPT(config, seed=args.training.seed), mesh, args)
    with trace.current().context(case="panel"):
        losses = [trainer.step(*corpus.batch(s, global_batch), s)["loss"]
                  for s in range(1, steps + 1)]
    return {"rank": dist.get_rank(), "losses": losses,
            "buckets": [b.buffer.numel() * 4 for b in trainer.par.dp.buckets],
            "launch_log": list(trainer.par.dp.launch_log)}


def measured_costs(events: list[dict], costs: StepCosts = StepCosts()) -> StepCosts:
    """The simulation's compute times replaced by the run's (median over ranks), so the
    simulation drawn under a measurement starts from the same forward and backward."""
    def median(op):
        d = [(e["t1"] - e["t0"]) / 1e6 for e in events if e["op"] == op]
        return statistics.median(d) if d else None

    f, b = median("F"), median("B")
    return StepCosts(f if f is not None else costs.forward_s,
                     b if b is not None else costs.backward_s, costs.alpha, costs.beta)


# ---- traffic, in the ZeRO paper's count ----------------------------------------------------------
PAPER_COUNT = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


def traffic_per_step(events: list[dict], case: str, step: int, rank: int = 0) -> float:
    """Bytes one rank moved in one step, in the ZeRO paper's count (all-reduce 2S, all-gather
    and reduce-scatter S, S the full buffer)."""
    return sum(PAPER_COUNT.get(e["op"], 0) * e.get("bytes", 0) for e in events
               if e.get("case") == case and e.get("step") == step and e["rank"] == rank
               and e["lane"] == "comm")
