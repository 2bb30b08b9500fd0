"""A run folder's files: what each is called, who writes it and how, and how it is read.

After reading this file you should know every file of a run folder, and so how the rank
wrapper, torchrun's agent, the launcher, a warm pool and a watcher (``edu3d top``) talk to
each other without a socket: one rule per file, written down here once (:data:`RANK_FILES`,
:func:`path`, :func:`ranks`) and used by every one of them::

    RUN/                     made and kept tidy by edu3d.launch.runs (its MARKER)
      command.json           the launcher: argv, nprocs, run_id (a warm job: pool, job)
      call-args.pkl          the launcher: what a function launch (--call) is called with
      cell.py                %%torchrun: the cell
      pids/rank{R}.pid       rank R, as it starts: its pid
      errors/rank{R}.json    rank R, the moment its code raises (ERROR)
      results/rank{R}.pkl    rank R: what the function it called returned
      done/rank{R}           rank R, once its code has ended (failed or not)
      stacks/rank{R}.txt     rank R, on SIGUSR1: every thread's Python stack
      exits/rank{R}.json     torchrun's agent: how rank R's process ended (EXIT);
      exits/teardown         and when it began stopping the others
      shared/rank{R}         the agent, with several nodes: every node knows R's failure
      flight/rank{R}.json    rank R's recorder: what it is doing now (FLIGHT)
      status/rank{R}.json    rank R, while someone watches: its live status (STATUS);
      status/watching        touched by the watcher
      trace-rank{R}.jsonl    rank R's events
    POOL/                    a warm pool's folder: a run folder, and
      env.json               the environment its ranks started with
      zygote.sock zygote.log its fork server's socket and output
      ready/rank{R}          rank R imported torch and waits for jobs
      jobs/{N}.json          job N: its argv, run folder, environment
      current                the run folder of the job running now, empty between jobs:
                             the pool is busy while it names one

The flight and trace files are written by :mod:`edu3d.distributed.trace`, below this floor
(:func:`~edu3d.distributed.trace.flight_file`, :func:`~edu3d.distributed.trace.rank_file`):
``tests/test_launch_safety.py`` holds their names equal to :func:`path`'s.

**Writing.** Every file a reader may look at while it is written goes through
:func:`write_atomic` (a temporary, fsync, rename): a reader sees the old file or the new
one, never half. The ranks' records that change many times a second are written in place
with ``pwrite``, never through a memory map (:class:`edu3d.distributed.trace.Flight`,
:class:`edu3d.launch.live.StatusFile`): a process that shrinks a mapped file
(``truncate -s 0``) turns the writer's next store into the map into a SIGBUS that kills it;
a ``pwrite`` only makes the file whole again.

**Reading, as anyone's.** Any local process of the user may write into a run folder (a
watcher, a careless script, an attacker), and what the launcher reads there decides whom a
run blames and when it ends. So:

* a file is read only if it is a **regular file** of bounded size (:func:`read_small`): a
  FIFO would block the reader for ever, a link may point anywhere, a huge file would fill
  its memory on every poll;
* a **record** counts only if it has the shape its writer gives it (:func:`shaped`): the
  fields a reader needs, each of its type. Optional fields of another type are dropped;
  anything else (a JSON list, a record with no rank, ``"t": "yesterday"``, nesting a
  thousand deep) is no record at all, as if the file were not there;
* the shapes: a rank's flight record (:data:`FLIGHT`), its error (:data:`ERROR`), its exit
  as torchrun's agent saw it (:data:`EXIT`), its live status (:data:`STATUS`), and the run's
  ``command.json`` (:data:`COMMAND`);
* a rank's file counts only under its own name (``done/rank3``, not ``done/rank3x``).

One rule lives outside the folder: every line a rank writes starts with its prefix
(:data:`PREFIX_FMT`, read back with :data:`PREFIX_RE`), so the output of many ranks can
share one pipe.

Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import threading
from pathlib import Path

SMALL = 1 << 20  # bytes: the most read from a record file (a traceback fits many times)
PREFIX_FMT = "[rank {}] "  # the start of every line rank R writes (edu3d.launch.worker)
PREFIX_RE = re.compile(r"^\[rank (\d+)\] ?(.*)$")  # a rank's line, as PREFIX_FMT starts it

# ---- the names ------------------------------------------------------------------------------
# a rank's file in each folder of a run (or pool) folder: {} is the rank
RANK_FILES = {"pids": "rank{}.pid", "errors": "rank{}.json", "results": "rank{}.pkl",
              "done": "rank{}", "stacks": "rank{}.txt", "exits": "rank{}.json",
              "shared": "rank{}", "flight": "rank{}.json", "status": "rank{}.json",
              "ready": "rank{}"}
# per-run state: stale copies from an earlier run in the same folder would mislead the launcher
STATE_DIRS = ("pids", "errors", "exits", "done", "flight", "results", "stacks", "shared")
COMMAND_FILE = "command.json"
ARGS_FILE = "call-args.pkl"
CELL_FILE = "cell.py"
TEARDOWN = "exits/teardown"
WATCHING = "status/watching"
TRACE_FILE = "trace-rank{}.jsonl"
# a warm pool's folder
ENV_FILE, ZYGOTE_SOCKET, ZYGOTE_LOG, CURRENT = "env.json", "zygote.sock", "zygote.log", "current"


def path(folder: Path | str, kind: str, rank: int) -> Path:
    """Rank ``rank``'s file of ``kind`` (a key of :data:`RANK_FILES`) in ``folder``:
    ``path(run_dir, "done", 3)`` is ``run_dir/done/rank3``."""
    return Path(folder) / kind / RANK_FILES[kind].format(rank)


def ranks(folder: Path | str, kind: str) -> set[int]:
    """The ranks that left a file of ``kind`` in ``folder``, each under its own name only."""
    head, _, tail = RANK_FILES[kind].partition("{}")
    found = set()
    for p in (Path(folder) / kind).glob(f"{head}*{tail}"):
        number = p.name[len(head):len(p.name) - len(tail)]
        if number.isdigit() and str(int(number)) == number:  # rank3, never rank03
            found.add(int(number))
    return found


def job_file(pool_dir: Path, n: int) -> Path:
    """Job ``n``'s description in a warm pool's folder."""
    return Path(pool_dir) / "jobs" / f"{n}.json"


def pid_files(run_dir: Path) -> dict[int, int]:
    """``{rank: pid}`` from ``pids/rank{R}.pid`` (written by each rank as it starts)."""
    pids = {}
    for rank in ranks(run_dir, "pids"):
        try:
            pids[rank] = int(read_small(path(run_dir, "pids", rank), 32) or b"")
        except ValueError:
            pass
    return pids


# ---- writing --------------------------------------------------------------------------------
def write_atomic(target: Path, data: str | bytes) -> None:
    """Write atomically: a temporary file of this process's own, flushed to disk (fsync),
    then renamed over ``target``. A reader (the launcher, another process) sees the old file
    or the whole new one, never half of it, even after a crash; on an error the temporary
    goes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class MapOf:
    """A shape: a dict of any string keys to values of one kind (``comm_ms``: group -> ms)."""

    def __init__(self, kind):
        self.kind = kind


# the kinds: int (never a bool), float (any finite number), str, bool, a tuple of the values
# allowed, a dict (a nested shape), MapOf
FLIGHT = {"n": int, "state": ("in", "done", "failed"), "op": str, "lane": str, "group": str,
          "step": int, "mb": int, "stage": int, "t": float, "beat": float}
ERROR = {"rank": int, "type": str, "message": str, "traceback": str, "time_ns": int, "pid": int}
EXIT = {"rank": int, "pid": int, "time_ns": int, "code": int, "signal": int}
STATUS = {"rank": int, "coords": MapOf(int), "step": int, "steps": int, "step_ms": float,
          "tokens_per_s": float, "comm_ms": MapOf(float), "window_steps": int,
          "memory": {"kind": str, "allocated": float, "reserved": float, "peak": float,
                     "bytes": float},
          "t": float, "done": bool, "n": int, "gpu_util": float}
COMMAND = {"nprocs": int, "run_id": str}


# ---- reading --------------------------------------------------------------------------------
def read_small(path: Path, limit: int = SMALL) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not a link) of at most ``limit``
    bytes, else None; never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        return data if len(data) <= limit else None  # it grew while we read
    except OSError:
        return None
    finally:
        os.close(fd)


def _fits(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    if isinstance(kind, tuple):
        return isinstance(value, str) and value in kind
    return isinstance(value, kind)


def _clean(value, kind):
    """``value`` as ``kind`` allows it, or None."""
    if isinstance(kind, dict):
        return shaped(value, kind)
    if isinstance(kind, MapOf):
        if not isinstance(value, dict):
            return None
        return {k: v for k, v in value.items() if isinstance(k, str) and _fits(v, kind.kind)}
    return value if _fits(value, kind) else None


def shaped(value, shape: dict, required: tuple = ()) -> dict | None:
    """The fields of ``value`` that fit ``shape``; None unless ``value`` is a dict whose
    ``required`` fields all fit."""
    if not isinstance(value, dict):
        return None
    out = {}
    for key, kind in shape.items():
        if key in value and (clean := _clean(value[key], kind)) is not None:
            out[key] = clean
    return out if all(k in out for k in required) else None


def parse(data: bytes | None, shape: dict | None, required: tuple = ()) -> dict | None:
    """:func:`shaped` of the JSON in ``data`` (any JSON object when ``shape`` is None);
    None for no data, or not JSON."""
    if not data:
        return None
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: "[[[[...": nested too deep
        return None
    return shaped(value, shape, required) if shape is not None else \
        value if isinstance(value, dict) else None


def read_record(path: Path, shape: dict, required: tuple = (), limit: int = SMALL) -> dict | None:
    """The record in the file ``path`` (:func:`read_small`, :func:`parse`), or None."""
    return parse(read_small(path, limit), shape, required)
