"""Tracing: every instrumented operation becomes one event, and every chart is drawn from events.

After reading this file you should understand the event schema that all of edu3d shares::

    {"rank": 3, "lane": "comm", "op": "all_reduce", "group": "dp", "n": 2, "bytes": 4096,
     "t0": 1520.4, "t1": 1733.9, "step": 0, "mb": 1, "stage": 1, "chunk": 0,
     "mem": {"params": 1234, ...}, "sim": true}

* ``lane`` is ``"compute"``, ``"comm"`` or ``"mem"``; ``op`` names the operation
  (``"F"``, ``"B"``, ``"all_reduce"``, ``"send"`` ...).
* ``t0``/``t1`` are microseconds since the run's *aligned origin*: every rank passes a barrier
  and takes that instant as zero, so lanes of different ranks line up. On CPU the clock is
  ``time.perf_counter_ns``; on GPU, CUDA events (the GPU runs asynchronously, so the host clock
  would time the launch, not the kernel).
* ``group`` names the process group (``"tp"``, ``"dp"``, ``"pp"``, ``"world"``), ``n`` is its
  size and ``peer`` the other global rank of a send/recv. ``bytes`` is the size of the
  collective's full buffer S (for all-gather the gathered output, for reduce-scatter the
  input); what actually crosses the wire follows from S, ``n`` and the algorithm (a ring
  all-reduce sends ``2(n-1)/n * S`` per rank), see :func:`wire_bytes`.
* Simulated (theory) timelines use the same schema with ``"sim": true``, so one renderer draws
  both. Fields that do not apply are left out.

Each rank writes ``trace-rank{R}.jsonl`` into the run folder; :func:`load` merges them and
:func:`to_chrome` exports Chrome trace JSON, which opens in https://ui.perfetto.dev.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Iterable, Iterator

LANES = ("compute", "comm", "mem")
FIELDS = ("rank", "lane", "op", "group", "n", "peer", "bytes", "t0", "t1",
          "step", "mb", "stage", "chunk", "mem", "sim")


class Recorder:
    """Collects one rank's events and writes them as JSON lines.

    ``with rec.span("compute", "F", mb=3): ...`` times a block; ``rec.context(step=2)`` adds
    fields to every event recorded inside it. On CUDA (``cuda=True``) spans are timed with CUDA
    events and resolved when :meth:`flush` is called.
    """

    enabled = True

    def __init__(self, rank: int = 0, path: str | os.PathLike | None = None, cuda: bool = False):
        self.rank = rank
        self.path = Path(path) if path else None
        self.cuda = cuda
        self.events: list[dict] = []
        self._pending: list[tuple] = []  # (start_event, end_event, event dict) on CUDA
        self._ctx: dict = {}
        self._origin_ns = time.perf_counter_ns()
        self._cuda_origin = None

    # ---- clock --------------------------------------------------------------------------
    def align(self, barrier=None) -> None:
        """Pass ``barrier`` (e.g. ``dist.barrier``) and take that instant as time zero."""
        if barrier is not None:
            barrier()
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self._cuda_origin = torch.cuda.Event(enable_timing=True)
            self._cuda_origin.record()
        self._origin_ns = time.perf_counter_ns()

    def now(self) -> float:
        """Microseconds since the aligned origin (host clock)."""
        return (time.perf_counter_ns() - self._origin_ns) / 1e3

    # ---- recording ----------------------------------------------------------------------
    @contextlib.contextmanager
    def context(self, **fields) -> Iterator[None]:
        """Attach ``fields`` (step=, mb=, stage=, chunk=) to every event inside the block."""
        saved = self._ctx
        self._ctx = {**saved, **{k: v for k, v in fields.items() if v is not None}}
        try:
            yield
        finally:
            self._ctx = saved

    def record(self, lane: str, op: str, t0: float, t1: float, **fields) -> dict:
        """Store an event whose times (microseconds since origin) are already known."""
        if lane not in LANES:
            raise ValueError(f"lane {lane!r} must be one of {LANES}")
        ev = {"rank": self.rank, "lane": lane, "op": op, **self._ctx,
              **{k: v for k, v in fields.items() if v is not None}, "t0": t0, "t1": t1}
        self.events.append(ev)
        return ev

    @contextlib.contextmanager
    def span(self, lane: str, op: str, **fields) -> Iterator[dict]:
        """Time the enclosed block as one event; yields the event so callers can add fields."""
        if self.cuda and self._cuda_origin is not None:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            ev = self.record(lane, op, 0.0, 0.0, **fields)
            try:
                yield ev
            finally:
                end.record()
                self._pending.append((start, end, ev))
            return
        t0 = self.now()
        ev = self.record(lane, op, t0, t0, **fields)
        try:
            yield ev
        finally:
            ev["t1"] = self.now()

    def mark_memory(self, op: str = "mem", **categories: int) -> dict:
        """Record an instantaneous memory reading (bytes per category) on the mem lane."""
        t = self.now()
        return self.record("mem", op, t, t, mem=dict(categories))

    # ---- output -------------------------------------------------------------------------
    def _resolve_cuda(self) -> None:
        if not self._pending:
            return
        import torch

        torch.cuda.synchronize()
        for start, end, ev in self._pending:
            ev["t0"] = self._cuda_origin.elapsed_time(start) * 1e3
            ev["t1"] = self._cuda_origin.elapsed_time(end) * 1e3
        self._pending.clear()

    def flush(self) -> None:
        """Append the recorded events to this rank's JSONL file and forget them."""
        self._resolve_cuda()
        if self.path is not None and self.events:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                for ev in self.events:
                    f.write(json.dumps(ev) + "\n")
            self.events = []


class NullRecorder(Recorder):
    """Records nothing; used when no run folder is active, so instrumentation costs ~nothing."""

    enabled = False

    def record(self, lane, op, t0, t1, **fields):
        return {}

    def flush(self):
        pass


_current: Recorder = NullRecorder()


def current() -> Recorder:
    """The recorder of this process (set by :func:`edu3d.runtime.init`)."""
    return _current


@contextlib.contextmanager
def use(recorder: Recorder) -> Iterator[Recorder]:
    """Make ``recorder`` current inside the block."""
    global _current
    saved, _current = _current, recorder
    try:
        yield recorder
    finally:
        _current = saved


def set_current(recorder: Recorder) -> None:
    global _current
    _current = recorder


# ---- reading, merging, exporting ------------------------------------------------------------
def rank_file(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / f"trace-rank{rank}.jsonl"


def load(run_dir: str | os.PathLike) -> list[dict]:
    """All events of a run folder, every rank merged, sorted by start time then rank."""
    events = []
    for path in sorted(Path(run_dir).glob("trace-rank*.jsonl")):
        with open(path) as f:
            events.extend(json.loads(line) for line in f if line.strip())
    return sorted(events, key=lambda e: (e["t0"], e["rank"]))


def wire_bytes(ev: dict) -> float:
    """Bytes this rank sends for a collective event, if run as a ring (the textbook cost).

    all_reduce ``2(n-1)/n*S``; all_gather and reduce_scatter ``(n-1)/n*S``; broadcast and
    send ``S``; everything else 0.
    """
    s, n = ev.get("bytes", 0), ev.get("n", 1)
    op = ev["op"]
    if op == "all_reduce":
        return 2 * (n - 1) / n * s
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * s
    if op in ("broadcast", "send"):
        return s
    return 0.0


def to_chrome(events: Iterable[dict], path: str | os.PathLike | None = None) -> dict:
    """Chrome trace JSON (opens in Perfetto): one process per rank, one thread per lane.

    Simulated events go to a separate process per rank named ``theory rank R``.
    """
    out, seen = [], set()
    for ev in events:
        pid = ev["rank"] + (10_000 if ev.get("sim") else 0)
        tid = LANES.index(ev["lane"])
        if (pid, tid) not in seen:
            seen.add((pid, tid))
            pname = f"{'theory ' if ev.get('sim') else ''}rank {ev['rank']}"
            out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": pname}})
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                        "args": {"name": ev["lane"]}})
        args = {k: v for k, v in ev.items() if k not in ("rank", "lane", "op", "t0", "t1")}
        if ev["lane"] == "mem" and "mem" in ev:
            out.append({"ph": "C", "name": ev["op"], "pid": pid, "ts": ev["t0"], "args": ev["mem"]})
            continue
        name = ev["op"] + (f" mb{ev['mb']}" if "mb" in ev else "")
        out.append({"ph": "X", "name": name, "cat": ev["lane"], "pid": pid, "tid": tid,
                    "ts": ev["t0"], "dur": max(ev["t1"] - ev["t0"], 0.0), "args": args})
    doc = {"traceEvents": out, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(doc))
    return doc
