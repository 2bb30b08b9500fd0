"""The collectives edu3d's own Trainer issues around the layers, counted as it issues them.

After reading this file you should understand why the *number* of collectives matters as
much as their bytes where each one has a long latency (gloo on a CPU: 0.15-0.35 ms a step
of a ring, against NCCL's microseconds):

* **ZeRO-1/2 reduce unit by unit** (:func:`zero_reduce`): edu3d's ZeRO keeps one flat buffer
  per unit (a block, the embedding, the final norm: :func:`edu3d.plan.inventory.units`) and
  reduce-scatters the gradients and all-gathers the updated weights one unit at a time, each
  a collective of its own; ZeRO-2 with ``grad_reduce="per-microbatch"`` (the default)
  reduce-scatters every unit after *every* micro-batch's backward, synchronously in its
  hooks. A tiny model on 2 ranks: 6 reduce-scatters and 6 all-gathers a step, not one each;
* **the step's bookkeeping** (:func:`bookkeeping`): every parallel step all-reduces two
  numbers, the loss (over every rank) and the squared gradient norm (over the ranks that hold
  different pieces): two latencies, whatever the model.

ZeRO-3's units are gathered and scattered layer by layer in :func:`edu3d.plan.step.zero3_cost`
already. No torch here.
"""

from __future__ import annotations

from edu3d.config.sections import Run
from edu3d.model.shapes import ModelSpec
from edu3d.plan import links
from edu3d.plan.hardware import Profile
from edu3d.plan.inventory import units


def unit_elements(spec: ModelSpec, run: Run, pp_rank: int, experts: bool) -> list[int]:
    """Trainable elements of each ZeRO unit pipeline rank ``pp_rank`` holds (one tp rank's)."""
    return [sum(k for k, _ in tensors) for _, tensors in units(spec, run, pp_rank, experts)]


def zero_reduce(spec: ModelSpec, run: Run, pp_rank: int, experts: bool, reduce_bytes: int,
                gather_bytes: int, n: int, link: links.Link) -> tuple[float, float]:
    """Seconds of ZeRO-1/2's gradient reduce-scatters in a step (every micro-batch's, for
    ZeRO-2 per micro-batch) and of its weight all-gathers, unit by unit; values of
    ``reduce_bytes`` and ``gather_bytes`` (a course model's are fp32 whatever the autocast:
    4 each)."""
    if spec.course:
        reduce_bytes = gather_bytes = 4
    sizes = [k for k in unit_elements(spec, run, pp_rank, experts) if k]
    times = 1
    if run.parallel.zero == 2 and run.parallel.grad_reduce == "per-microbatch":
        times = run.microbatches
    reduce = times * sum(links.collective_time("reduce_scatter", reduce_bytes * k, n, link)
                         for k in sizes)
    gather = sum(links.collective_time("all_gather", gather_bytes * k, n, link) for k in sizes)
    return reduce, gather


def bookkeeping(run: Run, profile: Profile) -> float:
    """Seconds of the step's two 8-byte all-reduces (the loss, the gradient norm) over every
    rank (0 for one rank)."""
    n = run.world_size
    if n == 1:
        return 0.0
    link = links.link_for(profile, 1 if n <= profile.gpus_per_node else 2, n)
    return 2 * links.collective_time("all_reduce", 8, n, link)
