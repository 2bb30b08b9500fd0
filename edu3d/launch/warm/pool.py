"""Warm ranks: a pool of rank processes kept alive in a notebook's kernel, so a cell runs in
about a second instead of five.

After reading this file you should understand where the time of a launch goes and how edu3d
saves most of it without changing what a run sees:

* **what it is.** Starting N ranks costs seconds, nearly all of it each rank importing torch.
  A pool is one ordinary edu3d launch (the same torchrun agent, loopback stores, own process
  session, ``OMP_NUM_THREADS=1``, rank prefixes, pid files, watchdogs) whose ranks
  (``python -m edu3d.launch.warm.rank FOLDER``) import torch, ``torch.distributed`` and
  :mod:`edu3d.distributed.runtime`, then wait for jobs. torch is imported once per pool, not once per
  rank: each rank torchrun starts is a stub that has the pool's fork server
  (:mod:`edu3d.launch.warm.zygote`, which imported torch) fork the real rank, and lives and dies with
  it (``EDU3D_POOL_FORK=0``: every rank imports torch itself). A job is what a launch would
  have run: a script, a module or a function call, its run folder and its environment.
  Each job gets a **fresh process group** (``init_process_group`` meets in ``job{N}/`` of the agent's store) and its
  **own run folder**: errors, results, done markers, pids, stacks, flight records and trace
  land exactly where a cold run puts them, so :class:`~edu3d.launch.api.RunResult`,
  ``run.events()``, hang reports and heartbeats work unchanged. After the job every rank
  flushes its output and ends it with a marker line, so no line leaks into the next job.
* **when it is used.** By :func:`edu3d.launch.api.launch` (so by ``%%torchrun``, every course
  helper that launches, and ``edu3d train`` called from a notebook) inside a Jupyter kernel,
  when the run needs no ``torchrun_args`` and changes no variable read only when a process
  starts (``OMP_NUM_THREADS``, ``GLOO_SOCKET_IFNAME``, ``TORCH_*``, ... see
  :data:`START_ONLY`): those runs start torchrun afresh, exactly as before. At most one pool
  per world size and :data:`MAX_POOLS` pools live at once (the least recently used is shut
  down), so idle memory stays bounded. A launch of fewer ranks runs on a larger warm pool
  if one is idle (its other ranks sit the job out: the job sees exactly the environment a
  torchrun of its own size gives), and :func:`prewarm` starts a pool in the background
  before the first launch needs it (a chapter's first cell starts the largest it will use).
  A launch while the pool is busy (another thread's job) runs cold.
* **how to turn it off.** ``launch(..., pool=False)``, ``%%torchrun --cold``,
  ``EDU3D_POOL=0`` in the environment, or :func:`disable` (which also shuts the pools down).
  ``EDU3D_POOL=1`` or ``pool=True`` turns it on outside a kernel (scripts, tests).
* **failures never poison the next run.** A failing rank, a timeout, a hang or an interrupt
  during a job raises exactly what a cold run raises (:class:`~edu3d.launch.api.RankError`
  naming the rank, :class:`~edu3d.launch.api.LaunchTimeout`, :class:`~edu3d.launch.api.RankHung`,
  ``KeyboardInterrupt``), and the whole pool is killed; the next launch starts a fresh one.
  A fork server that dies mid-job is named as such (a :class:`~edu3d.launch.api.LaunchError`
  saying how it died), not as the death of the rank whose stub noticed first.
* **it dies with the kernel.** A clean exit shuts the pools down (``atexit``); if the kernel
  is killed, the agent and every rank notice that ``EDU3D_LAUNCHER_PID`` is gone and exit.

What is **reset for every job**: the process group (new store prefix, destroyed after the
job), the environment (``os.environ`` is the job's, restored after), the working folder,
``sys.argv`` and ``sys.path``, the trace recorder (back to none), torch's global generator
and Python's ``random`` (reseeded at random, as in a fresh process; code that needs
reproducible numbers seeds them, as ``runtime.init`` does), torch's default dtype, grad
mode, deterministic-algorithms flag and thread count, DTensor's sharding caches and RNG
tracker (kept by mesh, and a new job's mesh equals the last one's), and every module the job
imported from outside the installed packages and edu3d (a notebook's own files,
``cell.py``: re-imported fresh, so edits are seen).

What **persists between jobs** (that is the point): imported installed packages (torch,
numpy, ...) and edu3d's own modules, with whatever module-level state they keep (e.g.
``functools.lru_cache`` tables of pure functions), the process itself (its pid, signal
handlers a job installed, threads a job started and did not stop, whose later output lands
in the next job; memory a job left in a global of an installed module), and the agent's
store (each job's keys live under its own prefix). So after editing edu3d's own source (or
an installed package) in a live kernel, call :func:`shutdown`: the next launch starts fresh
ranks that import the new code.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from edu3d.launch import procs, run_files, runs, supervise
from edu3d.launch.procs import RunResult, pool_pids  # (pool_pids: part of this API too)
from edu3d.launch.warm import zygote
from edu3d.launch.run_files import COMMAND_FILE, CURRENT, ENV_FILE, write_atomic
from edu3d.launch.warm.rank import SENTINEL

MAX_POOLS = 2
# variables a process reads only when it starts (or torch when it is imported): a job that
# needs another value than the pool started with runs cold
START_ONLY = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "GLOO_SOCKET_IFNAME", "PYTHONHASHSEED",
              "PYTHONUNBUFFERED", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "LD_PRELOAD",
              "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "EDU3D_PREFIX", "EDU3D_LOOPBACK")
START_ONLY_PREFIXES = ("TORCH_", "NCCL_", "GLOO_", "OMP_", "MKL_", "CUDA_")
# set per job by the launcher; never a reason to start afresh
PER_JOB = ("EDU3D_RUN_DIR", "EDU3D_RUN_ID", "EDU3D_POOL_ID", "PYTHONPATH")

_END_RE = re.compile(re.escape(SENTINEL) + r" (\d+)$")


# ================================ the launcher's side =========================================
class Pool:
    """``nprocs`` warm ranks under one torchrun agent, started with ``env``."""

    def __init__(self, nprocs: int, env: dict):
        self.nprocs = nprocs
        self.id = uuid.uuid4().hex
        self.dir = Path(tempfile.mkdtemp(prefix="edu3d-pool-"))
        self.env = {**env, "EDU3D_RUN_DIR": str(self.dir), "EDU3D_RUN_ID": self.id,
                    "EDU3D_POOL_ID": self.id}
        self.jobs = 0  # jobs submitted so far
        self.broken = False
        self.busy = False  # a job is running (another launch meanwhile runs cold)
        write_atomic(self.dir / ENV_FILE, json.dumps(self.env))
        self.zygote = None  # the fork server the ranks are forked from (edu3d.launch.warm.zygote)
        agent_env = self.env
        if zygote.enabled(self.env):
            sock = str(self.dir / run_files.ZYGOTE_SOCKET)
            with open(self.dir / run_files.ZYGOTE_LOG, "wb") as log:
                self.zygote = subprocess.Popen(
                    [sys.executable, "-u", "-m", "edu3d.launch.warm.zygote", "--serve", sock],
                    env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True)
            agent_env = {**self.env, "EDU3D_ZYGOTE": sock}
        entry = "edu3d.launch.warm.rank" if self.zygote is None else "edu3d.launch.warm.zygote"  # the stub
        cmd = procs.torchrun_command(nprocs, [str(self.dir)], entry=entry)
        write_atomic(self.dir / COMMAND_FILE, json.dumps({"argv": cmd, "nprocs": nprocs,
                                                           "run_id": self.id}))
        self.proc, self.pipes = procs.start(cmd, agent_env)

    def compatible(self, env: dict) -> bool:
        """True if a job with environment ``env`` can run here: every variable read only at
        process start has the value the pool started with."""
        keys = set(env) | set(self.env)
        return all(env.get(k) == self.env.get(k) for k in keys if _start_only(k))

    def alive(self) -> bool:
        """The agent (and the zygote) run and no rank that started has ended."""
        if self.broken or self.proc.poll() is not None:
            return False
        if self.zygote is not None and self.zygote.poll() is not None:
            return False
        return all(procs.running(p) for p in run_files.pid_files(self.dir).values())

    def pids(self) -> list[int]:
        zygote = [] if self.zygote is None else [self.zygote.pid]
        return [self.proc.pid, *zygote, *run_files.pid_files(self.dir).values()]

    def kill(self) -> None:
        """Kill the agent and every rank (each checked to carry this pool's id); forget the
        pool's folder."""
        self.broken = True
        if self.proc.returncode is None:
            procs.kill_run(self.proc, self.dir, grace_s=2.0)
        if self.zygote is not None and self.zygote.poll() is None:
            try:  # its own session: the zygote alone (each rank leads a session of its own)
                os.killpg(self.zygote.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.zygote.wait()
            self.pipes.join(timeout=2.0)  # the stubs hold the agent's pipes: they exit now
        for s in (self.proc.stdout, self.proc.stderr):
            try:
                s.close()
            except (OSError, ValueError):
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


_pools: "collections.OrderedDict[int, Pool]" = collections.OrderedDict()
_lock = threading.Lock()
_disabled = False
_default: bool | None = None  # set_default: True everywhere, False nowhere, None in kernels


def wanted(pool: bool | None) -> bool:
    """Whether a launch uses a pool: ``pool`` if given, else ``EDU3D_POOL`` (0/1), else
    :func:`disable` turns it off, else only inside a Jupyter kernel."""
    if pool is not None:
        return bool(pool)
    setting = os.environ.get("EDU3D_POOL", "").strip()
    if setting:
        return setting not in ("0", "false", "no", "off")
    if _disabled:
        return False
    if _default is not None:
        return _default
    return procs.in_kernel()


def _start_only(key: str) -> bool:
    return key not in PER_JOB and (key in START_ONLY or key.startswith(START_ONLY_PREFIXES))


def acquire(nprocs: int, env: dict, pool: bool | None = None,
            overrides: dict | None = None) -> Pool | None:
    """The warm pool of ``nprocs`` ranks for a launch with ``env`` (started if needed), or
    None when the launch must start torchrun afresh: pools are off, the pool is busy, or the
    launch's own ``overrides`` (``launch(env=...)``) set a variable read only at start."""
    if not wanted(pool):
        return None
    if any(_start_only(k) and v != os.environ.get(k) for k, v in (overrides or {}).items()):
        return None
    with _lock:
        _drop_dead()
        found = _pools.get(nprocs)
        if found is None:  # a larger warm pool runs a smaller job: its other ranks sit out
            larger = [p for n, p in _pools.items()
                      if n > nprocs and not p.busy and p.compatible(env)]
            found = min(larger, key=lambda p: p.nprocs, default=None)
        if found is not None:
            if found.busy or not found.compatible(env):
                return None
            _pools.move_to_end(found.nprocs)
            found.busy = True
            return found
        return _start(nprocs, env, busy=True)


def _drop_dead() -> None:
    """Forget (and kill what is left of) every pool whose agent or a rank has ended; called
    with ``_lock`` held."""
    for size in [n for n, p in _pools.items() if not p.alive()]:
        _pools.pop(size).kill()


def _start(nprocs: int, env: dict, busy: bool) -> Pool:
    """A new pool of ``nprocs`` ranks (the least recently used one goes if there are
    :data:`MAX_POOLS`); called with ``_lock`` held."""
    while len(_pools) >= MAX_POOLS:
        _pools.popitem(last=False)[1].kill()
    _pools[nprocs] = Pool(nprocs, env)
    _pools[nprocs].busy = busy
    return _pools[nprocs]


def prewarm(nprocs: int, env: dict | None = None, pool: bool | None = None) -> bool:
    """Start a pool of ``nprocs`` ranks now, in the background, so that the launches that
    follow (of ``nprocs`` ranks or fewer) find their ranks with torch already imported: a
    notebook calls it in its first cell, and the ranks import torch while the learner reads
    (or while the next cells import plotly). Returns at once; False if pools are off here or
    a pool that can run such jobs is already warm. ``env``: the environment the launches
    will have (default: this process's, as :func:`edu3d.launch.api.launch` builds it)."""
    if not wanted(pool):
        return False
    if env is None:
        env = procs.child_environment()
    with _lock:
        _drop_dead()
        if any(n >= nprocs and p.compatible(env) for n, p in _pools.items()):
            return False
        _start(nprocs, env, busy=False)
        return True


def pools() -> list[Pool]:
    """The live pools, least recently used first."""
    return list(_pools.values())


def shutdown(nprocs: int | None = None) -> None:
    """Kill the pool of ``nprocs`` ranks (every pool if None)."""
    with _lock:
        for n in [n for n in _pools if nprocs is None or n == nprocs]:
            _pools.pop(n).kill()


def _forget(p: Pool) -> None:
    with _lock:
        if _pools.get(p.nprocs) is p:
            del _pools[p.nprocs]
    p.kill()


def disable() -> None:
    """No more warm pools in this process (until :func:`enable`); shut down those alive."""
    global _disabled
    _disabled = True
    shutdown()


def enable() -> None:
    global _disabled
    _disabled = False


def set_default(on: bool | None) -> None:
    """Where launches without ``pool=`` use pools in this process: ``True`` everywhere (a
    test suite, a script that launches many small runs), ``False`` nowhere (the pools alive
    stay up, unused), ``None`` only inside a Jupyter kernel (the default).
    ``EDU3D_POOL`` and :func:`disable` still win."""
    global _default
    _default = on


atexit.register(shutdown)


def run_job(p: Pool, worker_argv: list[str], env: dict, run_dir: Path, timeout: float | None,
            echo, on_poll: Callable[[float, int], None] | None, heartbeat: float = 0.0,
            nprocs: int | None = None) -> RunResult:
    """Run one job of ``nprocs`` ranks (default: all of them) on pool ``p`` (from
    :func:`acquire`) and wait for it with the loop that waits for a cold run
    (:func:`edu3d.launch.supervise.watch`): same output, same result, same errors. Ranks
    ``nprocs`` and up sit the job out. Any failure kills the pool."""
    try:
        nprocs = nprocs or p.nprocs
        if not 0 < nprocs <= p.nprocs:
            raise ValueError(f"a job of {nprocs} ranks cannot run on a pool of {p.nprocs}")
        job = Job(p, nprocs)
        write_atomic(run_dir / COMMAND_FILE, json.dumps({
            "argv": worker_argv, "nprocs": nprocs, "run_id": p.id, "pool": p.id, "job": job.n,
            "pool_ranks": p.nprocs}))
        env = {**env, "EDU3D_RUN_ID": p.id, "EDU3D_POOL_ID": p.id, "EDU3D_RUN_DIR": str(run_dir)}
        write_atomic(p.dir / CURRENT, str(run_dir))  # the agent writes the job's exits there
        write_atomic(run_files.job_file(p.dir, job.n), json.dumps({
            "n": job.n, "argv": worker_argv, "run_dir": str(run_dir), "env": env,
            "cwd": os.getcwd(), "nprocs": nprocs}))
        result = supervise.watch(p.proc, p.pipes, run_dir, nprocs, lambda: _forget(p),
                                 timeout=timeout, echo=echo, on_poll=on_poll,
                                 heartbeat=heartbeat, job=job, block_s=0.03)
        if p.broken:
            _forget(p)
        return result
    finally:
        p.busy = False


class Job:
    """One job on pool ``p``'s agent, as :func:`edu3d.launch.supervise.watch` sees it: the
    agent outlives the job, so the job's end is told by a marker line that each of its ranks
    writes on stdout and stderr after everything else (:data:`edu3d.launch.warm.rank.SENTINEL`
    and the job's number)."""

    def __init__(self, p: Pool, nprocs: int):
        self.pool, self.nprocs = p, nprocs
        self.n = p.jobs
        p.jobs += 1
        # anything the pool said between jobs (torchrun's start-up chatter), read before the
        # job is handed to the ranks so none of the job's own lines is taken for it
        self.before, self.closed = supervise.chatter(p.pipes)
        self.ended: set = set()  # (rank, stream) of the job's ranks whose marker arrived
        self.all_done_at: float | None = None

    def keep(self, rank: int, stream: str, text: str) -> str | None:
        """A rank's line without its marker; None for a line to drop (a bare marker, an empty
        line after it)."""
        end = _END_RE.search(text)
        if end is not None:  # this job's end, or the late end of one that a
            text = text[:end.start()]  # rank still starting up sat out
            if int(end.group(1)) == self.n and rank < self.nprocs:
                self.ended.add((rank, stream))
        if text or not (end is not None or (rank, stream) in self.ended):
            return text
        return None

    def finished(self, done: int) -> bool:
        """Every rank is done and every marker arrived (or one went missing for 3 s: the job
        is done, but its output may not be, so the pool is marked broken: start afresh)."""
        if done != self.nprocs:
            return False
        if len(self.ended) == 2 * self.nprocs:
            return True
        self.all_done_at = self.all_done_at or time.monotonic()
        if time.monotonic() - self.all_done_at > 3.0:
            self.pool.broken = True
            return True
        return False

    def leave(self) -> None:
        """The agent stops writing the ranks' exits into this job's run folder."""
        try:
            write_atomic(self.pool.dir / CURRENT, "")
        except OSError:
            pass

    def server_death(self, output: list) -> str | None:
        """The error of a job whose fork server died, or None if it lives. A stub says so
        (:data:`~edu3d.launch.warm.zygote.ENDED`) a moment before the zygote can be reaped:
        then it is given a second."""
        z = self.pool.zygote
        said = z is not None and any(zygote.ENDED in text for _, _, text in output)
        try:
            return None if z is None else zygote.death(z.wait(timeout=1.0 if said else 0.0),
                                                       self.pool.dir, self.n)
        except subprocess.TimeoutExpired:
            return None


__all__ = ["Pool", "Job", "acquire", "disable", "enable", "pool_pids", "pools", "prewarm",
           "run_job", "shutdown", "wanted", "MAX_POOLS", "START_ONLY"]
