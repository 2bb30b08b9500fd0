"""The grader of exercise 11 (``exercises/layout_choice.py``): the learner's layouts, judged
by the planner.

After reading this file you should know what "a good layout" means here, in numbers: the
planner's own search (:func:`edu3d.plan.search.search`) over every layout of the job, with
its memory estimate (:func:`edu3d.plan.estimate.estimate`) and cost model
(:func:`edu3d.plan.search.step_time`). A choice passes when it is a layout of the job (all
the GPUs, the batch split evenly), fits (the fullest rank within ``usable`` of a GPU), and
its step is at most 10 % slower than the fastest layout that fits. Many layouts pass: the
point is the reasoning, not one answer.

Each ``check_*`` raises ``AssertionError`` saying what is wrong, in the planner's numbers.
"""

from __future__ import annotations

from functools import lru_cache

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
