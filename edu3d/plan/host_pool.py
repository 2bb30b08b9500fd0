"""What ``--offload-activations`` moves to the host pool, stage by stage: the planner's side
of :mod:`edu3d.parallel.offload_activations`.

After reading this file you should know how the estimator (:mod:`edu3d.plan.estimate`)
splits one micro-batch's activations on a pipeline stage between the device and the host:

* the chosen blocks (:meth:`~edu3d.config.sections.Memory.offloaded`: every k-th, the last
  only with ``--offload-last``) move every byte they save, but for the **stage's input**:
  the stage's first block saves it, and the pipeline engine holds it as a leaf for its
  gradient (on every stage but the first; on the first too where a split backward, I then
  W, detaches the embedding's output), so its ``kept`` bytes stay on the device;
* the other blocks, the first stage's token ids and the last stage's head stay;
* in backward one offloaded block is on the device again at a time, two on a GPU, which
  prefetches the one before it (:func:`brought_back`: part of the peak's ``transient``).

:func:`edu3d.plan.estimate.estimate` reports each pipeline rank's ``host`` bytes (the
micro-batches in flight times a stage's), and the fullest rank's as ``host_bytes``, outside
the device's total.
"""

from __future__ import annotations

from edu3d.config.sections import Run
from edu3d.schedules.actions import build, chunks, placement, stage_rank


def split(run: Run, parts: list[tuple[int, int]], blocks: list[float], kept: float,
          first: float, last: float) -> tuple[dict, ...]:
    """Per global stage (``parts``: its serial layers ``[lo, hi)``; ``blocks``: each layer's
    bytes; ``first`` and ``last``: the end stages' extra bytes): ``device`` and ``host``
    bytes of one micro-batch (``/cp``), ``block`` the largest offloaded block's host bytes,
    ``moved`` how many blocks move."""
    moved = set(run.memory.offloaded(len(blocks)))
    sched = run.parallel.schedule
    detached = bool(moved) and any(a.kind == "I" for a in build(sched, 1, 2, chunks(sched, 1))[0])
    out, cp = [], run.layout.cp
    for i, (lo, hi) in enumerate(parts):
        host = [blocks[j] - (kept if j == lo and (i or detached) else 0)
                for j in range(lo, hi) if j in moved]
        device = sum(blocks[lo:hi]) - sum(host) + (first if i == 0 else 0) + (
            last if i == len(parts) - 1 else 0)
        out.append({"device": device / cp, "host": sum(host) / cp,
                    "block": max(host, default=0.0) / cp, "moved": len(host)})
    return tuple(out)


def brought_back(stage_bytes, run: Run, pp_rank: int) -> float:
    """The most offloaded bytes ``pp_rank`` holds on the device again at once in backward;
    ``stage_bytes(where)``: the estimator's per-stage ``"block"`` and ``"moved"`` of
    :func:`split`."""
    style = placement(run.parallel.schedule)
    stages = zip(stage_bytes("block"), stage_bytes("moved"))
    return max((block * min(2, moved) for st, (block, moved) in enumerate(stages)
                if stage_rank(st, run.layout.pp, style) == pp_rank), default=0.0)
