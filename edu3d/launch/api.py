"""Launching ranks: torchrun as a subprocess, watched from Python.

After reading this file you should understand how one call turns into N cooperating processes
and how edu3d keeps that safe:

* ``launch(target, n)`` runs torchrun's agent (``python -m edu3d.launch.api``, which is
  ``torch.distributed.run`` with its stores bound to loopback) in a new process session with
  rendezvous on ``127.0.0.1`` and a free port (never a fixed 29500), ``OMP_NUM_THREADS=1``,
  and :mod:`edu3d.launch.worker` wrapped around your code on every rank;
* ``target`` is a script path, a module (``module=True``), or a function of an importable
  module (called on every rank as ``function(mesh, *args, **kwargs)``; a function defined in a
  notebook cell cannot travel to another process, use ``%%torchrun`` for that);
* output is streamed live with a rank prefix; return values, errors and traces are collected
  from the run folder;
* the first failing rank ends the run: every process is killed and one :class:`RankError`
  names that rank and carries its traceback, or says how it died (exit code, signal) when it
  left no Python error; a partner's "Connection closed by peer" is a consequence, never the
  cause. A timeout or an interrupt also kills every process; nothing is left running, and a
  hang is reported with what every rank was doing (its flight record);
* a rank that stops making progress while the others wait for it is named within the
  ``heartbeat`` (default: half the collective timeout, :mod:`edu3d.launch.heartbeat`), with its
  Python stack, and handled like a death: :class:`RankHung`.

The launcher itself never imports torch, so ``edu3d run`` adds almost nothing to torchrun.
In a notebook's kernel the ranks are kept warm between launches (:mod:`edu3d.launch.warm.pool`): the same
run folder, output, results and errors, without importing torch again; ``pool=False`` (or
``EDU3D_POOL=0``) starts fresh processes every time.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

from edu3d.launch import heartbeat as hb
from edu3d.launch import procs, runs
# the errors and the result a run ends with, and the process helpers, live in edu3d.launch.procs
# (shared with the warm pool); they are part of this module's API too
from edu3d.launch.procs import (LaunchError, LaunchTimeout, RankError, RankHung, RunResult,
                                child_environment, kill_run, torchrun_command)
from edu3d.launch.runs import RunsError, new_run_dir
from edu3d.launch.worker import _write

__all__ = ["launch", "LaunchError", "LaunchTimeout", "RankError", "RankHung", "RunResult",
           "RunsError", "child_environment", "kill_run", "new_run_dir", "torchrun_command"]


# ---- the agent: torchrun, bound to loopback, recording how each rank ended --------------------
def _bind_stores_to_loopback() -> None:
    """Make every TCPStore *server* this process hosts listen on 127.0.0.1 only.

    torchrun's agent hosts two stores: the c10d rendezvous store and the store the ranks
    meet in (``MASTER_ADDR:MASTER_PORT``). Whatever host name they are given, the C++ server
    binds the wildcard address (``0.0.0.0``/``[::]``) and answers anyone who can reach the
    machine, without authentication. ``TCPStore`` accepts an already bound socket
    (``master_listen_fd``): we bind it to loopback ourselves and hand it over.
    """
    import torch.distributed as dist

    class LoopbackTCPStore(dist.TCPStore):
        def __init__(self, host_name, port, world_size=None, is_master=False,
                     timeout=timedelta(seconds=300), wait_for_workers=True,
                     multi_tenant=False, master_listen_fd=None, use_libuv=True):
            if is_master and master_listen_fd is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(4096)
                port, master_listen_fd = sock.getsockname()[1], sock.detach()
            super().__init__(host_name, port, world_size, is_master, timeout,
                             wait_for_workers, multi_tenant, master_listen_fd, use_libuv)

    dist.TCPStore = LoopbackTCPStore  # read at call time by torchrun's rendezvous modules
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    c10d_rendezvous_backend.TCPStore = LoopbackTCPStore


_POPENS: dict[int, "subprocess.Popen"] = {}  # in the agent: pid -> torchrun's Popen of a rank
_BY_RANK: dict[int, "subprocess.Popen"] = {}  # rank -> the newest such Popen


def _keep_rank_popens() -> None:
    """Remember torchrun's ``Popen`` of every rank it starts (see :func:`_exit_of`)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as sh)

    popen = sh.SubprocessHandler._popen

    def keeping(self, args, env):
        proc = popen(self, args, env)
        _POPENS[proc.pid] = proc
        if str(env.get("RANK", "")).isdigit():
            _BY_RANK[int(env["RANK"])] = proc
        return proc

    sh.SubprocessHandler._popen = keeping


def _exit_of(pid: int, wait_s: float = 5.0) -> dict | None:
    """How child ``pid`` ended, ``{"code": C}`` or ``{"signal": S}``, once it has (None if it
    is not this process's child).

    ``waitid(..., WNOWAIT)`` sees the death without reaping the child, so torchrun still
    collects it as usual. But torchrun's monitor polls its children (``Popen.poll``, which
    reaps), and on a loaded machine it can reap a dead rank before this thread, woken by the
    death, gets to look: the kernel then answers ``ECHILD``. That rank's status is then in
    torchrun's ``Popen`` (negative return code: the signal). Without this, a rank that died
    first could go unrecorded and a partner's lost connection be named instead (seen once
    with 8 ranks while another test worker loaded the machine)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        proc = _POPENS.get(pid)
        deadline = time.monotonic() + wait_s
        while proc is not None and proc.returncode is None and time.monotonic() < deadline:
            time.sleep(0.01)  # torchrun's poll() reaped it and is about to set returncode
        if proc is None or proc.returncode is None:
            return None
        code = proc.returncode
        return {"code": code} if code >= 0 else {"signal": -code}
    return {"code": info.si_status} if info.si_code == os.CLD_EXITED else {"signal": info.si_status}


def _record_exits(run_dir: Path, also: Callable[[], Path | None] = lambda: None
                  ) -> Callable[[float], None]:
    """Write ``exits/rank{R}.json`` the moment a rank's process ends: exit code or signal and
    the time (:func:`_exit_of`), from a thread per rank. The agent is the ranks' parent, the
    only process the kernel tells how a rank ended. ``also()``: a second run folder to write
    it to (a warm pool's current job, :mod:`edu3d.launch.warm.pool`). Returns ``finish(timeout_s)``,
    which the agent calls before it exits: its threads are daemons, and a death not yet
    written when the agent ends would be lost."""
    seen: set = set()
    threads: list = []

    def wait_for(rank: int, pid: int) -> None:
        stub = _BY_RANK.get(rank)
        if pid not in _POPENS and stub is not None:  # a pool rank forked by the zygote: its
            pid_of_child = stub.pid  # stub, torchrun's child, ends as it did (edu3d.launch.warm.zygote)
        else:
            pid_of_child = pid
        how = _exit_of(pid_of_child)
        if how is None:
            return
        text = json.dumps({"rank": rank, "pid": pid, "time_ns": time.time_ns(), **how})
        for folder in dict.fromkeys(d for d in (run_dir, also()) if d is not None):
            _write(folder / "exits" / f"rank{rank}.json", text)

    def scan() -> None:
        last_new = time.monotonic()
        while True:
            for rank, pid in runs.pid_files(run_dir).items():
                if (rank, pid) not in seen:
                    seen.add((rank, pid))
                    last_new = time.monotonic()
                    t = threading.Thread(target=wait_for, args=(rank, pid), daemon=True)
                    t.start()
                    threads.append(t)
            # ranks write their pid files as they start; once none has come for a while
            # (a long run, an idle warm pool) look rarely: each death is seen by its waitid
            time.sleep(0.02 if time.monotonic() - last_new < 5.0 else 0.5)

    def finish(timeout_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        for t in list(threads):
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    threading.Thread(target=scan, name="edu3d-exits", daemon=True).start()
    return finish


def _pool_job_dir(pool_dir: Path) -> Path | None:
    """The run folder of the job a warm pool is running now (None between jobs)."""
    try:
        text = (pool_dir / "current").read_text().strip()
    except OSError:
        return None
    return Path(text) if text else None


def _remove_pool_folder(pool_dir: Path, finish_exits: Callable[[float], None]) -> None:
    """Remove a warm pool's folder once its launcher is gone. The ranks are stopped first and
    their deaths written (each death makes this agent write records into the folder), then
    the folder is removed until it stays gone: torchrun's own teardown, reacting to the same
    deaths, may still write one last record."""
    import shutil

    runs.signal_ranks(pool_dir)
    finish_exits(2.0)
    deadline, gone_since = time.monotonic() + 3.0, None
    while time.monotonic() < deadline:
        if pool_dir.exists():
            shutil.rmtree(pool_dir, ignore_errors=True)
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since > 0.3:
            return
        time.sleep(0.05)


def _agent_main(argv: Sequence[str]) -> None:
    """torchrun's agent plus: stores on loopback (single node) and a record of how each
    rank ended, with the time the agent began stopping the others (``exits/teardown``).
    An agent serving a warm pool (``EDU3D_POOL_ID``) also writes both to the current job's
    run folder, and leaves when the launcher (the notebook's kernel) disappears."""
    if os.environ.get("EDU3D_LOOPBACK") == "1":
        _bind_stores_to_loopback()
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing import api

    run_dir = Path(os.environ["EDU3D_RUN_DIR"])
    pooled = bool(os.environ.get("EDU3D_POOL_ID"))
    job = (lambda: _pool_job_dir(run_dir)) if pooled else (lambda: None)
    _keep_rank_popens()
    finish_exits = _record_exits(run_dir, job)
    close = api.PContext.close

    def close_noting_teardown(self, *args, **kwargs):
        stamp = json.dumps({"time_ns": time.time_ns()})
        for folder in dict.fromkeys(d for d in (run_dir, job()) if d is not None):
            if not (folder / "exits" / "teardown").exists():
                _write(folder / "exits" / "teardown", stamp)
        return close(self, *args, **kwargs)

    api.PContext.close = close_noting_teardown
    launcher = int(os.environ.get("EDU3D_LAUNCHER_PID", "0"))

    def orphaned() -> bool:  # a SIGKILLed kernel stays a zombie until its parent reaps it
        return pooled and bool(launcher) and not procs.running(launcher)

    def leave() -> None:  # nobody else will remove an orphaned pool's folder
        if run_dir.name.startswith("edu3d-pool-"):
            _remove_pool_folder(run_dir, finish_exits)

    if pooled:
        def watch() -> None:  # the ranks' own watchdogs end them once the agent is gone
            while True:
                time.sleep(0.2)
                if orphaned():
                    leave()
                    os._exit(3)

        threading.Thread(target=watch, name="edu3d-agent-watchdog", daemon=True).start()
    try:
        run.main(list(argv))
    finally:  # every rank has ended: let the last deaths be written before the agent goes
        finish_exits(2.0)
        if orphaned():  # torchrun saw its ranks die before the watchdog saw the launcher go
            leave()


def _worker_args(target, module: bool, args, kwargs, layout, init: bool, run_dir: Path):
    """Turn a target into edu3d.launch.worker arguments (and the pickled call arguments, if any);
    bad input fails here, before any process or folder is made."""
    if callable(target):
        mod, name = target.__module__, target.__qualname__
        spec = getattr(sys.modules.get(mod), "__spec__", None)
        if mod == "__main__" and spec is not None:  # run with `python -m package.module`
            mod = spec.name
        if mod == "__main__" or "<locals>" in name:
            raise LaunchError(
                f"{name} is defined in a notebook cell or a script's __main__, and another "
                "process cannot import it (spawn cannot pickle such functions). Move it into "
                "an importable module, or put the code in a %%torchrun cell.")
        target = f"{mod}:{name}"
    if not isinstance(target, (str, os.PathLike)):
        raise LaunchError(f"target must be a script path, a module name or a function, "
                          f"not {type(target).__name__}")
    target = os.fspath(target)
    if module:
        return ["--module", target, "--", *map(str, args)], None
    if ":" in target and not os.path.exists(target):
        out = ["--call", target]
        if layout is not None:
            out += ["--layout", json.dumps(layout.__dict__)]
        payload = pickle.dumps((tuple(args), dict(kwargs or {}))) if args or kwargs else None
        if payload:
            out += ["--args-file", str(run_dir / "call-args.pkl")]
        return out + ([] if init else ["--no-init"]), payload
    if not os.path.isfile(target):
        raise LaunchError(f"script {target!r} does not exist (for a module use module=True / "
                          f"'edu3d run -m', for a function 'package.module:function')")
    return ["--script", os.path.abspath(target), "--", *map(str, args)], None


def _import_root(target) -> list[str]:
    """The sys.path entry that makes a function's module importable (``tests.test_x`` needs
    the folder above ``tests``)."""
    mod = sys.modules.get(getattr(target, "__module__", "") or "")
    file = getattr(mod, "__file__", None)
    if not callable(target) or not file:
        return []
    root = Path(file).resolve().parent
    for _ in range(target.__module__.count(".")):
        root = root.parent
    return [str(root)]


def launch(target, nprocs: int = 2, *, args: Sequence = (), kwargs: dict | None = None,
           module: bool = False, layout=None, init: bool = True, timeout: float | None = None,
           run_dir: str | os.PathLike | None = None, env: dict | None = None,
           echo: bool | Callable[[int | None, str, str], None] = True,
           on_poll: Callable[[float, int], None] | None = None, progress: bool | None = None,
           torchrun_args: Sequence[str] = (), name: str | None = None,
           heartbeat: float | None = None, pool: bool | None = None) -> RunResult:
    """Run ``target`` on ``nprocs`` ranks and wait for it.

    ``echo``: ``True`` prints each line with its rank prefix, ``False`` prints nothing, a
    callable receives ``(rank, stream, line)`` (rank ``None`` for torchrun's own lines).
    ``on_poll(elapsed_s, ranks_done)`` is called a few times a second (progress displays).
    ``progress`` shows a live status line under the cell (default: in a Jupyter kernel,
    unless ``EDU3D_PROGRESS=0``). ``timeout`` (seconds) bounds the whole run. ``heartbeat``
    (seconds, default half the collective timeout ``EDU3D_TIMEOUT``; 0 turns it off): a rank
    without progress that long while the others wait for it ends the run with
    :class:`RankHung`. Raises :class:`RankError`, :class:`LaunchTimeout` or
    :class:`LaunchError`; ``KeyboardInterrupt`` kills the run.

    ``pool``: run on a warm pool of ranks that already imported torch (:mod:`edu3d.launch.warm.pool`;
    default: inside a Jupyter kernel, unless ``EDU3D_POOL=0``); ``False`` always starts
    torchrun afresh. Runs with ``torchrun_args`` never use the pool.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise LaunchError(f"nprocs must be a positive integer, not {nprocs!r}")
    if layout is not None:
        nnodes = next((int(a.split("=", 1)[1]) for a in torchrun_args
                       if a.startswith("--nnodes=") and a.split("=", 1)[1].isdigit()), 1)
        layout.validate(world_size=nprocs * nnodes)
    if timeout is not None and timeout <= 0:
        raise LaunchError(f"timeout must be positive seconds, not {timeout!r}")
    collective_s = float({**os.environ, **(env or {})}.get("EDU3D_TIMEOUT") or 60.0)
    if heartbeat is None:
        heartbeat = hb.default_seconds({"EDU3D_TIMEOUT": collective_s})
    if not isinstance(heartbeat, (int, float)) or heartbeat < 0:
        raise LaunchError(f"heartbeat must be seconds >= 0 (0: off), not {heartbeat!r}")
    if heartbeat >= collective_s:
        raise LaunchError(
            f"heartbeat {heartbeat:g} s must be shorter than the collective timeout "
            f"{collective_s:g} s (EDU3D_TIMEOUT): otherwise a rank waiting for the hung one "
            "times out first and is blamed instead")
    label = name or (getattr(target, "__name__", None) or Path(os.fspath(target)).stem)
    run_dir = Path(run_dir).resolve() if run_dir else new_run_dir(label, create=False)
    worker_argv, payload = _worker_args(target, module, args, kwargs, layout, init, run_dir)
    cmd = torchrun_command(nprocs, worker_argv, torchrun_args)
    try:
        runs.prepare(run_dir)  # also clears what an earlier run left in a reused folder
    except RunsError as err:
        raise LaunchError(str(err)) from None
    if echo is True and not procs.in_kernel():
        print(f"edu3d: run folder {run_dir}", file=sys.stderr, flush=True)
    if payload:
        (run_dir / "call-args.pkl").write_bytes(payload)

    child_env = child_environment(env, torchrun_args, _import_root(target))
    rid = uuid.uuid4().hex  # in every process's environment: how kill_run knows its own
    child_env.update(EDU3D_RUN_DIR=str(run_dir), EDU3D_RUN_ID=rid)
    warm = None
    if not torchrun_args:
        from edu3d.launch.warm import pool as pools

        warm = pools.acquire(nprocs, child_env, pool, env)
    if warm is None:
        (run_dir / "command.json").write_text(json.dumps({"argv": cmd, "nprocs": nprocs,
                                                            "run_id": rid}))

    if progress is None:
        progress = procs.in_kernel() and os.environ.get("EDU3D_PROGRESS", "1") != "0"
    status = None
    try:
        if progress:
            status = _notebook_status(nprocs, warm is not None and warm.jobs == 0)
    except BaseException:
        if warm is not None:
            warm.busy = False  # acquired, never used: free for the next launch
        raise
    def with_status(elapsed: float, done: int) -> None:
        status.running(elapsed, done)
        if on_poll is not None:
            on_poll(elapsed, done)

    poll = with_status if status is not None else on_poll
    try:
        if warm is not None:
            result = pools.run_job(warm, worker_argv, child_env, run_dir, timeout, echo, poll,
                                   heartbeat, nprocs)
        else:
            result = _launch(cmd, child_env, run_dir, nprocs, timeout, echo, poll, heartbeat)
    except KeyboardInterrupt:
        if status is not None:
            status.failed(f"interrupted: all {nprocs} ranks were killed")
        raise
    except LaunchError as err:
        if status is not None:
            status.failed(f"failed: {str(err).splitlines()[0]}")
        raise
    if status is not None:
        status.finished(result.elapsed_s, run_dir)
    return result


def _notebook_status(nprocs: int, new_pool: bool = False):
    from edu3d.launch.status import NotebookStatus

    return NotebookStatus(nprocs, new_pool)


def _launch(cmd, child_env, run_dir: Path, nprocs: int, timeout, echo, on_poll,
            heartbeat: float = 0.0) -> RunResult:
    """Start torchrun, stream its output, watch for errors, hangs and the timeout, collect
    results."""
    emit = procs.print_line if echo is True else (echo or (lambda *a: None))
    output: list = []
    start = time.monotonic()
    proc, pipes = procs.start(cmd, child_env)

    def drain(block_s: float) -> int:
        closed = 0
        try:
            item = pipes.lines.get(timeout=block_s)
            while True:
                tag, text = item
                if text is None:
                    closed += 1
                else:
                    m = procs.PREFIX_RE.match(text)
                    rank, body = (int(m.group(1)), m.group(2)) if m else (None, text)
                    output.append((rank, tag, body))
                    if rank is not None:  # torchrun's own chatter stays in result.output
                        emit(rank, tag, body)
                item = pipes.lines.get_nowait()
        except queue.Empty:
            pass
        return closed

    closed, failure, last_poll, last_beat = 0, None, 0.0, 0.0
    watch = hb.Watch(run_dir, nprocs, heartbeat) if heartbeat else None
    try:
        while closed < 2 or proc.poll() is None:
            closed += drain(0.05)
            now = time.monotonic() - start
            failure = procs.first_failure(run_dir)
            if failure is not None:
                break
            if watch is not None and now - last_beat >= 0.25:
                last_beat = now
                hung = watch.check()
                if hung is not None:
                    raise procs.hung_error(run_dir, hung, lambda: kill_run(proc, run_dir))
            if timeout is not None and now > timeout:
                raise procs.timeout_error(run_dir, nprocs, timeout, lambda: kill_run(proc, run_dir))
            if on_poll is not None and now - last_poll > 0.25:
                last_poll = now
                done_dir = run_dir / "done"
                on_poll(now, len(list(done_dir.glob("rank*"))) if done_dir.exists() else 0)
    except KeyboardInterrupt:
        kill_run(proc, run_dir)
        raise
    finally:
        if proc.poll() is None:
            kill_run(proc, run_dir)
    closed += drain(0.0)

    if failure is not None or proc.returncode != 0:
        pipes.join()
        drain(0.0)
        raise procs.rank_error(run_dir, nprocs, failure, output)
    return RunResult(run_dir, nprocs, time.monotonic() - start, procs.read_results(run_dir, nprocs),
                     output)


if __name__ == "__main__":
    _agent_main(sys.argv[1:])
