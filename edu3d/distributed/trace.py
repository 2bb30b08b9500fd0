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
* Simulated (theory) timelines use the same schema with ``"sim": true``; fields that do not
  apply are left out. :meth:`Recorder.comm_us` is each group's covered (never summed) time.

Each rank appends to ``trace-rank{R}.jsonl`` in the run folder as events finish (and keeps
``flight/rank{R}.json``, the operation it is in right now); :func:`load` merges them and
:func:`to_chrome` exports Chrome trace JSON, which opens in https://ui.perfetto.dev.

torch comes in through imports inside functions: the launcher merges and exports traces
without torch (``edu3d run`` costs what a bare torchrun costs).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

from edu3d.distributed.coverage import COMPUTE, Coverage

LANES = ("compute", "comm", "mem")
FIELDS = ("rank", "lane", "op", "group", "n", "peer", "bytes", "t0", "t1",
          "step", "mb", "stage", "chunk", "mem", "sim")


class Flight:
    """A flight recorder: this rank's current operation, in a small file others can read.

    When a run hangs, the launcher reads every rank's file and reports what each one was
    doing (``rank 0 waits in all_reduce(dp) at step 3``). Each note rewrites the record
    (``n`` counts the notes), and a thread of the rank rewrites it :data:`BEAT_S` times a
    second with the time (``beat``). So the record **beats**: a rank that waits in a
    collective, sleeps or computes keeps beating; one that stopped (``kill -STOP``) or is
    stuck where no thread of it can run falls silent. That is how the launcher's heartbeat
    tells them apart (:mod:`edu3d.launch.heartbeat`).

    The file is rewritten in place with ``pwrite`` (a copy into the page cache, a few
    microseconds), never through a memory map: a process that shrinks a mapped file
    (``truncate -s 0``) turns the next store into the map into a SIGBUS that kills the rank;
    a ``pwrite`` only makes the file whole again."""

    SIZE = 512
    BEAT_S = 0.25

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:  # a fresh file of our own, over whatever another process put at its name
            tmp.unlink(missing_ok=True)
            self._fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            os.replace(tmp, path)
        except OSError:  # (a folder there): no record, as on a rank outside any run folder
            self._fd = -1
        self.state, self.notes, self._record = None, 0, None
        self._beat: float | None = round(time.time(), 3)
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._beating, name="edu3d-flight", daemon=True)
        self._thread.start()

    def note(self, state: str, ev: dict) -> None:
        """``state``: ``"in"`` (entered, not finished), ``"done"`` or ``"failed"``; ``t`` is
        the wall-clock time of the note, ``n`` its number (the launcher's heartbeat watches
        it change)."""
        self.state = state
        self.notes += 1
        keep = {k: ev[k] for k in ("op", "lane", "group", "step", "mb", "stage") if k in ev}
        self._record = {"n": self.notes, "state": state, **keep, "t": round(time.time(), 3)}
        self._write()

    def _write(self) -> None:
        with self._lock:  # the latest record, whoever writes it (note or beat)
            if self._record is None or self._fd < 0:
                return
            beat = {} if self._beat is None else {"beat": self._beat}
            data = json.dumps({**self._record, **beat}).encode()[: self.SIZE]
            try:
                os.pwrite(self._fd, data.ljust(self.SIZE), 0)
            except OSError:  # a full disk: the record goes stale, the rank trains on
                pass

    def _beating(self) -> None:
        while not self._stop.wait(self.BEAT_S):
            self._beat = round(time.time(), 3)
            self._write()

    def close(self) -> None:
        """Stop beating, write the last record without a beat (silence is then no sign of a
        stop), close the file (a warm rank's next job has a flight recorder of its own)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        self._beat = None
        self._write()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class Recorder:
    """Collects one rank's events and writes them as JSON lines, each as soon as it ends.

    ``with rec.span("compute", "F", mb=3): ...`` times a block; ``rec.context(step=2)`` adds
    fields to every event recorded inside it. With a ``path`` every finished event is appended
    to the file at once (a failed or killed run keeps its trace up to the failure, and memory
    does not grow with steps); without one, events stay in :attr:`events`. On CUDA
    (``cuda=True``) spans are timed with CUDA events and written when :meth:`flush` resolves
    them. ``flight`` (a :class:`Flight`) is told which operation is open right now.
    """

    enabled = True

    def __init__(self, rank: int = 0, path: str | os.PathLike | None = None, cuda: bool = False,
                 flight: Flight | None = None):
        self.rank = rank
        self.path = Path(path) if path else None
        self.cuda = cuda
        self.flight = flight
        self.events: list[dict] = []  # kept in memory only when there is no path
        self.coverage = Coverage()  # time in communication so far, by group, and exposed
        self.wire: dict[str, float] = {}  # bytes sent so far (ring costs), by collective kind
        self._pending: list[tuple] = []  # (start_event, end_event, event dict) on CUDA
        self._open: list[dict] = []  # spans entered and not yet left, innermost last
        self._waiting: dict | None = None  # the asynchronous op the flight record shows
        self._file = None
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

    def begin(self, lane: str, op: str, t0: float | None = None, **fields) -> dict:
        """An event that has started; :meth:`end` finishes and writes it."""
        if lane not in LANES:
            raise ValueError(f"lane {lane!r} must be one of {LANES}")
        t0 = self.now() if t0 is None else t0
        return {"rank": self.rank, "lane": lane, "op": op, **self._ctx,
                **{k: v for k, v in fields.items() if v is not None}, "t0": t0, "t1": t0}

    def end(self, ev: dict, t1: float | None = None) -> dict:
        ev["t1"] = self.now() if t1 is None else t1
        if ev is self._waiting:  # the awaited op is over: the flight record says so
            self._waiting = None
            if self.flight is not None and self.flight.state != "failed":
                self.flight.note(*(("in", self._open[-1]) if self._open else ("done", ev)))
        if ev["lane"] == "comm":
            self.coverage.add(ev.get("group", "world"), ev["t0"], ev["t1"])
            self.wire[ev["op"]] = self.wire.get(ev["op"], 0.0) + wire_bytes(ev)
        elif ev["lane"] == "compute":
            self.coverage.add(COMPUTE, ev["t0"], ev["t1"])
        self._emit(ev)
        return ev

    def comm_us(self, exposed: bool = False) -> dict[str, float]:
        """Covered microseconds per group (and ``any``), or ``exposed`` ones (no compute beside)."""
        self.coverage.fold(self.now())
        return dict(self.coverage.exposed if exposed else self.coverage.covered)

    def record(self, lane: str, op: str, t0: float, t1: float, **fields) -> dict:
        """Store an event whose times (microseconds since origin) are already known."""
        return self.end(self.begin(lane, op, t0, **fields), t1)

    def waiting(self, ev: dict) -> None:
        """Tell the flight recorder this rank now waits for ``ev`` (an asynchronous op);
        :meth:`end` tells it the wait is over."""
        self._waiting = ev
        if self.flight is not None:
            self.flight.note("in", ev)

    @contextlib.contextmanager
    def span(self, lane: str, op: str, **fields) -> Iterator[dict]:
        """Time the enclosed block as one event; yields the event so callers can add fields."""
        ev = self.begin(lane, op, **fields)
        self._open.append(ev)
        if self.flight is not None:
            self.flight.note("in", ev)  # entered, not finished: what a hang report shows
        cuda = self.cuda and self._cuda_origin is not None
        if cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        try:
            yield ev
        except BaseException:
            if self.flight is not None and self.flight.state != "failed":
                self.flight.note("failed", ev)
            raise
        finally:
            self._open.pop()
            if cuda:
                end.record()
                self._pending.append((start, end, ev))
            else:
                self.end(ev)
        if self.flight is not None:
            self.flight.note(*(("in", self._open[-1]) if self._open else ("done", ev)))

    def mark_memory(self, op: str = "mem", **categories: int) -> dict:
        """Record an instantaneous memory reading (bytes per category) on the mem lane."""
        t = self.now()
        return self.record("mem", op, t, t, mem=dict(categories))

    # ---- output -------------------------------------------------------------------------
    def _emit(self, ev: dict) -> None:
        if self.path is None:
            self.events.append(ev)
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # one line, one write
        self._file.write(json.dumps(ev) + "\n")

    def _resolve_cuda(self) -> None:
        if not self._pending:
            return
        import torch

        torch.cuda.synchronize()
        for start, end, ev in self._pending:
            ev["t0"] = self._cuda_origin.elapsed_time(start) * 1e3
            self.end(ev, self._cuda_origin.elapsed_time(end) * 1e3)
        self._pending.clear()

    def flush(self) -> None:
        """Write what is still pending (CUDA-timed spans) and flush the file."""
        self._resolve_cuda()
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """:meth:`flush`, then stop the flight recorder's thread (a recorder retired)."""
        self.flush()
        if self.flight is not None:
            self.flight.close()


class NullRecorder(Recorder):
    """Records nothing; used when no run folder is active, so instrumentation costs ~nothing."""

    enabled = False

    def begin(self, lane, op, t0=None, **fields):
        return {}

    def end(self, ev, t1=None):
        return ev

    def record(self, lane, op, t0, t1, **fields):
        return {}

    def waiting(self, ev):
        pass

    @contextlib.contextmanager
    def span(self, lane, op, **fields):
        yield {}

    def flush(self):
        pass

    def close(self):
        pass


_current: Recorder = NullRecorder()


def current() -> Recorder:
    """The recorder of this process (set by :func:`edu3d.distributed.runtime.init`)."""
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


def flight_file(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / "flight" / f"rank{rank}.json"


def load(run_dir: str | os.PathLike) -> list[dict]:
    """All events of a run folder, every rank merged, sorted by start time then rank."""
    events = []
    for path in sorted(Path(run_dir).glob("trace-rank*.jsonl")):
        with open(path) as f:
            events.extend(json.loads(line) for line in f if line.strip())
    return sorted(events, key=lambda e: (e["t0"], e["rank"]))


def wire_bytes(ev: dict) -> float:
    """Bytes this rank sends for a collective event, if run as a ring (the textbook cost).

    all_reduce ``2(n-1)/n*S``; all_gather and reduce_scatter ``(n-1)/n*S``; all_to_all
    ``(n-1)/n*S`` (exact for equal blocks; an expert-parallel exchange's blocks are as uneven
    as its routing); broadcast and send ``S``; everything else 0.
    """
    s, n = ev.get("bytes", 0), ev.get("n", 1)
    op = ev["op"]
    if op == "all_reduce":
        return 2 * (n - 1) / n * s
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
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
