"""The grader of exercise 03 (``exercises/zero1.py``): a ZeRO-1 step on real ranks, then a ZeRO
stage and bucket size under a memory cap.

After reading this file you should know what ``exercises/03_zero1.ipynb`` checks:

* ``shard_range`` against the padding rule (the notebook's cells: 10 over 4, 7,001 and
  7,000 over 8: no padding at all when N divides);
* :func:`zero1_on_ranks` (a launch target) runs the learner's ``zero1_sgd_step`` on this
  rank's rows of a global batch, traced as ``case=exercise``, against one serial SGD step on
  the whole batch (a model of 23,345 parameters: 3 ranks need padding);
* the design: ``choose_zero(job)`` returns ``(stage, bucket_mb)`` for a job of :data:`JOBS`.
  :func:`cost` counts the fullest rank's bytes (the ZeRO paper's ``2Ψ + 2Ψ + 12Ψ`` sharded
  stage by stage, the activations, two buckets in flight, and under ZeRO-3 two gathered
  layers) and the step's time: the compute, plus the communication it cannot hide. Every
  bucket of bf16 gradients is a ring (reduce-scatter and all-gather: two phases of
  ``N-1`` steps, ZeRO-3 a third for the backward's all-gather), each step paying ``α``;
  communication hides under the compute except the last bucket's. The target: the memory
  fits in 90 % of a GPU, the step within 2 % of the best plan on a grid of stages and
  buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from edu3d.course import grading
from edu3d.course.targets import (Cost, Target, fmt_bytes, fmt_time, meet, plan_line,
                                   target_of)
from edu3d.distributed import trace
from edu3d.model.gpt import GPT, config_from
from edu3d.train.cut import shard_rows
from edu3d.train.data import SyntheticCorpus


def zero1_on_ranks(mesh, lr: float = 0.1) -> bool:
    """Launch target: the learner's ``zero1_sgd_step`` on this rank's rows, traced as
    ``case=exercise``; True when the parameters equal one serial SGD step on the whole batch
    (False, never an exception, when the code is unfinished)."""
    mod = grading.load("zero1")
    config = config_from("tiny", layers=1, d_model=35, heads=5, vocab=100)  # 23,345 = 3k + 2
    x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0).batch(1, 6)
    serial = GPT(config, seed=0)
    serial(x, y)[1].backward()
    with torch.no_grad():
        want = [p - lr * p.grad for p in serial.parameters()]
    model = GPT(config, seed=0)
    n, index = mesh.size("dp"), mesh.index("dp")
    model(shard_rows(x, index, n), shard_rows(y, index, n))[1].backward()
    try:
        with trace.current().context(case="exercise"):
            mod.zero1_sgd_step(list(model.parameters()), lr, mesh.dp)
    except NotImplementedError:
        return False
    return all(torch.allclose(p, w, rtol=1e-5, atol=1e-7)
               for p, w in zip(model.parameters(), want))


# ---- the design: a ZeRO stage and a bucket size -------------------------------------------------
@dataclass(frozen=True)
class Job:
    params: float  # Ψ
    ranks: int  # N_d
    gpu_gb: float
    activations_gb: float
    compute_s: float  # forward + backward of one step
    alpha: float  # seconds per ring step
    gbps: float  # GB/s of the link
    layers: int


JOBS = {"a": Job(7e9, 64, 80, 20, 1.0, 30e-6, 25, 32),
        "b": Job(7e9, 8, 40, 8, 1.0, 10e-6, 100, 32),
        "c": Job(13e9, 16, 24, 4, 1.5, 30e-6, 25, 40)}
USABLE = 0.9
BUCKETS = tuple(2 ** k for k in range(13))  # 1 MB .. 4 GB
SLACK = 1.02


def state_bytes(job: Job, stage: int) -> float:
    """bf16 weights and gradients, fp32 master weights and Adam's moments: 2Ψ + 2Ψ + 12Ψ,
    sharded over N_d one more kind per stage; ZeRO-3 holds two whole layers (one gathered,
    one prefetched)."""
    p, n = job.params, job.ranks
    return {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n,
            3: 16 * p / n + 2 * 2 * p / job.layers}[stage]


def check_plan(job: str, plan) -> tuple[int, float]:
    assert isinstance(plan, (tuple, list)) and len(plan) == 2, \
        f"job {job}: choose_zero must return (stage, bucket_mb), got {plan!r}"
    stage, bucket = int(plan[0]), float(plan[1])
    assert stage in (0, 1, 2, 3), f"job {job}: ZeRO stage {stage} is not 0, 1, 2 or 3"
    assert bucket > 0, f"job {job}: a bucket of {bucket} MB holds nothing"
    return stage, bucket


def cost(job: str, plan) -> Cost:
    """Seconds of one step and bytes of the fullest rank for ``plan = (stage, bucket_mb)``."""
    stage, bucket_mb = check_plan(job, plan)
    j = JOBS[job]
    grads, bucket = 2 * j.params, bucket_mb * 2 ** 20
    phases = 3 if stage == 3 else 2
    one = phases * (j.ranks - 1) * (j.alpha + min(bucket, grads) / j.ranks / (j.gbps * 1e9))
    comm = math.ceil(grads / bucket) * one
    return Cost(time=j.compute_s + max(one, comm - j.compute_s),
                memory=state_bytes(j, stage) + j.activations_gb * 1e9 + 2 * bucket)


def target(job: str) -> Target:
    plans = [(s, b) for s in range(4) for b in BUCKETS]
    return target_of(plans, lambda p: cost(job, p), USABLE * JOBS[job].gpu_gb * 1e9, SLACK)


def check_design(ex, job: str) -> None:
    plan = ex.choose_zero(job)
    meet(f"job {job}: ZeRO-{plan[0]} with {plan[1]} MB buckets", cost(job, plan), target(job))


def describe(job: str, plan) -> str:
    return plan_line(lambda: cost(job, plan), lambda: target(job), lambda c, t: (
        f"job {job}: ZeRO-{plan[0]}, buckets {plan[1]} MB: {fmt_bytes(c.memory)} (at most "
        f"{fmt_bytes(t.memory)}), step {fmt_time(c.time)} (target {fmt_time(t.time)})"))
