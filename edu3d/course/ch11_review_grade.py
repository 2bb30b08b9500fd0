"""The grader of exercise 11 (``exercises/layout_choice.py``): the learner's layouts, judged
by the planner.

After reading this file you should know what "a good layout" means here, in numbers: the
planner's own search (:func:`edu3d.plan.search.search`) over every layout of the job, with
its memory estimate (:func:`edu3d.plan.estimate.estimate`) and cost model
(:func:`edu3d.plan.search.step_time`). A choice passes when it is a layout of the job (all
the GPUs, the batch split evenly), fits (the fullest rank within ``usable`` of a GPU), and
its step is at most 10 % slower than the fastest layout that fits. Many layouts pass: the
point is the reasoning, not one answer.

The design (:func:`check_tuning`): for a job of :data:`TUNING` whose layout is fixed, the
learner's ``micro_plan(job)`` picks the micro-batch size and the recomputation. The
planner prices it (:func:`tune_cost`: its step time and its fullest rank's peak); the target
(:mod:`edu3d.course.targets`): it fits ``usable`` of the GPU and its step is within 2 % of
the best plan, every micro-batch and recomputation listed (:func:`tune_plans`).

Each ``check_*`` raises ``AssertionError`` saying what is wrong, in the planner's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from edu3d.course.targets import Cost, Target, meet, plan_line, step_line, target_of
from edu3d.model.shapes import spec_from
from edu3d.config.sections import Run
from edu3d.plan.estimate import setup, estimate
from edu3d.plan.search import Cluster, search, step_time

JOBS = {  # job -> (model preset, cluster, global batch): the table of the exercise's docstring
    "a": ("gpt2-xl", Cluster(gpus=8, gpu_mem_gb=24), 64),
    "b": ("llama2-7b", Cluster(gpus=16, gpu_mem_gb=80), 256),
    "c": ("llama2-13b", Cluster(gpus=32, gpu_mem_gb=40), 512),
}
SLACK = 1.10  # within 10 % of the planner's best predicted step
KEYS = ("dp", "tp", "pp", "zero", "micro_batch", "recompute")


@lru_cache(maxsize=None)
def best(job: str) -> dict:
    """The planner's fastest layout that fits, as its search row."""
    preset, cluster, batch = JOBS[job]
    return next(r for r in search(spec_from(preset), cluster, global_batch=batch) if r["fits"])


def setup_of(job: str, choice: dict) -> Run:
    """The planner's run (:class:`~edu3d.config.sections.Run`) for a choice, or
    ``AssertionError`` saying why it is not a layout of the job."""
    _, cluster, batch = JOBS[job]
    assert isinstance(choice, dict) and set(KEYS) <= set(choice), \
        f"job {job}: choose() must return a dict with the keys {', '.join(KEYS)}"
    dp, tp, pp, zero, b = (int(choice[k]) for k in KEYS[:5])
    rec = choice["recompute"]
    assert min(dp, tp, pp, b) >= 1 and zero in (0, 1, 2, 3), \
        f"job {job}: dp, tp, pp, micro_batch are >= 1 and zero is 0-3, got {choice}"
    assert rec in ("none", "selective", "full"), \
        f"job {job}: recompute is 'none', 'selective' or 'full', got {rec!r}"
    assert dp * tp * pp == cluster.gpus, \
        f"job {job}: dp x tp x pp = {dp * tp * pp}, but the job has {cluster.gpus} GPUs"
    assert batch % (dp * b) == 0, \
        f"job {job}: the global batch {batch} does not split into dp {dp} x micro-batch {b}"
    return setup(dp=dp, tp=tp, pp=pp, zero=zero, microbatches=batch // (dp * b),
                 micro_batch=b, sp=tp > 1, recompute=rec, precision="bf16")


def verdict(job: str, choice: dict) -> dict:
    """``{"fits", "memory_gb", "limit_gb", "step_s", "best_s", "ratio"}`` of a choice."""
    preset, cluster, _ = JOBS[job]
    spec, st = spec_from(preset), setup_of(job, choice)
    try:
        mem = estimate(spec, st)["total_bytes"]
    except ValueError as err:
        raise AssertionError(f"job {job}: the planner refuses this layout: {err}") from None
    step, top = step_time(spec, st, cluster)["total"], best(job)["time"]["total"]
    return {"fits": mem <= cluster.usable * cluster.gpu_mem_gb * 1e9, "memory_gb": mem / 1e9,
            "limit_gb": cluster.usable * cluster.gpu_mem_gb, "step_s": step, "best_s": top,
            "ratio": step / top}


def check_job(ex, job: str) -> None:
    v = verdict(job, ex.choose(job))
    assert v["fits"], f"job {job}: the fullest rank needs {v['memory_gb']:.1f} GB, more " \
                      f"than the {v['limit_gb']:.1f} GB usable"
    assert v["ratio"] <= SLACK, f"job {job}: it fits, but its step ({v['step_s']:.2f} s) " \
        f"is {v['ratio']:.2f}x the best that fits ({v['best_s']:.2f} s); at most {SLACK:.2f}x"


def describe(job: str, choice: dict) -> str:
    """Two lines for the notebook: the choice in the planner's numbers, and its best."""
    _, cluster, _ = JOBS[job]
    try:
        v = verdict(job, choice)
    except AssertionError as why:
        return str(why).splitlines()[0]
    top = best(job)["setup"]
    room = f"the {v['limit_gb']:.1f} GB usable ({cluster.usable:.0%} of {cluster.gpu_mem_gb:g} GB)"
    mem = (f"fits in {v['memory_gb']:.1f} GB of {room}" if v["fits"] else
           f"needs {v['memory_gb']:.1f} GB, more than {room}")
    return (f"job {job}: yours {mem}, step {v['step_s']:.2f} s = {v['ratio']:.2f}x the best\n"
            f"       the planner's best: dp {top.layout.dp} tp {top.layout.tp} pp {top.layout.pp} "
            f"ZeRO-{top.parallel.zero}, micro-batch {top.micro_batch}, recompute "
            f"{top.memory.recompute}: {v['best_s']:.2f} s")


# ---- the design: micro-batch and recomputation for a given layout and memory --------------------
@dataclass(frozen=True)
class Tuning:
    """A job whose layout is fixed: the learner tunes its micro-batch and recomputation."""

    preset: str
    cluster: Cluster
    global_batch: int
    dp: int
    tp: int
    pp: int
    zero: int


TUNING = {  # the table of ``micro_plan``'s docstring in exercises/layout_choice.py
    "a": Tuning("gpt2-xl", Cluster(gpus=8, gpu_mem_gb=16), 128, dp=8, tp=1, pp=1, zero=1),
    "b": Tuning("llama2-7b", Cluster(gpus=16, gpu_mem_gb=40), 128, dp=4, tp=2, pp=2, zero=1),
}
TUNE_SLACK = 1.02  # within 2 % of the planner's best micro-batch and recomputation
RECOMPUTE = ("none", "selective", "full")


def tuned_run(job: str, plan) -> Run:
    """The planner's run for ``plan`` (``{"micro_batch", "recompute"}``) on the job's fixed
    layout, or ``AssertionError`` saying why it is no plan."""
    j = TUNING[job]
    assert isinstance(plan, dict) and {"micro_batch", "recompute"} <= set(plan), \
        f"tuning {job}: micro_plan must return a dict with micro_batch and recompute"
    b, rec = int(plan["micro_batch"]), plan["recompute"]
    assert rec in RECOMPUTE, \
        f"tuning {job}: recompute is 'none', 'selective' or 'full', got {rec!r}"
    assert b >= 1 and j.global_batch % (j.dp * b) == 0, \
        f"tuning {job}: a micro-batch of {b} does not divide the {j.global_batch // j.dp} " \
        f"sequences of a data-parallel rank"
    return setup(dp=j.dp, tp=j.tp, pp=j.pp, zero=j.zero, micro_batch=b,
                 microbatches=j.global_batch // (j.dp * b), sp=j.tp > 1, recompute=rec,
                 precision="bf16")


def tune_cost(job: str, plan) -> Cost:
    """The planner's step (:func:`~edu3d.plan.search.step_time`) and the fullest rank's
    peak (:func:`~edu3d.plan.estimate.estimate`) for ``plan``."""
    j = TUNING[job]
    spec, run = spec_from(j.preset), tuned_run(job, plan)
    return Cost(time=step_time(spec, run, j.cluster)["total"],
                memory=estimate(spec, run)["total_bytes"])


def tune_plans(job: str):
    """Every plan: each micro-batch dividing a rank's sequences, each recomputation."""
    j = TUNING[job]
    per_rank = j.global_batch // j.dp
    for b in (b for b in range(1, per_rank + 1) if per_rank % b == 0):
        for rec in RECOMPUTE:
            yield {"micro_batch": b, "recompute": rec}


@lru_cache(maxsize=None)
def tune_target(job: str) -> Target:
    cl = TUNING[job].cluster
    return target_of(tune_plans(job), lambda p: tune_cost(job, p),
                     cl.usable * cl.gpu_mem_gb * 1e9, TUNE_SLACK)


def check_tuning(ex, job: str) -> None:
    plan = ex.micro_plan(job)
    meet(f"tuning {job}: {plan}", tune_cost(job, plan), tune_target(job))


def describe_tuning(job: str, plan) -> str:
    """What ``plan`` costs next to the target, or why it is no plan."""
    return plan_line(lambda: tune_cost(job, plan), lambda: tune_target(job), lambda c, t:
                     step_line(f"tuning {job}: {plan}", c, t, "{} on the fullest rank"))
