"""The grader of exercise 02 (``exercises/bucketed_ddp.py``): gradient averaging and bucketed
data parallelism on real ranks, then a micro-batch and bucket size for a step.

After reading this file you should know what ``exercises/02_bucketed_ddp.ipynb`` checks:

* :func:`ddp_on_ranks` (a launch target) runs the learner's ``sync_gradients`` and
  ``BucketedDDP`` next to the serial model's gradient of the same global batch, each rank
  back-propagating its rows; ``BucketedDDP`` runs **two** steps on two batches, as a
  trainer would (a hook that counts a step's gradients must start counting again), and
  must launch its first all-reduce while backward still has gradients to produce. Every
  verdict is a bool, so an unfinished part fails on every rank at the same point;
* the design: ``plan_step(job)`` returns ``(rows, bucket_mb)``, the sequences per micro-batch
  (of a rank's 32) and the bucket size, for GPT-2 small on 8 ranks. :func:`cost` prices it
  with chapter 02's own bucket timeline
  (:func:`edu3d.course.ch02_data_parallel.simulate_dp_step`): every micro-batch costs a fixed
  overhead plus its rows, and only the last one's backward overlaps the buckets'
  all-reduces (the others accumulate under ``no_sync``); the memory is the micro-batch's
  activations. The target: the activations fit, the step within 3 % of the best plan on a
  grid of :data:`ROWS` x :data:`BUCKETS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from edu3d.course import grading
from edu3d.course.ch02_data_parallel import StepCosts, backward_sizes, simulate_dp_step
from edu3d.course.targets import Cost, Target, meet, plan_line, step_line, target_of
from edu3d.model.gpt import GPT, config_from
from edu3d.train.cut import shard_rows
from edu3d.train.data import SyntheticCorpus


def ddp_on_ranks(mesh, bucket_mb: float = 0.02) -> dict:
    """Launch target: the learner's ``sync_gradients`` and ``BucketedDDP`` against the serial
    gradient of the global batch (two steps for ``BucketedDDP``); ``{part: bool}``."""
    mod = grading.load("bucketed_ddp")
    config = config_from("tiny", layers=2)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
    n, index = mesh.size("dp"), mesh.index("dp")

    def serial_grads(step):
        x, y = corpus.batch(step, 8)
        serial = GPT(config, seed=0)
        serial(x, y)[1].backward()
        return [p.grad for p in serial.parameters()], shard_rows(x, index, n), \
            shard_rows(y, index, n)

    def matches(model, want):
        return all(torch.allclose(p.grad, g, rtol=1e-5, atol=1e-7)
                   for p, g in zip(model.parameters(), want))

    out = {}
    want, xs, ys = serial_grads(1)
    model = GPT(config, seed=0)
    model(xs, ys)[1].backward()
    try:
        mod.sync_gradients(model, mesh.dp)
        out["sync_gradients"] = matches(model, want)
    except NotImplementedError:
        out["sync_gradients"] = False
    model = GPT(config, seed=0)
    try:
        ddp = mod.BucketedDDP(model, mesh.dp, bucket_mb)
        total = len(list(model.parameters()))
        right = []
        for step in (1, 2):  # the same weights, a new batch: one more step's gradients
            want, xs, ys = serial_grads(step)
            model.zero_grad(set_to_none=False)
            model(xs, ys)[1].backward()
            ddp.finish()
            right.append(matches(model, want))
        out["bucketed"] = all(right)
        out["overlap"] = bool(ddp.launched_at) and ddp.launched_at[0] < total
    except NotImplementedError:
        out["bucketed"] = out["overlap"] = False
    return out


# ---- the design: a micro-batch and a bucket size -------------------------------------------------
@dataclass(frozen=True)
class Job:
    alpha: float  # seconds per all-reduce step
    beta: float  # seconds per byte
    memory: float  # bytes for one micro-batch's activations


RANKS, ROWS_PER_RANK = 8, 32  # GPT-2 small (124 M parameters), sequences of 1024 per rank
OVERHEAD_S, ROW_S = 4e-3, 6e-3  # one micro-batch's forward + backward: overhead + rows x row
ACT_PER_ROW = 1.1e9  # activation bytes one sequence keeps for its backward
JOBS = {"a": Job(alpha=2e-5, beta=1 / 50e9, memory=20e9),  # one node: NVLink
        "b": Job(alpha=1e-4, beta=1 / 10e9, memory=12e9)}  # across nodes: InfiniBand
ROWS = (1, 2, 4, 8, 16, 32)
BUCKETS = (0.5, 1, 2, 4, 8, 16, 25, 32, 64, 128)
SLACK = 1.03


@lru_cache(maxsize=1)
def gradients() -> tuple:
    """``(name, numel)`` of GPT-2 small's parameters, in registration order."""
    return tuple(backward_sizes(config_from("gpt2-small")))


def check_plan(job: str, plan) -> tuple[int, float]:
    assert isinstance(plan, (tuple, list)) and len(plan) == 2, \
        f"job {job}: plan_step must return (rows, bucket_mb), got {plan!r}"
    rows, bucket = int(plan[0]), float(plan[1])
    assert rows >= 1 and ROWS_PER_RANK % rows == 0, \
        f"job {job}: {rows} rows per micro-batch do not divide a rank's {ROWS_PER_RANK} sequences"
    assert bucket > 0, f"job {job}: a bucket of {bucket} MB holds nothing"
    return rows, bucket


def cost(job: str, plan) -> Cost:
    """Seconds of one step of ``plan = (rows, bucket_mb)``, and its activation bytes."""
    rows, bucket = check_plan(job, plan)
    j = JOBS[job]
    micro = OVERHEAD_S + rows * ROW_S
    last = simulate_dp_step(list(gradients()), bucket, True, RANKS,
                            StepCosts(micro / 3, 2 * micro / 3, j.alpha, j.beta))
    return Cost(time=(ROWS_PER_RANK // rows - 1) * micro + last["step_end_s"],
                memory=rows * ACT_PER_ROW)


@lru_cache(maxsize=None)
def target(job: str) -> Target:
    plans = [(r, b) for r in ROWS for b in BUCKETS]
    return target_of(plans, lambda p: cost(job, p), JOBS[job].memory, SLACK)


def check_design(ex, job: str) -> None:
    plan = ex.plan_step(job)
    meet(f"job {job}: {plan[0]} rows per micro-batch, buckets of {plan[1]} MB",
         cost(job, plan), target(job))


def describe(job: str, plan) -> str:
    return plan_line(lambda: cost(job, plan), lambda: target(job), lambda c, t: step_line(
        f"job {job}: rows {plan[0]}, buckets {plan[1]} MB", c, t, "activations {}"))
