"""One training step's memory as a timeline: what a rank holds, by kind, at every event.

After reading this file you should understand how edu3d draws a step's memory over time
without asking an allocator (a CPU run has none that reports):

* **when**: the step already reports every event to the trace (:mod:`edu3d.distributed.
  trace`): each micro-batch's forward and backward on each stage, every collective (DP's
  bucket all-reduces, ZeRO's reduce-scatters and gathers, pipeline sends and receives), each
  ZeRO-3 gather and free (``mem`` marks), the optimizer step. :class:`MemoryRecorder` stands
  in for the trace's recorder during one step: it passes every event on unchanged and takes a
  **sample** as each one begins and ends;
* **what**: a sample counts bytes by kind, each storage once (:mod:`edu3d.distributed.meter`'s
  rule): ``params``, ``grads`` and ``optimizer`` from the tensors the trainer holds
  (:meth:`~edu3d.train.trainer.Trainer.tensors`: a ZeRO-3 unit counts only while gathered,
  ZeRO-2's full gradients only until their reduce-scatter); ``activations``, what autograd
  holds for backward *right now*: a ``saved_tensors_hooks`` pair wraps every tensor a forward
  saves (parameters excepted) and counts its storage until autograd drops the wrapper, which
  it does as soon as the backward that needed it has run; ``comm``, the buffers edu3d
  allocates for communication: the pipeline's posted receives and sends in flight, and for a
  collective in progress the temporary its caller made (ZeRO's flattened gradient and output
  shard around a reduce-scatter, ZeRO-1/2's copy of the shard they all-gather after the
  step). DP's all-reduce and ZeRO-3's gather work in place on buffers counted already;
* **offloaded activations** (``--offload-activations``): the blocks that move their saved
  tensors to host memory hide them from these hooks (the innermost ``saved_tensors_hooks``
  wins); their offloader counts them instead (:class:`~edu3d.parallel.offload_activations.
  ActivationOffload`): what is on the device (a stage's input; a block's tensors during its
  forward or brought back for its backward, also shown as ``offloaded``: the planner's
  ``transient``) adds to ``activations``, what waits in the host pool is ``host``, outside
  the device's total;
* **off by default, free when off**: nothing is installed unless a recording is asked for
  (``edu3d train --memory-timeline FILE``), and then only around the one step recorded.

What it cannot see, and a GPU's allocator can (:mod:`edu3d.train.cuda_memory`): temporaries
that live inside one operation (the gradient of the logits during the loss's backward, the
planner's ``transient``), recomputed activations (a checkpointed block's recomputation
saves through its own hooks, for the length of that block's backward), and the allocator's
cache. On CUDA each sample also reads ``torch.cuda.memory_allocated`` and
``memory_reserved``.

Record a step after the first: the first allocates AdamW's state, and the pipeline engine
measures each micro-batch shape once, under hooks of its own that hide the forward from
these (the innermost ``saved_tensors_hooks`` wins).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Iterator

import torch
import torch.distributed as dist

from edu3d.config.sections import Run
from edu3d.distributed import meter, trace
from edu3d.plan.estimate import estimate_for

KINDS = ("params", "grads", "optimizer", "activations", "comm")
PHASES = ("start", "forward", "backward", "reduce", "optimizer")
_BACKWARD = ("B", "I", "W")


class _Saved:
    """Stands in for one saved tensor; when autograd drops it, its storage is released."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: int, owner: "SavedActivations"):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self):
        self.owner.release(self.key)


class SavedActivations:
    """Bytes of the storages autograd holds for backward at this moment (parameters left
    out). ``params()`` returns the parameters now: a ZeRO-3 unit's storage is looked up at
    every save, since it moves when the unit is gathered again."""

    def __init__(self, params):
        self.params = params
        self.live: dict[int, list[int]] = {}  # storage address -> [holders, bytes]
        self.bytes = 0
        self.peak = 0

    def pack(self, t: torch.Tensor):
        s = t.untyped_storage()
        key = s.data_ptr()
        if s.nbytes() == 0 or key in {p.untyped_storage().data_ptr() for p in self.params()}:
            return t
        held = self.live.get(key)
        if held is None:
            self.live[key] = [1, s.nbytes()]
            self.bytes += s.nbytes()
            self.peak = max(self.peak, self.bytes)
        else:
            held[0] += 1
        return _Saved(t, key, self)

    @staticmethod
    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key: int) -> None:
        held = self.live.get(key)
        if held is None:
            return
        held[0] -= 1
        if held[0] == 0:
            self.bytes -= held[1]
            del self.live[key]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class MemoryRecorder(trace.Recorder):
    """Samples ``trainer``'s memory at every event of the steps it watches (:meth:`watch`),
    passing each event on to the trace's own recorder (``inner``) unchanged."""

    def __init__(self, trainer, inner: trace.Recorder | None = None):
        self.trainer = trainer
        self.inner = inner if inner is not None else trace.current()
        self.enabled = self.inner.enabled
        self.rank = self.inner.rank
        self.cuda_device = trainer.device if trainer.device.type == "cuda" else None
        self.zero_stage = trainer.par.zeros[0].stage if trainer.par.zeros else 0
        self.samples: list[dict] = []
        self.step = None
        self._ctx: dict = {}
        self._phase = "start"
        self._extra: dict[int, int] = {}  # id(collective event) -> bytes of its temporaries
        self._t0 = 0
        self._saved: SavedActivations | None = None

    def comm_us(self, exposed: bool = False) -> dict:
        return self.inner.comm_us(exposed)

    @property
    def wire(self) -> dict:
        return self.inner.wire

    # ---- the step ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def watch(self, step: int) -> Iterator["MemoryRecorder"]:
        """Record step ``step``: inside the block this recorder is the trace's, and every
        forward's saved tensors are counted."""
        self.samples, self.step, self._phase = [], step, "start"
        self._saved = SavedActivations(self._params)
        if self.trainer.par.offload is not None:  # its bytes moved in this step only
            self.trainer.par.offload.read(reset=True)
        self._t0 = time.perf_counter_ns()
        handles = self._unit_hooks()
        try:
            with trace.use(self), self._saved.hooks(), self.context(step=step):
                self._sample("step", "step", "begin", {})
                yield self
                self._sample("step", "step", "end", {})
        finally:
            for h in handles:
                h.remove()

    def _unit_hooks(self) -> list:
        """A sample after each unit's forward (embedding, block, head) and when its first
        parameter's gradient is complete (backward reaches a unit's first parameter last).
        A block's forward seen during backward is its recomputation."""
        handles = []
        for stage in self.trainer.par.stages.values():
            units = [("tok_emb", getattr(stage, "tok_emb", None))]
            units += [(f"block {i}", b) for i, b in stage.blocks.items()]
            units += [("lm_head", getattr(stage, "lm_head", None))]
            for name, mod in units:
                if mod is None:
                    continue
                handles.append(mod.register_forward_hook(
                    lambda m, i, o, name=name: self._sample(
                        "unit", name, "recompute" if self._phase == "backward" else "forward",
                        {})))
                first = next(mod.parameters(), None)
                if first is not None and first.requires_grad:
                    handles.append(first.register_post_accumulate_grad_hook(
                        lambda p, name=name: self._sample("unit", name, "backward", {})))
        return handles

    def _params(self) -> list[torch.Tensor]:
        return list(self.trainer.par.module.parameters()) + [
            u.flat_param for z in self.trainer.par.zeros for u in z.units]

    def _comm_buffers(self) -> list[torch.Tensor]:
        """The pipeline engine's message buffers: posted receives, received and not yet
        used, sends in flight."""
        e = self.trainer.engine
        out = list(getattr(e, "posted", {}).values()) + list(getattr(e, "keep", []))
        for name in ("inputs", "grads_in", "out_send", "grad_send"):
            out += [t for t in getattr(e, name, {}).values() if isinstance(t, torch.Tensor)]
        return out

    def _sample(self, lane: str, op: str, edge: str, fields: dict) -> None:
        seen: set = set()
        held = self.trainer.tensors()
        row = {c: meter.storage_bytes(held.get(c, []), seen) for c in meter.CATEGORIES}
        saved = self._saved
        row["activations"] = saved.bytes - sum(b for k, (_, b) in saved.live.items() if k in seen)
        seen |= set(saved.live)
        row["comm"] = meter.storage_bytes(self._comm_buffers(), seen) + sum(self._extra.values())
        offload = self.trainer.par.offload
        if offload is not None:  # its blocks' saved tensors on the device, and on the host
            row["activations"] += offload.now["kept"] + offload.now["device"]
            row["offloaded"] = offload.now["device"]  # of which: moved ones, back for now
            row["host"] = offload.now["host"]
        out = {"t": (time.perf_counter_ns() - self._t0) / 1e3, "lane": lane, "op": op,
               "edge": edge, "phase": self._phase}
        out.update({k: v for k, v in {**self._ctx, **fields}.items()
                    if k in ("mb", "stage", "chunk", "group", "bytes")})
        out.update(row)
        if self.cuda_device is not None:
            out["allocated"] = torch.cuda.memory_allocated(self.cuda_device)
            out["reserved"] = torch.cuda.memory_reserved(self.cuda_device)
        self.samples.append(out)

    def _temporaries(self, lane: str, op: str, fields: dict) -> int:
        """Bytes a collective's caller allocated for it (see the module docstring)."""
        if lane != "comm" or not self.zero_stage:
            return 0
        size, n = fields.get("bytes", 0), fields.get("n", 1)
        if op == "reduce_scatter":  # the flattened gradient in, the shard's sum out
            return size + size // n
        if op == "all_gather" and self._phase == "optimizer" and self.zero_stage < 3:
            return size // n  # the updated shard, copied for the gather
        return 0

    def _enter(self, lane: str, op: str, fields: dict, key: int) -> None:
        if lane == "compute":
            self._phase = "forward" if op == "F" else "backward" if op in _BACKWARD else \
                "optimizer" if op == "optimizer" else self._phase
        extra = self._temporaries(lane, op, fields)
        if extra:
            self._extra[key] = extra
        self._sample(lane, op, "begin", fields)

    def _leave(self, lane: str, op: str, fields: dict, key: int) -> None:
        self._extra.pop(key, None)
        self._sample(lane, op, "end", fields)
        if lane == "compute" and op in _BACKWARD:
            self._phase = "reduce"  # until the next compute: the gradients' communication

    # ---- the trace recorder's interface, passed on --------------------------------------------
    def now(self) -> float:
        return self.inner.now()

    @contextlib.contextmanager
    def context(self, **fields) -> Iterator[None]:
        saved = self._ctx
        self._ctx = {**saved, **{k: v for k, v in fields.items() if v is not None}}
        try:
            with self.inner.context(**fields):
                yield
        finally:
            self._ctx = saved

    def begin(self, lane: str, op: str, t0: float | None = None, **fields) -> dict:
        ev = self.inner.begin(lane, op, t0, **fields) or {"lane": lane, "op": op, **fields}
        self._enter(lane, op, fields, id(ev))
        return ev

    def end(self, ev: dict, t1: float | None = None) -> dict:
        if ev and self.inner.enabled:
            self.inner.end(ev, t1)
        if ev:
            self._leave(ev.get("lane", ""), ev.get("op", ""), ev, id(ev))
        return ev

    def record(self, lane: str, op: str, t0: float, t1: float, **fields) -> dict:
        ev = self.inner.record(lane, op, t0, t1, **fields)
        if lane != "mem":  # instants (a send posted): one sample
            self._sample(lane, op, "mark", fields)
        return ev

    def waiting(self, ev: dict) -> None:
        self.inner.waiting(ev)

    @contextlib.contextmanager
    def span(self, lane: str, op: str, **fields) -> Iterator[dict]:
        key = object()
        self._enter(lane, op, fields, id(key))
        with self.inner.span(lane, op, **fields) as ev:
            yield ev
        self._leave(lane, op, fields, id(key))

    def mark_memory(self, op: str = "mem", **categories: int) -> dict:
        ev = self.inner.mark_memory(op, **categories)
        if op != "activations":  # the engine's own count after each action: sampled already
            self._sample("mem", op, "mark", {})
        return ev

    def flush(self) -> None:
        self.inner.flush()

    # ---- the result ---------------------------------------------------------------------------
    def timeline(self) -> dict:
        """This rank's samples, its peak (the sample whose kinds add up to most) and the
        activation peak the hooks saw (between two samples too); with offloaded
        activations, what the offloader counted in the step (``offload``: bytes moved each
        way, the host pool's peak, its blocks' device-side peak)."""
        totals = [sum(s[k] for k in KINDS) for s in self.samples]
        offload = self.trainer.par.offload
        i = max(range(len(totals)), key=totals.__getitem__)
        coord = tuple(self.trainer.mesh.coord) if self.trainer.mesh.layout.world_size > 1 \
            else (0, 0, 0)
        return {"rank": self.trainer.mesh.rank, "coord": list(coord), "step": self.step,
                "samples": self.samples,
                "peak": {"index": i, "total": totals[i], **{k: self.samples[i][k] for k in KINDS},
                         "op": self.samples[i]["op"], "phase": self.samples[i]["phase"],
                         "t": self.samples[i]["t"]},
                "peak_of": {k: max(s[k] for s in self.samples) for k in KINDS},
                "activations_peak_between_samples": self._saved.peak,
                **({"offload": offload.read(reset=False)} if offload is not None else {})}


def gather_timelines(recorder: MemoryRecorder) -> list[dict] | None:
    """Every rank's :meth:`MemoryRecorder.timeline`, in rank order, on rank 0 (None on the
    others). Collective; bookkeeping, left out of the trace."""
    mine = recorder.timeline()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, out, dst=0)
    return out


def document(run: Run, timelines: list[dict], stats: dict | None = None) -> dict:
    """What ``--memory-timeline FILE`` holds: the run's options, every rank's timeline of the
    recorded step, the planner's estimate for the same run (at the step's peak and at rest,
    per pipeline rank: :func:`edu3d.plan.estimate.estimate_for`), and what
    :meth:`~edu3d.train.trainer.Trainer.stats` recorded for that step (``mem_bytes``)."""
    plan = {at: estimate_for(run, at) for at in ("peak", "rest")}
    options = {**run.flat(), "microbatches": run.microbatches,
               "freeze": ",".join(run.memory.freeze) or None}
    return {"kind": "edu3d memory timeline", "version": 1,
            "options": {k: options[k] for k in (
                "model", "dp", "tp", "pp", "zero", "microbatches", "global_batch", "schedule",
                "recompute", "offload_activations", "offload_every", "offload_last",
                "precision", "optimizer", "grad_reduce", "freeze") if k in options},
            "step": timelines[0]["step"],
            "device": "cuda" if any("allocated" in t["samples"][0] for t in timelines) else "cpu",
            "planner": {at: {"per_stage": e["per_stage"], "total_bytes": e["total_bytes"],
                             "activation_model": e["activation_model"]}
                        for at, e in plan.items()},
            "stats": stats, "ranks": timelines}


def write(path: str | os.PathLike, doc: dict) -> None:
    """Write ``doc`` as JSON: a temporary file renamed into place (never half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def peak_line(doc: dict) -> str:
    """One sentence on the fullest rank's peak and the planner's."""
    top = max(doc["ranks"], key=lambda r: r["peak"]["total"])
    planned = doc["planner"]["peak"]["per_stage"][top["coord"][0]]["total"]
    return (f"the fullest rank ({top['rank']}) peaks at {top['peak']['total'] / 2**20:.2f} MiB "
            f"in {top['peak']['phase']} ({top['peak']['op']}); the planner's peak for it: "
            f"{planned / 2**20:.2f} MiB")
