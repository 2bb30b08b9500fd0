"""What a rank tells a live monitor: one small status record, written only while someone watches.

After reading this file you should understand what ``edu3d train --monitor`` (and ``edu3d
top``, and the notebook's live table, :mod:`edu3d.launch.live`) learns from each rank, where
each number comes from, and what it costs:

* **step time** and **tokens/s**: the wall time between two steps' ends on this rank, averaged
  over the steps since the last record. It includes everything the rank did in between
  (a straggler's sleep, the batch, the bookkeeping), so every rank of a synchronous run
  shows about the same step time: they wait for each other;
* **communication per axis**: the microseconds some collective of each group (``dp``,
  ``tp``, ``pp`` ...) covered (:meth:`edu3d.distributed.trace.Recorder.comm_us`: overlapping
  ones once) over the same steps, per step. A waiting rank spends its wait there; that is how the straggler shows;
* **memory**: on a GPU, CUDA's allocated and reserved bytes (and utilisation where torch can
  read it); on a CPU, which has no allocator to ask, the bytes of the tensors the rank holds
  (:func:`edu3d.distributed.meter.measure`) plus its pipeline engine's peak activations.

The cost: after each step :meth:`Publisher.after_step` adds two numbers and reads the clock.
Every :data:`~edu3d.launch.live.PUBLISH_S` seconds it looks (one ``stat``) whether a watcher
touched the run folder's watch file recently; only then does it measure memory and write the
record. At the end, :meth:`Publisher.close` writes the whole run's averages once, watched or
not. :attr:`Publisher.writes` counts the records written, and each record carries its number
``n`` (the tests compare these counts, not times).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from edu3d.distributed import meter, trace
from edu3d.launch import live


class Span:
    """Steps, tokens and communication counted from one instant: a record's window."""

    def __init__(self, now: float):
        self.t0, self.steps, self.tokens = now, 0, 0
        self.comm0 = trace.current().comm_us()

    def numbers(self, now: float) -> dict:
        """Mean step time, tokens/s and communication ms per step over the span."""
        steps, seconds = max(self.steps, 1), max(now - self.t0, 1e-9)
        comm = {g: (us - self.comm0.get(g, 0.0)) / 1e3 / steps
                for g, us in trace.current().comm_us().items() if g != "any"}
        return {"step_ms": 1e3 * seconds / steps, "tokens_per_s": self.tokens / seconds,
                "comm_ms": {g: round(ms, 3) for g, ms in comm.items() if ms > 0},
                "window_steps": self.steps}


def memory(trainer) -> dict:
    """This rank's memory: CUDA's counters on a GPU, the tracked tensors' bytes on a CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out = {"kind": "cuda", "allocated": torch.cuda.memory_allocated(),
               "reserved": torch.cuda.memory_reserved(),
               "peak": torch.cuda.max_memory_allocated()}
        return out
    tensors = getattr(trainer, "tensors", None)  # --impl torch's trainer has no meters
    if tensors is None:
        return {"kind": "tensors", "bytes": None}
    engine = getattr(trainer, "engine", None)
    held = meter.measure(tensors())["total"]
    return {"kind": "tensors", "bytes": held + getattr(engine, "peak_activation_bytes", 0)}


def gpu_utilisation() -> int | None:
    """The GPU's utilisation in percent (torch reads it through NVML), or None."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    try:
        return int(torch.cuda.utilization())
    except Exception:  # noqa: BLE001 - no NVML (pynvml) here: the column stays empty
        return None


class Publisher:
    """This rank's status records for the live monitor, in ``run_dir``'s ``status/``."""

    def __init__(self, run_dir: str | os.PathLike, trainer, steps: int):
        self.run_dir, self.trainer, self.steps = Path(run_dir), trainer, steps
        mesh = trainer.mesh
        self.rank = mesh.rank
        coords = mesh.layout.coords_all(mesh.rank)
        self.coords = {k: v for k, v in coords.items() if k != "cp" or mesh.layout.cp > 1}
        now = time.monotonic()
        self.run, self.window = Span(now), Span(now)
        self.next_look, self.step, self.writes = now + live.PUBLISH_S, 0, 0
        self.file = live.StatusFile(live.status_file(self.run_dir, self.rank))

    @classmethod
    def for_run(cls, trainer, steps: int) -> "Publisher | None":
        """A publisher inside a launched run (``EDU3D_RUN_DIR``) whose ranks are the trainer's,
        else None (a serial trainer on each rank of a launch would all be rank 0)."""
        run_dir = os.environ.get("EDU3D_RUN_DIR")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if not run_dir or world != trainer.mesh.layout.world_size:
            return None
        return cls(run_dir, trainer, steps)

    def after_step(self, step: int, tokens: int) -> None:
        """Count step ``step`` (``tokens`` of the global batch); publish if due and watched."""
        self.step = step
        for span in (self.run, self.window):
            span.steps += 1
            span.tokens += tokens
        now = time.monotonic()
        if now < self.next_look:
            return
        self.next_look = now + live.PUBLISH_S
        if live.watched(self.run_dir):
            self.publish(self.window, now)
        self.window = Span(now)

    def publish(self, span: Span, now: float, done: bool = False) -> None:
        """Write the record of ``span`` (resolving CUDA-timed trace events first)."""
        rec = trace.current()
        if rec.cuda:
            rec.flush()  # CUDA-timed collectives count only once resolved
        record = {"rank": self.rank, "coords": self.coords, "step": self.step,
                  "steps": self.steps, **span.numbers(now), "memory": memory(self.trainer),
                  "t": time.time(), "done": done, "n": self.writes + 1}
        util = gpu_utilisation()
        if util is not None:
            record["gpu_util"] = util
        self.file.write(record)
        self.writes += 1

    def close(self) -> None:
        """The last record: the whole run's averages, written whether or not anyone watches."""
        if self.run.steps:
            self.publish(self.run, time.monotonic(), done=True)
        self.file.close()
