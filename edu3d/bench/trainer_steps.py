"""Calibration's Trainer steps: a model so narrow that its arithmetic is nil, run as ``edu3d train`` runs it.

After reading this file you should understand how ``edu3d calibrate`` measures what Python,
the dispatcher and autograd cost a training step, in the conditions the steps it predicts
meet:

* **the real training loop** (:func:`looped`): each step goes through
  :func:`edu3d.train.loop.loop`, as ``edu3d train`` and ``edu3d tune`` run it: a fresh global
  batch every step, the record and the trainer's statistics between two steps. A bare
  ``trainer.step`` repeated on one batch keeps everything in the caches and is ~0.5-1 ms
  (5-10 %) cheaper a step of the tiny model than the loop's own; the loop's time between two
  steps is not counted (``edu3d train`` does not count it either);
* **the fastest step, and the median** (:func:`eager`): the constants are fitted to the
  fastest step of this thread's CPU time (what other processes' load moves least: a median
  under load would make a block look faster than its own launches); the median is kept too,
  because what ``edu3d tune`` reports of a candidate is its median step: the same serial
  steps on every rank at once, their median on the wall clock against the fastest alone,
  give the model's ``corun`` (:mod:`edu3d.plan.cpu`);
* **three micro-batch counts** (:data:`MICROBATCHES`): ``t = per_step + m·per_microbatch``
  separates what a step costs once (the optimizer and the norm over the parameter tensors)
  from what each micro-batch costs (its kernels' launches), serially, then on data-parallel
  and on tensor-parallel ranks (:mod:`edu3d.bench.profile_fit` fits them);
* **what a kernel stands for** (:class:`Dispatches`, :func:`host_kernels`): the aten
  operations a micro-batch runs, against the kernels :mod:`edu3d.plan.kernels` counts in it.
"""

from __future__ import annotations

import statistics
import time

from torch.utils._python_dispatch import TorchDispatchMode

from edu3d.bench import autotune, cpu_fit
from edu3d.config.sections import Run
from edu3d.model.gpt import GPT
from edu3d.plan import kernels, recipes
from edu3d.plan.estimate import spec_of
from edu3d.plan.stage_costs import cut_of
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import loop
from edu3d.train.preflight import check_args
from edu3d.train.trainer import Trainer

EAGER = dict(model="tiny", layers=4, d_model=8, heads=2, seq=8, vocab=16)  # arithmetic nil
MICROBATCHES = (1, 2, 4)
MIN_REPS, MAX_REPS = 3, 200


class Dispatches(TorchDispatchMode):
    """Counts the aten operations run under it (for the record: how many ops a kernel of
    the model stands for)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def looped(trainer: Trainer, corpus: SyntheticCorpus, run: Run, clock, budget_s: float,
           reps: int | None = None) -> list[float]:
    """Times of ``trainer.step`` on ``clock`` (:class:`edu3d.bench.calibration.Clock`) over
    steps of the real training loop, after one warm-up step: as many as ``budget_s`` of wall
    time allows (at least :data:`MIN_REPS`, at most :data:`MAX_REPS`), or exactly ``reps``
    (ranks that call collectives must agree on the count)."""
    x, y = (t.to(trainer.device) for t in corpus.batch(1, run.batch.global_batch))
    t0 = time.perf_counter()
    trainer.step(x, y, 1)  # warm-up: the optimizer's state is allocated here
    once = time.perf_counter() - t0
    n = reps if reps is not None else min(MAX_REPS, max(MIN_REPS, int(budget_s / max(once, 1e-5))))
    times, step = [], trainer.step

    def timed(*args, **kwargs):
        c0 = clock.now()
        out = step(*args, **kwargs)
        times.append(clock.now() - c0)
        return out

    trainer.step = timed  # the loop calls it as edu3d train does
    try:
        loop(trainer, autotune.OnDevice(corpus) if clock.cuda else corpus,
             run.replace(steps=n + 1))
    finally:
        del trainer.step
    return times[1:]  # the loop's first step: a new batch's first touch


def eager(device: str, clock, budget_s: float, mesh=None, reps: int | None = None,
          recompute: str = "none") -> dict:
    """Trainer steps of :data:`EAGER` with :data:`MICROBATCHES` micro-batches of one sequence
    each (serial, or on ``mesh``'s layout: data-parallel, each rank its own sequences, or
    tensor-parallel with SP; ``recompute``: every block checkpointed), through the training
    loop: the fastest (``seconds``) and the median step of each, and what a micro-batch
    launches."""
    dp, tp = (mesh.layout.dp, mesh.layout.tp) if mesh is not None else (1, 1)
    out = {"microbatches": list(MICROBATCHES), "seconds": [], "median": [], "model": ", ".join(
        f"{k}={v}" for k, v in EAGER.items())}
    for m in MICROBATCHES:
        run = Run.of(**EAGER, global_batch=m * dp, microbatches=m, steps=1, dp=dp, tp=tp,
                     sp=tp > 1, recompute=recompute)
        config, _ = check_args(run)
        model = GPT(config, seed=0).to(device)
        trainer = Trainer(model, mesh, run)
        corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
        times = looped(trainer, corpus, run, clock, budget_s / len(MICROBATCHES), reps)
        out["seconds"].append(min(times))
        out["median"].append(statistics.median(times))
        if mesh is not None:
            out["collectives"] = cpu_fit.collectives_per_microbatch(run)
            continue
        if recompute != "none":
            continue
        x, y = (t.to(device) for t in corpus.batch(1, m))
        if m == 1:
            with Dispatches() as one:
                trainer.step(x, y, 10**6)
            out["tensors"] = sum(1 for _ in model.parameters())
        elif m == MICROBATCHES[-1]:
            with Dispatches() as many:
                trainer.step(x, y, 10**6)
    if mesh is None:
        out["kernels"] = host_kernels(Run.of(**EAGER, global_batch=1, microbatches=1,
                                             recompute=recompute))
        out["regions"] = EAGER["layers"] if recompute != "none" else 0  # one checkpoint a block
    if mesh is None and recompute == "none":
        out["dispatches"] = round((many.count - one.count) / (MICROBATCHES[-1] - 1))
    return out


def host_kernels(run: Run) -> int:
    """Kernels one micro-batch of ``run`` launches, forward and backward, as the model counts
    them (:mod:`edu3d.plan.kernels`: every layer, the embedding, the head and the loss)."""
    spec = spec_of(run)
    rec = recipes.recipe_of("edu3d")
    cut = cut_of(spec, run, rec)
    layer, _ = kernels.layer(cut, run.memory.recompute)
    return (spec.n_layers * sum(o.kernels for o in layer)
            + sum(o.kernels for o in kernels.embedding_ops(cut)
                  + kernels.head_ops(cut, rec.fused_loss)))
