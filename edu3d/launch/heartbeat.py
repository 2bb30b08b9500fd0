"""Heartbeat: telling a hung rank from a slow one, and naming it before the collective timeout.

After reading this file you should understand how the launcher decides that a run has stopped
making progress, and whom it blames:

* a rank **makes progress** when its flight record changes (it entered or left an operation,
  :class:`edu3d.distributed.trace.Flight`) or when it uses the CPU or is ready to and waits for a core
  (a long computation between two notes is work, not a hang, and so is one starved of CPU
  on a busy machine). A rank waiting *inside a collective* is judged by its notes alone: a
  GPU rank may spin a core while it waits;
* a rank **stalls** when it made no progress for ``seconds`` (the heartbeat). Watching starts
  with the run's first note, so importing torch and building the model never count;
* a rank **falls silent** when its flight record stopped *beating* (a thread of the rank
  rewrites it four times a second, whatever the rank does) and it used no CPU, for half the
  heartbeat (:func:`silent_seconds`): the process is stopped (``kill -STOP``), blocked in
  the kernel, or stuck where no thread of it can run. That is no rank waiting in a
  collective, wherever its record says it is: it is named first, from its ``/proc`` state;
* the run **hangs** when a rank stalls outside any collective while every other rank that is
  still running waits inside one (they wait for it: it is the one to blame; when several
  stall outside a collective, e.g. one blocked in a pipeline receive that notes nothing, the
  one at the earliest step, then with the oldest note, is named first), or when every
  rank waits inside a collective and none finished one for ``seconds`` (a deadlock; when the
  ranks wait in different operations, a mismatched collective).

With several nodes, each node's launcher watches the ranks of its own node (it sees no
other's processes) and tells the other nodes whom it named: the verdict is written as that
rank's error, which torchrun's agents share (:class:`edu3d.launch.agent.SharedFailures`),
so every node ends its run naming the same rank. All of a node's ranks waiting in
collectives may then be another node's rank's fault, and that node's verdict takes a moment
to travel: a node calls a deadlock of its own only after ``deadlock_s``, halfway from the
heartbeat to the collective timeout (:func:`deadlock_seconds`).

The default heartbeat is half the collective timeout (``EDU3D_TIMEOUT``, 60 s): the hang is
named before gloo's timeout fires on a *waiting* rank, which would blame the wrong one. The
launcher then asks the hung rank for its Python stack (``SIGUSR1``, see
:mod:`edu3d.launch.worker`), kills every process, and raises :class:`~edu3d.launch.api.RankHung`, which
``--max-restarts`` treats like a death.

Nothing here imports torch.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

from edu3d.launch import run_files, runs
from edu3d.launch.runs import describe, read_flight

CPU_BUSY = 0.08  # share of a core (used, or waited for) above which a rank is computing


def collective_seconds(env: dict | None = None) -> float:
    """The collective timeout: ``EDU3D_TIMEOUT`` in ``env`` (else this process's), else 60 s."""
    text = (os.environ if env is None else env).get("EDU3D_TIMEOUT") or "60"
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"EDU3D_TIMEOUT={text!r}: the collective timeout must be seconds > 0")
    return value


def default_seconds(env: dict | None = None) -> float:
    """Half the collective timeout (``EDU3D_TIMEOUT`` in ``env``, else 60 s)."""
    return collective_seconds(env) / 2


def deadlock_seconds(heartbeat: float, nnodes: int, env: dict | None = None) -> float:
    """How long every rank of one node may wait in collectives before its launcher calls it
    a deadlock: the heartbeat on one node; with several, halfway to the collective timeout
    (another node may be naming its own rank meanwhile)."""
    return heartbeat if nnodes <= 1 else (heartbeat + collective_seconds(env)) / 2


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` so far (all its threads), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def demand_seconds(pid: int) -> float | None:
    """CPU time of process ``pid`` (:func:`cpu_seconds`) plus the time its main thread, the
    one running Python, spent ready to run but waiting for a core (``/proc/PID/schedstat``).
    A rank that computes on a loaded machine may get less than :data:`CPU_BUSY` of a core
    and still wait for more: it is starved, not hung. A hung rank sleeps in a system call,
    and a sleeping thread waits for no core."""
    cpu = cpu_seconds(pid)
    if cpu is None:
        return None
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            waited_ns = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):  # a kernel without scheduler statistics
        waited_ns = 0
    return cpu + waited_ns / 1e9


def silent_seconds(seconds: float) -> float:
    """How long a rank may go without beating before it is named: half the heartbeat (a
    beat is a surer sign than a note, it comes four times a second whatever the rank does),
    and not under a second (unless the heartbeat itself is shorter)."""
    return max(seconds / 2, min(seconds, 1.0))


STOPPED = ("T", "t")  # /proc states of a stopped process: it cannot answer a signal now


def process_state(pid: int | None) -> str | None:
    """The state letter of process ``pid`` in ``/proc`` (``R``, ``S``, ``D``, ``T`` ...)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, TypeError):
        return None


def check_seconds(heartbeat: float | None, env: dict | None = None) -> float:
    """The heartbeat a launch uses (``None``: :func:`default_seconds`); ``ValueError`` (one
    line, before any process starts) unless it is seconds >= 0 (0: off) and shorter than
    the collective timeout ``EDU3D_TIMEOUT`` in ``env`` (else this process's, else 60 s)."""
    collective_s = collective_seconds(env)
    if heartbeat is None:
        heartbeat = collective_s / 2
    if isinstance(heartbeat, bool) or not isinstance(heartbeat, (int, float)) or \
            not heartbeat >= 0:
        raise ValueError(f"heartbeat must be seconds >= 0 (0: off), not {heartbeat!r}")
    if heartbeat >= collective_s:
        raise ValueError(
            f"heartbeat {heartbeat:g} s must be shorter than the collective timeout "
            f"{collective_s:g} s (EDU3D_TIMEOUT): otherwise a rank waiting for the hung one "
            "times out first and is blamed instead")
    return float(heartbeat)


class Watch:
    """The launcher's view of every rank's progress; :meth:`check` it a few times a second.
    ``deadlock_s``: how long every rank here may wait in collectives before that is called a
    deadlock (``seconds``, or longer with several nodes: see the module's docstring)."""

    def __init__(self, run_dir: Path, nprocs: int, seconds: float,
                 deadlock_s: float | None = None):
        self.run_dir, self.nprocs, self.seconds = Path(run_dir), nprocs, float(seconds)
        self.deadlock_s = max(self.seconds, deadlock_s or 0.0)
        self.silent_s = silent_seconds(self.seconds)
        self.started: float | None = None  # when the run's first note was seen
        self.rec: dict[int, dict | None] = {}
        self.noted: dict[int, float] = {}  # when each rank's record last changed
        self.beat: dict[int, float] = {}  # when each rank's record last beat
        self.busy: dict[int, float] = {}  # when each rank last used or waited for the CPU
        self.cpu: dict[int, tuple[float, float]] = {}  # (time, demand seconds) of last sample

    def _sample(self, now: float) -> list[int]:
        """Read every rank of this node once; returns them."""
        pids = run_files.pid_files(self.run_dir)
        ranks = runs.ranks_here(self.run_dir, self.nprocs)
        for r in ranks:
            rec, old = read_flight(self.run_dir, r), self.rec.get(r)
            if rec is not None and rec != old:
                if old is None or _notes(rec) != _notes(old):
                    self.noted[r] = now
                    if self.started is None:
                        self.started = now
                if "beat" in rec and rec.get("beat") != (old or {}).get("beat"):
                    self.beat[r] = now
                if "beat" not in rec:  # its recorder closed: it no longer beats
                    self.beat.pop(r, None)
                self.rec[r] = rec
            cpu = demand_seconds(pids[r]) if r in pids else None
            if cpu is None:
                continue
            t, before = self.cpu.get(r, (now, cpu))
            if now - t >= 0.5 or r not in self.cpu:
                if cpu - before >= CPU_BUSY * (now - t) and now > t:
                    self.busy[r] = now
                self.cpu[r] = (now, cpu)
        return ranks

    def check(self, now: float | None = None) -> dict | None:
        """None while the run makes progress; else ``{"rank", "ranks", "message",
        "stack"}`` (``stack``: whether the rank can answer a request for its stack)."""
        now = time.monotonic() if now is None else now
        ranks = self._sample(now)
        if self.started is None:
            return None
        done = run_files.ranks(self.run_dir, "done")
        active = [r for r in ranks if r not in done]
        waiting = {r for r in active
                   if (self.rec.get(r) or {}).get("state") == "in"
                   and (self.rec.get(r) or {}).get("lane") == "comm"}

        def quiet(r: int) -> float:  # neither beating nor using the CPU for so long
            return now - max(self.beat[r], self.busy.get(r, self.started), self.started)

        silent = sorted((r for r in active if r in self.beat and quiet(r) > self.silent_s),
                        key=quiet, reverse=True)
        if silent:
            return self._verdict(silent, active, quiet(silent[0]), self._stopped(silent[0]),
                                 "silent", process_state(self._pid(silent[0])) not in STOPPED)

        def last_progress(r: int) -> float:
            times = [self.noted.get(r, self.started)]
            if r not in waiting:
                times.append(self.busy.get(r, self.started))
            return max(max(times), self.started)

        stalled = [r for r in active if now - last_progress(r) > self.seconds]
        def behind(r: int) -> tuple:  # the furthest behind first: the others wait for it
            rec = self.rec.get(r) or {}
            return (rec.get("step", -1), self.noted.get(r, self.started))

        culprits = sorted((r for r in stalled if r not in waiting), key=behind)
        if culprits and all(r in waiting for r in active if r not in culprits):
            return self._verdict(culprits, active, now - last_progress(culprits[0]),
                                 "outside any collective", "stalled outside a collective")
        stuck = [r for r in active if now - last_progress(r) > self.deadlock_s]
        if active and not culprits and len(stuck) == len(active):
            signatures = {r: (self.rec[r].get("op"), self.rec[r].get("group"),
                              self.rec[r].get("step")) for r in active}
            counts = Counter(signatures.values())
            if len(counts) > 1:  # blame the rarest operation, its earliest entrant first
                odd = sorted(active, key=lambda r: (counts[signatures[r]], last_progress(r)))
                why = "inside a collective the others did not call (a mismatched collective)"
            else:
                odd = sorted(active, key=last_progress)
                why = "inside a collective, as every rank does (a deadlock)"
            return self._verdict(odd[:1], active, now - max(map(last_progress, active)), why)
        return None

    def _pid(self, rank: int) -> int | None:
        return run_files.pid_files(self.run_dir).get(rank)

    def _stopped(self, rank: int) -> str:
        state = process_state(self._pid(rank))
        how = {"T": "stopped by a signal (kill -STOP, Ctrl-Z)", "t": "stopped by a debugger",
               "D": "blocked in the kernel (a disk or a device)"}.get(
            state, "stuck where none of its threads can run (Python's GIL held?)")
        return f"its flight record stopped beating: the process is {how}"

    def _verdict(self, ranks: list[int], active: list[int], idle_s: float, why: str,
                 several: str = "", stack: bool = True) -> dict:
        """The error's text: who, for how long, and what every rank still running was doing
        (from its flight record), in rank order; ``several``: what the ``ranks`` all are."""
        doing = "; ".join(f"rank {o} {describe(self.rec.get(o))}" for o in active)
        message = (f"hung: no progress for {idle_s:.1f} s (heartbeat {self.seconds:g} s) {why}; "
                   f"{doing}")
        if len(ranks) > 1:
            message += f" (ranks {ranks} all {several}; rank {ranks[0]} first)"
        return {"rank": ranks[0], "ranks": ranks, "message": message, "stack": stack}


def _notes(rec: dict) -> dict:
    """A flight record without its beat: it changes when the rank notes an operation."""
    return {k: v for k, v in rec.items() if k != "beat"}
