"""The processes a graded submission starts, and how ``edu3d grade`` ends every one of them.

After reading this file you should understand why stopping the kernel is not enough, and
what is done instead:

* the learner's module runs in the kernel, so it can start processes: fork at import, start a
  session of its own (``setsid``) and fork again. Such a daemon has left the kernel's process
  group and session; orphaned, it is adopted by init and outlives the grade (and can rewrite
  the grade's output after the grader wrote it). Killing the kernel's group misses it;
* while a notebook is graded, the grader is a **child subreaper** (Linux
  ``prctl(PR_SET_CHILD_SUBREAPER)``): an orphan anywhere below it is adopted by the grader,
  not by init, so it stays in the grader's tree whatever it does to its session;
* every process of one grade also carries a fresh marker in its environment,
  ``EDU3D_GRADE_TOKEN``: one that got out of the tree anyway (under another subreaper) is found
  by it in ``/proc``, unless it replaced its environment with ``exec``;
* when the kernel has ended, :meth:`Watch.sweep` kills (SIGKILL) every process that became the
  grader's descendant during the grade and every marked one, again until none is left, reaps
  them, and says how many it killed and which (if any) would not die;
* the grader itself is made non-dumpable (:func:`protect_grader`): its ``/proc`` entries (open
  files, memory, environment) are then closed to the submission's processes, unless they run
  as root, so they cannot find the file the grader's report goes to.

What escapes all of this: a process another service starts on the submission's request (a
``systemd-run --user`` unit, an ``at`` job, a login over ``ssh``) is nobody's descendant and
carries no marker. ``edu3d grade --isolate`` (:mod:`edu3d.course.autograde.isolate`) closes most of
those doors. On a system without ``prctl`` (not Linux) only the marker and the kernel's own
process group remain.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

TOKEN = "EDU3D_GRADE_TOKEN"  # in the environment of every process a grade starts
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 4, 36, 37


def prctl(option: int, arg: int) -> int | None:
    """Linux ``prctl(option, arg)``'s result, or None where there is none (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if not hasattr(libc, "prctl"):
            return None
    except OSError:
        return None
    if option == PR_GET_CHILD_SUBREAPER:
        out = ctypes.c_int(0)
        return out.value if libc.prctl(option, ctypes.byref(out), 0, 0, 0) == 0 else None
    return libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0)


def protect_grader() -> bool:
    """Make this process non-dumpable: the submission's processes (not root) can no longer
    open its ``/proc/PID/fd``, ``mem`` or ``environ``. True when it took effect."""
    return prctl(PR_SET_DUMPABLE, 0) == 0


def parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process this one can see."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name, in parentheses, may hold spaces and parentheses itself
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[1].lstrip("-").isdigit():
            out[int(entry.name)] = int(fields[1])
    return out


def descendants(root: int, table: dict[int, int] | None = None) -> set[int]:
    """Every process below ``root``."""
    table = parents() if table is None else table
    kids: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        kids.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for kid in kids.get(todo.pop(), []):
            if kid not in found:
                found.add(kid)
                todo.append(kid)
    return found


def descends(pid: int, ancestor: int) -> bool:
    """True when process ``pid`` runs below ``ancestor``."""
    return pid in descendants(ancestor)


def marked(token: str) -> set[int]:
    """Processes whose environment (as they started) holds ``EDU3D_GRADE_TOKEN=token``."""
    mark = f"{TOKEN}={token}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] != "Z"


class Watch:
    """One grade's processes: from ``with Watch(token) as w`` to ``w.sweep()``."""

    def __init__(self, token: str):
        self.token, self.me = token, os.getpid()
        self.before: set[int] = set()
        self.was_subreaper: int | None = None

    def __enter__(self) -> Watch:
        # what already ran below the grader (a test's own helpers) is not the submission's
        self.before = descendants(self.me)
        self.was_subreaper = prctl(PR_GET_CHILD_SUBREAPER, 0)
        if self.was_subreaper == 0:
            prctl(PR_SET_CHILD_SUBREAPER, 1)
        return self

    def __exit__(self, *exc) -> None:
        if self.was_subreaper == 0:
            prctl(PR_SET_CHILD_SUBREAPER, 0)

    def targets(self) -> set[int]:
        """The grade's processes still running: new descendants, and marked processes."""
        new = descendants(self.me) - self.before
        return {p for p in new | marked(self.token) if p != self.me and alive(p)}

    def sweep(self, grace_s: float = 1.0, rounds: int = 50) -> dict:
        """Kill every process of the grade still running after ``grace_s`` (the time a
        kernel's own helpers, such as warm rank pools, take to notice it ended); ``{"killed":
        n, "survivors": [pids]}`` (survivors: still there after ``rounds`` passes of SIGKILL,
        e.g. stuck in the OS)."""
        deadline = time.monotonic() + grace_s
        while self.targets() and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.1)
        killed: set[int] = set()
        for _ in range(rounds):
            found = self.targets()
            if not found:
                break
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.05)
            self.reap()
        self.reap()
        return {"killed": len(killed), "survivors": sorted(self.targets())}

    def reap(self) -> None:
        """Collect the exit of every dead child adopted during the grade (no zombies left)."""
        for pid in descendants(self.me) - self.before:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
