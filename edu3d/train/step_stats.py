"""What a step held and sent: the peak memory by category and the bytes on the wire.

After reading this file you should understand where the figures of ``edu3d train --json``'s
``mem_bytes`` and ``wire_bytes`` come from, and why they are comparable with the planner's
formulas (:mod:`edu3d.plan.formulas`):

* **memory is a peak, not an end-of-step reading.** After every compute action (each
  micro-batch's forward and backward) and after the optimizer step, the trainer measures
  the tensors it holds by category (:func:`edu3d.distributed.meter.measure`: storages, so
  views into one flat buffer count once) and keeps each category's largest value. That is
  what the formulas count: at the end of a step ZeRO-2 holds only its gradient shard in
  either ``--grad-reduce`` mode, but between micro-batches ``per-step`` holds the full
  gradients and ``per-microbatch`` only the shard; ZeRO-3 ``per-step`` holds every unit
  gathered between its forwards. What lives only *inside* one action (the one unit being
  reduce-scattered, ZeRO-3's one or two units gathered while they compute) is transient:
  it shows in the trace's ``mem`` events, not here. Activations are the pipeline engine's
  own peak;
* **bytes on the wire** per step and per collective kind (``all_reduce``,
  ``reduce_scatter``, ``all_gather``, ``send`` ...) are what this rank sends, with ring
  costs (:func:`edu3d.distributed.trace.wire_bytes`), summed by the trace recorder as
  collectives finish and averaged over the steps since the previous record. A run without a
  trace (one process) sends nothing.

Both are collective to read (every rank calls :meth:`StepMeter.read`): memory is the fullest
rank's row, bytes the largest of any rank per kind.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from edu3d.distributed import meter, trace

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send")


class StepMeter:
    """Peak bytes held by category and bytes sent by collective kind, since the last read.
    ``tensors()`` returns this rank's tensors by category (``Trainer.tensors``)."""

    def __init__(self, tensors: Callable[[], dict], world_size: int):
        self.tensors, self.world_size = tensors, world_size
        self.peak = dict.fromkeys(meter.CATEGORIES, 0)
        self.steps = 0
        self.wire_seen = dict(trace.current().wire)  # set-up traffic is no step's
        rec = trace.current()  # covered and exposed microseconds at the last read: set-up's
        self.comm_seen = {"comm_s": rec.comm_us(), "exposed_s": rec.comm_us(exposed=True)}

    def sample(self) -> None:
        """Measure what is held now; keep each category's largest value."""
        held = meter.measure(self.tensors())
        for cat in meter.CATEGORIES:
            self.peak[cat] = max(self.peak[cat], held[cat])

    def step_done(self) -> None:
        self.sample()  # after the optimizer step: its state exists from step 1 on
        self.steps += 1

    def read(self, activation_bytes: int) -> dict:
        """``{"mem_bytes", "wire_bytes", "comm_s", "exposed_s", "comm_any_s"}`` since the last
        read; collective.

        ``mem_bytes``: peak bytes by category of the fullest rank (largest total) and their
        ``total``; ``wire_bytes``: bytes sent per step by kind (the busiest rank's);
        ``comm_s``: the seconds some collective of each group covered on this rank
        (overlapping collectives count once), ``exposed_s`` the part of those no compute ran
        beside, ``comm_any_s`` both for any group (:mod:`edu3d.distributed.coverage`)."""
        if not any(self.peak.values()):
            self.sample()  # read before any step: what is held now
        row = torch.tensor([*(self.peak[c] for c in meter.CATEGORIES), activation_bytes],
                           dtype=torch.float64)
        rec = trace.current()
        steps = max(self.steps, 1)
        sent = torch.tensor([(rec.wire.get(k, 0.0) - self.wire_seen.get(k, 0.0)) / steps
                             for k in KINDS], dtype=torch.float64)
        if self.world_size > 1:  # bookkeeping: left out of the trace
            rows = [torch.empty_like(row) for _ in range(self.world_size)]
            dist.all_gather(rows, row)
            row = max(rows, key=lambda r: float(r.sum()))
            dist.all_reduce(sent, op=dist.ReduceOp.MAX)
        mem = dict(zip((*meter.CATEGORIES, "activations"), map(int, row.tolist())))
        mem["total"] = sum(mem.values())
        now = {"comm_s": rec.comm_us(), "exposed_s": rec.comm_us(exposed=True)}
        out = {key: {g: round((t - self.comm_seen.get(key, {}).get(g, 0.0)) / 1e6, 6)
                     for g, t in now[key].items()} for key in now}
        self.comm_seen, self.wire_seen = now, dict(rec.wire)
        self.peak = dict.fromkeys(meter.CATEGORIES, 0)
        self.steps = 0
        any_ = {"covered": out["comm_s"].pop("any", 0.0),
                "exposed": out["exposed_s"].pop("any", 0.0)}
        return {"mem_bytes": mem, **{k: {g: s for g, s in v.items() if s} for k, v in out.items()},
                "comm_any_s": any_ if any(any_.values()) else {},
                "wire_bytes": {k: int(b) for k, b in zip(KINDS, sent.tolist()) if b}}
