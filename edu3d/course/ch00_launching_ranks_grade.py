"""The grader of exercise 00 (``exercises/ranks.py``): a rank's coordinates and groups, then
a layout whose chattiest groups stay inside a node.

After reading this file you should know what each part of ``exercises/00_ranks.ipynb``
compares:

* the arithmetic: ``coords_of`` and ``group_members`` against
  :class:`edu3d.config.layout.Layout` on :data:`LAYOUTS` (the notebook's cells do the
  comparing), and against the groups live ranks form (:func:`live_reports`, chapter 00's
  :func:`~edu3d.course.ch00_launching_ranks.mesh_report` on 4 ranks);
* the design: ``layout_for(job)`` returns ``(dp, tp, pp)`` for a job of :data:`JOBS`, costed
  by :func:`cost`. A rank holds ``16Ψ/(tp·pp)`` bytes of state; a step is the compute, stretched
  by the pipeline's bubble ``(m+p-1)/m``, plus each axis's bytes per rank over its link:
  NVLink while every group of that axis stays inside a node, InfiniBand (six times slower)
  once one crosses. Which groups cross is read off the rank order (``tp`` fastest, then
  ``dp``, then ``pp``), so the same three degrees can be fast or slow. The target
  (:func:`target`) is the fastest layout that fits, plus 5 %.
"""

from __future__ import annotations

from dataclasses import dataclass

from edu3d.config.layout import Layout
from edu3d.course.ch00_launching_ranks import mesh_report
from edu3d.course.targets import (Cost, Target, fmt_bytes, fmt_time, meet, plan_line,
                                   target_of)
from edu3d.launch import launch

LAYOUTS = [Layout(dp=2, tp=2, pp=2), Layout(), Layout(dp=4), Layout(tp=4), Layout(pp=4),
           Layout(dp=2, tp=4), Layout(dp=3, tp=2, pp=2), Layout(dp=2, tp=3, pp=4),
           Layout(tp=8, pp=2), Layout(dp=4, pp=3)]


def live_reports(layout: Layout = Layout(dp=2, pp=2)) -> list[dict]:
    """What each rank of a live launch of ``layout`` learned about its groups by
    all-gathering over them (:func:`edu3d.course.ch00_launching_ranks.mesh_report`)."""
    return launch(mesh_report, layout.world_size, layout=layout, echo=False, progress=False,
                  timeout=120).results  # a checked cell prints only verdicts


# ---- the design: a layout for nodes of 8 --------------------------------------------------
@dataclass(frozen=True)
class Job:
    gpus: int
    gpu_gb: float


PARAMS, LAYERS, D_MODEL, SEQ, MICRO = 13e9, 40, 5120, 4096, 8  # the job's model and step
PER_NODE, USABLE, FLOPS = 8, 0.9, 400e12  # GPUs per node, share of a GPU's memory, per GPU
NVLINK, INFINIBAND = 150e9, 25e9  # bytes/s per GPU inside a node, across nodes
JOBS = {"a": Job(gpus=16, gpu_gb=80), "b": Job(gpus=32, gpu_gb=40)}
SLACK = 1.05


def crosses(layout: Layout, dim: str) -> bool:
    """Whether some group along ``dim`` holds ranks of two nodes."""
    return any(len({r // PER_NODE for r in layout.group_of(rank, dim)}) > 1
               for rank in range(layout.world_size))


def axis_bytes(dp: int, tp: int, pp: int) -> dict[str, float]:
    """Bytes one rank sends per step along each axis (ring collectives, bf16)."""
    act = SEQ * D_MODEL * 2  # one micro-batch's activations at a layer boundary
    return {"tp": MICRO * 4 * (LAYERS / pp) * 2 * (tp - 1) / tp * act,
            "dp": 2 * (dp - 1) / dp * 2 * PARAMS / (tp * pp),
            "pp": 2 * MICRO * act if pp > 1 else 0.0}


def cost(job: str, plan) -> Cost:
    """Seconds of one step and bytes of state per GPU of ``plan = (dp, tp, pp)``."""
    dp, tp, pp = check_plan(job, plan)
    layout = Layout(dp=dp, tp=tp, pp=pp)
    compute = 6 * PARAMS * MICRO * SEQ / (layout.world_size * FLOPS) * (MICRO + pp - 1) / MICRO
    comm = sum(b / (INFINIBAND if crosses(layout, d) else NVLINK)
               for d, b in axis_bytes(dp, tp, pp).items())
    return Cost(time=compute + comm, memory=16 * PARAMS / (tp * pp))


def check_plan(job: str, plan) -> tuple[int, int, int]:
    """``(dp, tp, pp)`` as ints, or ``AssertionError`` saying why it is no layout of the job."""
    gpus = JOBS[job].gpus
    assert isinstance(plan, (tuple, list)) and len(plan) == 3, \
        f"job {job}: layout_for must return (dp, tp, pp), got {plan!r}"
    dp, tp, pp = (int(x) for x in plan)
    assert min(dp, tp, pp) >= 1 and dp * tp * pp == gpus, \
        f"job {job}: dp x tp x pp = {dp * tp * pp}, but the job has {gpus} GPUs"
    assert LAYERS % pp == 0, f"job {job}: pp={pp} does not divide the {LAYERS} layers"
    return dp, tp, pp


def layouts(job: str):
    g = JOBS[job].gpus
    return [(d, t, g // (d * t)) for d in range(1, g + 1) for t in range(1, g + 1)
            if g % (d * t) == 0 and LAYERS % (g // (d * t)) == 0]


def target(job: str) -> Target:
    return target_of(layouts(job), lambda p: cost(job, p), USABLE * JOBS[job].gpu_gb * 1e9, SLACK)


def check_design(ex, job: str) -> None:
    plan = ex.layout_for(job)
    meet(f"job {job}: layout {tuple(plan)}", cost(job, plan), target(job))


def describe(job: str, plan) -> str:
    """One line for the notebook: the plan's step, memory and crossing axes, and the target."""
    def line(c: Cost, t: Target) -> str:
        dp, tp, pp = (int(x) for x in plan)
        cross = [d for d in ("tp", "dp", "pp") if crosses(Layout(dp=dp, tp=tp, pp=pp), d)]
        return (f"job {job}: dp {dp} tp {tp} pp {pp}: {fmt_bytes(c.memory)} per GPU (at most "
                f"{fmt_bytes(t.memory)}), step {fmt_time(c.time)} (target {fmt_time(t.time)}); "
                f"crossing nodes: {', '.join(cross) or 'none'}")
    return plan_line(lambda: cost(job, plan), lambda: target(job), line)
