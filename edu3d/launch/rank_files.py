"""The files ranks leave in a run folder, read as anyone's: bounded, regular, and of the right shape.

After reading this file you should understand why the launcher, torchrun's agent and a
watcher (``edu3d top``) trust no byte of a run folder. Any local process of the user may
write there (a watcher, a careless script, an attacker), and what the launcher reads there
decides whom a run blames and when it ends. So:

* a file is read only if it is a **regular file** of bounded size (:func:`read_small`): a
  FIFO would block the reader for ever, a link may point anywhere, a huge file would fill
  its memory on every poll;
* a **record** counts only if it has the shape its writer gives it (:func:`shaped`): the
  fields a reader needs, each of its type. Optional fields of another type are dropped;
  anything else (a JSON list, a record with no rank, ``"t": "yesterday"``, nesting a
  thousand deep) is no record at all, as if the file were not there;
* the shapes: a rank's flight record (:data:`FLIGHT`), its error (:data:`ERROR`), its exit
  as torchrun's agent saw it (:data:`EXIT`), its live status (:data:`STATUS`), and the run's
  ``command.json`` (:data:`COMMAND`).

The ranks, for their part, write so that no other process can crash them: in place with
``pwrite``, never through a memory map (:class:`edu3d.distributed.trace.Flight`,
:class:`edu3d.launch.live.StatusFile`). A process that shrinks a mapped file
(``truncate -s 0``) turns the writer's next store into the map into a SIGBUS that kills it;
a ``pwrite`` only makes the file whole again.

Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

SMALL = 1 << 20  # bytes: the most read from a record file (a traceback fits many times)


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
