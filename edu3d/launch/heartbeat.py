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
* the run **hangs** when a rank stalls outside any collective while every other rank that is
  still running waits inside one (they wait for it: it is the one to blame; when several
  stall outside a collective, e.g. one blocked in a pipeline receive that notes nothing, the
  one at the earliest step, then with the oldest note, is named first), or when every
  rank waits inside a collective and none finished one for ``seconds`` (a deadlock; when the
  ranks wait in different operations, a mismatched collective).

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

from edu3d.launch import runs
from edu3d.launch.runs import describe, read_flight

CPU_BUSY = 0.08  # share of a core (used, or waited for) above which a rank is computing


def default_seconds(env: dict | None = None) -> float:
    """Half the collective timeout (``EDU3D_TIMEOUT`` in ``env``, else 60 s)."""
    env = os.environ if env is None else env
    return float(env.get("EDU3D_TIMEOUT") or 60.0) / 2


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


class Watch:
    """The launcher's view of every rank's progress; :meth:`check` it a few times a second."""

    def __init__(self, run_dir: Path, nprocs: int, seconds: float):
        self.run_dir, self.nprocs, self.seconds = Path(run_dir), nprocs, float(seconds)
        self.started: float | None = None  # when the run's first note was seen
        self.raw: dict[int, bytes] = {}
        self.rec: dict[int, dict | None] = {}
        self.noted: dict[int, float] = {}  # when each rank's record last changed
        self.busy: dict[int, float] = {}  # when each rank last used or waited for the CPU
        self.cpu: dict[int, tuple[float, float]] = {}  # (time, demand seconds) of last sample

    def _sample(self, now: float) -> None:
        pids = runs.pid_files(self.run_dir)
        for r in range(self.nprocs):
            raw, rec = read_flight(self.run_dir, r)
            if raw and raw != self.raw.get(r):
                self.raw[r], self.rec[r], self.noted[r] = raw, rec, now
                if self.started is None:
                    self.started = now
            cpu = demand_seconds(pids[r]) if r in pids else None
            if cpu is None:
                continue
            t, before = self.cpu.get(r, (now, cpu))
            if now - t >= 0.5 or r not in self.cpu:
                if cpu - before >= CPU_BUSY * (now - t) and now > t:
                    self.busy[r] = now
                self.cpu[r] = (now, cpu)

    def check(self, now: float | None = None) -> dict | None:
        """None while the run makes progress; else ``{"rank", "ranks", "message"}``."""
        now = time.monotonic() if now is None else now
        self._sample(now)
        if self.started is None:
            return None
        done = {p.name for p in (self.run_dir / "done").glob("rank*")}
        active = [r for r in range(self.nprocs) if f"rank{r}" not in done]
        waiting = {r for r in active
                   if (self.rec.get(r) or {}).get("state") == "in"
                   and (self.rec.get(r) or {}).get("lane") == "comm"}

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
                                 "outside any collective")
        if active and not culprits and len(stalled) == len(active):
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

    def _verdict(self, ranks: list[int], active: list[int], idle_s: float, why: str) -> dict:
        """The error's text: who, for how long, and what every rank still running was doing
        (from its flight record), in rank order."""
        doing = "; ".join(f"rank {o} {describe(self.rec.get(o))}" for o in active)
        message = (f"hung: no progress for {idle_s:.1f} s (heartbeat {self.seconds:g} s) {why}; "
                   f"{doing}")
        if len(ranks) > 1:
            message += f" (ranks {ranks} all stalled outside a collective; rank {ranks[0]} first)"
        return {"rank": ranks[0], "ranks": ranks, "message": message}
