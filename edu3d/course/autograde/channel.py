"""The grader's end of the verdict channel: who may connect, and which records count.

After reading this file you should understand what :mod:`edu3d.course.verdict_channel` talks
to, and how a record becomes a check's verdict:

* before the kernel starts, the grader listens on a Unix socket in the grade's private
  temporary folder. The first process to connect must run below the grader (its pid, from
  ``SO_PEERCRED``); then the socket's file is removed, so no one connects after it. That
  process (the kernel's startup file) is sent a fresh 32-byte key and the notebook's cells;
* a thread reads the records as they come. A cell's records are those that arrive while the
  grader runs that cell: nbclient's callbacks mark where each cell starts and ends, and a
  record is in the socket before the reply of the cell that made it;
* a line counts when its MAC is right under this run's key and its number is higher than the
  last one's (no replay); every other line is ``rejected``. Standard output never counts.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path

from edu3d.course.autograde.processes import descends
from edu3d.course.verdict_channel import ADDRESS, decode

LINE_MAX = 1 << 20  # a longer line is no record: dropped
SUN_PATH_MAX = 100  # bytes of a Unix socket's path (108 on Linux, 104 on macOS)


class Channel:
    """One kernel's verdicts: open it before the kernel starts, :meth:`close` after it ended."""

    def __init__(self, folder: Path, cells: list[str], owner: int | None = None,
                 wait_s: float = 600):
        self.key = secrets.token_bytes(32)
        self.path = folder / "verdicts.sock"
        self._own = None  # a short private folder of its own, when ``folder``'s path is long
        if len(os.fsencode(self.path)) > SUN_PATH_MAX:
            self._own = Path(tempfile.mkdtemp(prefix="edu3d-verdicts-", dir="/tmp"))
            self.path = self._own / "verdicts.sock"
        self.refused: list[str] = []  # connections turned away, and why
        self.connected = False
        self._hello = (json.dumps({"key": self.key.hex(), "cells": cells}) + "\n").encode()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        self._listener.listen(4)
        if owner is not None:  # --isolate as root: the kernel runs as this user
            os.chown(self.path, owner, -1)
        self._conn: socket.socket | None = None
        self._events: list = []  # bytes read, and ("start" | "end", cell index) marks
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(wait_s,), daemon=True)
        self._thread.start()

    @property
    def env(self) -> dict[str, str]:
        """What the kernel's environment needs to find the channel."""
        return {ADDRESS: str(self.path)}

    def _accept(self, wait_s: float) -> socket.socket | None:
        deadline = time.monotonic() + wait_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            if not select.select([self._listener], [], [], 0.2)[0]:
                continue
            conn, _ = self._listener.accept()
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
            pid = struct.unpack("3i", creds)[0]
            if descends(pid, os.getpid()):
                return conn
            self.refused.append(f"pid {pid} does not run below the grader")
            conn.close()
        return None

    def _serve(self, wait_s: float) -> None:
        conn = self._accept(wait_s)
        self._listener.close()
        self.path.unlink(missing_ok=True)
        if conn is None:
            return
        with self._lock:  # before the hello: whatever the kernel sends after it is read
            conn.sendall(self._hello)
            conn.setblocking(False)
            self._conn, self.connected = conn, True
        while not self._stop.is_set():
            if select.select([conn], [], [], 0.2)[0] and not self._drain():
                return

    def _drain(self) -> bool:
        """Take what the socket holds now; False once the kernel closed its end."""
        with self._lock:
            if self._conn is None:
                return False
            while True:
                try:
                    data = self._conn.recv(1 << 16)
                except BlockingIOError:
                    return True
                except OSError:
                    return False
                if not data:
                    return False
                self._events.append(data)

    def mark(self, what: str, index: int) -> None:
        """Cell ``index`` starts (``"start"``) or has replied (``"end"``)."""
        with self._lock:  # the bytes before the mark are the cell's, all of them
            self._drain()
            self._events.append((what, index))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            self._drain()
            if self._conn is not None:
                self._conn.close()
        self.path.unlink(missing_ok=True)
        if self._own is not None:
            self._own.rmdir()

    def records(self) -> tuple[dict[int, list[dict]], int]:
        """``({cell index: [record, ...]}, rejected lines)``: each valid record under the cell
        it arrived in (lines between cells count for none)."""
        out: dict[int, list[dict]] = {}
        rejected, last, cell, pending = 0, 0, None, b""
        with self._lock:
            events = list(self._events)
        for event in events:
            if isinstance(event, tuple):
                cell = event[1] if event[0] == "start" else None
                continue
            pending += event
            *lines, pending = pending.split(b"\n")
            for line in lines:
                rec = decode(self.key, line) if len(line) < LINE_MAX else None
                if not _valid(rec) or rec["n"] <= last:
                    rejected += 1
                    continue
                last = rec["n"]
                if cell is not None:
                    out.setdefault(cell, []).append(rec)
        return out, rejected + bool(pending.strip())


def _valid(rec) -> bool:
    return (isinstance(rec, dict) and type(rec.get("n")) is int
            and isinstance(rec.get("title"), str) and isinstance(rec.get("passed"), bool)
            and (rec.get("hint") is None or isinstance(rec.get("hint"), str)))
