"""Launching ranks: torchrun as a subprocess, watched from Python.

After reading this file you should understand how one call turns into N cooperating processes
and how edu3d keeps that safe:

* ``launch(target, n)`` runs torchrun's agent (``python -m edu3d.launch``, which is
  ``torch.distributed.run`` with its stores bound to loopback) in a new process session with
  rendezvous on ``127.0.0.1`` and a free port (never a fixed 29500), ``OMP_NUM_THREADS=1``,
  and :mod:`edu3d.worker` wrapped around your code on every rank;
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
  ``heartbeat`` (default: half the collective timeout, :mod:`edu3d.heartbeat`), with its
  Python stack, and handled like a death: :class:`RankHung`.

The launcher itself never imports torch, so ``edu3d run`` adds almost nothing to torchrun.
In a notebook's kernel the ranks are kept warm between launches (:mod:`edu3d.pool`): the same
run folder, output, results and errors, without importing torch again; ``pool=False`` (or
``EDU3D_POOL=0``) starts fresh processes every time.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

from edu3d import heartbeat as hb
from edu3d import runs
from edu3d.runs import RunsError, new_run_dir  # noqa: F401 - new_run_dir is part of the API
from edu3d.runtime import loopback_ifname
from edu3d.worker import PREFIX_FMT, _alive, _write

_PREFIX_RE = re.compile(r"^\[rank (\d+)\] ?(.*)$")
# torchrun options that mean "the user is setting up rendezvous themselves" (multi-node)
_MULTINODE = ("--nnodes", "--node-rank", "--node_rank", "--rdzv", "--master-addr",
              "--master_addr", "--master-port", "--master_port", "--local-addr", "--local_addr")


class LaunchError(RuntimeError):
    """A run that could not start or did not finish cleanly."""

    def _render_traceback_(self) -> list[str]:
        """In a notebook, the message (with the failing rank's own traceback) and not the
        launcher's frames."""
        return [f"{type(self).__name__}: {self}"]


class RankError(LaunchError):
    """The first rank that failed, with its traceback."""

    def __init__(self, rank: int, message: str, traceback: str = "", run_dir: Path | None = None):
        self.rank, self.traceback, self.run_dir = rank, traceback, run_dir
        text = f"rank {rank} failed: {message}"
        if traceback:
            text += f"\n---- traceback of rank {rank} ----\n{traceback.rstrip()}"
        super().__init__(text)


class RankHung(RankError):
    """A rank that made no progress for the heartbeat while the others waited for it (or
    every rank waiting in a collective: a deadlock); ``ranks`` lists every stalled one."""

    def __init__(self, rank: int, message: str, traceback: str = "", run_dir: Path | None = None,
                 ranks: Sequence[int] = ()):
        super().__init__(rank, message, traceback, run_dir)
        self.ranks = list(ranks) or [rank]


class LaunchTimeout(LaunchError, TimeoutError):
    """The run outlived its timeout and was killed."""


@dataclass
class RunResult:
    """What a finished run left behind."""

    run_dir: Path
    nprocs: int
    elapsed_s: float
    results: list = field(default_factory=list)  # per-rank return values (function targets)
    output: list = field(default_factory=list)  # (rank or None, "stdout"|"stderr", line)

    def events(self) -> list[dict]:
        """The merged trace of every rank (see :mod:`edu3d.trace`)."""
        from edu3d import trace

        return trace.load(self.run_dir)

    def chrome_trace(self, path: str | os.PathLike | None = None) -> Path:
        """Write the run's trace as Chrome trace JSON (open it in https://ui.perfetto.dev)."""
        from edu3d import trace

        path = Path(path or self.run_dir / "trace.json")
        trace.to_chrome(self.events(), path)
        return path

    def lines(self, rank: int = 0, stream: str = "stdout") -> list[str]:
        return [text for r, s, text in self.output if r == rank and s == stream]


def _single_node(torchrun_args: Sequence[str]) -> bool:
    return not any(a.startswith(_MULTINODE) for a in torchrun_args)


def torchrun_command(nprocs: int, worker_args: Sequence[str],
                     torchrun_args: Sequence[str] = ()) -> list[str]:
    """The torchrun command line edu3d runs (single node on 127.0.0.1 unless told otherwise).

    ``python -m edu3d.launch`` is torchrun's own agent (``torch.distributed.run.main``) with
    the two additions of :func:`_agent_main`; it takes exactly torchrun's options."""
    cmd = [sys.executable, "-m", "edu3d.launch", f"--nproc-per-node={nprocs}",
           "--max-restarts=0", "--monitor-interval=0.1"]
    if _single_node(torchrun_args):
        cmd += ["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                f"--rdzv-id={uuid.uuid4().hex}", "--local-addr=127.0.0.1"]
    return cmd + list(torchrun_args) + ["-m", "edu3d.worker", *worker_args]


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


def _record_exits(run_dir: Path, also: Callable[[], Path | None] = lambda: None) -> None:
    """Write ``exits/rank{R}.json`` the moment a rank's process ends: exit code or signal and
    the time. A thread per rank blocks in ``waitid(..., WNOWAIT)``, which sees the death
    without reaping the child, so torchrun still collects it as usual. The agent is the
    ranks' parent, the only process the kernel tells how a rank ended. ``also()``: a second
    run folder to write it to (a warm pool's current job, :mod:`edu3d.pool`)."""
    seen: set = set()

    def wait_for(rank: int, pid: int) -> None:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            return
        died = time.time_ns()
        how = ({"code": info.si_status} if info.si_code == os.CLD_EXITED
               else {"signal": info.si_status})
        text = json.dumps({"rank": rank, "pid": pid, "time_ns": died, **how})
        for folder in dict.fromkeys(d for d in (run_dir, also()) if d is not None):
            _write(folder / "exits" / f"rank{rank}.json", text)

    def scan() -> None:
        last_new = time.monotonic()
        while True:
            for rank, pid in runs.pid_files(run_dir).items():
                if (rank, pid) not in seen:
                    seen.add((rank, pid))
                    last_new = time.monotonic()
                    threading.Thread(target=wait_for, args=(rank, pid), daemon=True).start()
            # ranks write their pid files as they start; once none has come for a while
            # (a long run, an idle warm pool) look rarely: each death is seen by its waitid
            time.sleep(0.02 if time.monotonic() - last_new < 5.0 else 0.5)

    threading.Thread(target=scan, name="edu3d-exits", daemon=True).start()


def _pool_job_dir(pool_dir: Path) -> Path | None:
    """The run folder of the job a warm pool is running now (None between jobs)."""
    try:
        text = (pool_dir / "current").read_text().strip()
    except OSError:
        return None
    return Path(text) if text else None


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
    _record_exits(run_dir, job)
    close = api.PContext.close

    def close_noting_teardown(self, *args, **kwargs):
        stamp = json.dumps({"time_ns": time.time_ns()})
        for folder in dict.fromkeys(d for d in (run_dir, job()) if d is not None):
            if not (folder / "exits" / "teardown").exists():
                _write(folder / "exits" / "teardown", stamp)
        return close(self, *args, **kwargs)

    api.PContext.close = close_noting_teardown
    if pooled:
        launcher = int(os.environ.get("EDU3D_LAUNCHER_PID", "0"))

        def watch() -> None:  # the ranks' own watchdogs end them once the agent is gone
            while True:  # a SIGKILLed kernel stays a zombie until its parent reaps it
                time.sleep(0.2)
                if launcher and not _running(launcher):
                    if run_dir.name.startswith("edu3d-pool-"):  # nobody else will remove it
                        import shutil

                        shutil.rmtree(run_dir, ignore_errors=True)
                    os._exit(3)

        threading.Thread(target=watch, name="edu3d-agent-watchdog", daemon=True).start()
    run.main(list(argv))


def _worker_args(target, module: bool, args, kwargs, layout, init: bool, run_dir: Path):
    """Turn a target into edu3d.worker arguments (and the pickled call arguments, if any);
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


def _print_line(rank: int | None, stream: str, text: str) -> None:
    out = sys.stdout if stream == "stdout" else sys.stderr
    out.write((PREFIX_FMT.format(rank) if rank is not None else "") + text + "\n")
    out.flush()


def _running(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    if not _alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def kill_run(proc: subprocess.Popen, run_dir: Path, grace_s: float = 3.0) -> None:
    """Kill every process of a run: the workers (each in its own session, each checked to be
    the run's before it is signalled: pids recycle), then torchrun: at once when every rank
    had started (its orderly shutdown takes seconds and has nothing left to stop), else
    politely, so that it stops the ranks that had not yet written their pid file."""
    try:
        nprocs = json.loads((run_dir / "command.json").read_text())["nprocs"]
    except (OSError, ValueError, KeyError):
        nprocs = None
    all_started = nprocs is not None and len(runs.pid_files(run_dir)) >= nprocs
    runs.signal_ranks(run_dir)
    if proc.poll() is None and not all_started:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # torchrun stops the workers it started
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    rid = runs.run_id(run_dir)

    def ours_running():
        return [p for p in runs.pid_files(run_dir).values()
                if _running(p) and runs.belongs_to(p, rid)]

    deadline = time.monotonic() + grace_s
    while ours_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    if ours_running():  # late starters killed after they wrote their pid
        runs.signal_ranks(run_dir)


def _first_failure(run_dir: Path, settle_s: float = 5.0) -> dict | None:
    """The failure that caused the others, or None while every rank is fine.

    A rank that dies without a Python error (``os._exit``, a segfault, ``kill -9``) makes its
    partners fail with "Connection closed by peer" a moment later; those are consequences.
    When only consequences are known, wait up to ``settle_s`` for the death that caused them
    (the agent records it, see :func:`_record_exits`) before settling for the earliest. (2 s
    was not enough on a 2-core machine at load 20: the agent's thread wrote the death of the
    rank that called ``os._exit`` after its partner's lost connection had waited 2 s.)"""
    causes, consequences = runs.failures(run_dir)
    if not causes and not consequences:
        return None
    first_seen, deadline = time.monotonic(), time.monotonic() + settle_s
    while time.monotonic() < deadline:
        if causes and time.monotonic() - first_seen >= min(0.3, settle_s):
            break  # an earlier death recorded a little late still gets its chance
        time.sleep(0.05)
        causes, consequences = runs.failures(run_dir)
    return (causes or consequences)[0]


def _root_cause(output: list) -> tuple[int, str]:
    """Rank and exit reason from torchrun's failure report, for a rank that left no error file
    (killed by a signal, os._exit, a crash in C++)."""
    text = "\n".join(line for r, _, line in output if r is None)
    text = text[text.find("Root Cause"):] if "Root Cause" in text else text
    m = re.search(r"rank\s*:\s*(\d+).*?\n.*?exitcode\s*:\s*(-?\d+)", text, re.S)
    if not m:
        return -1, "torchrun exited with an error and no rank reported one"
    rank, code = int(m.group(1)), int(m.group(2))
    reason = (f"killed by signal {signal.Signals(-code).name}" if code < 0 else
              f"exited with code {code}")
    return rank, reason


def _stack_of(run_dir: Path, rank: int, wait_s: float = 1.5) -> str:
    """Ask a (hung) rank for its Python stack (``SIGUSR1``, see :mod:`edu3d.worker`) and
    return its main thread's, most recent call first ("" if it cannot answer)."""
    pid, path = runs.pid_files(run_dir).get(rank), run_dir / "stacks" / f"rank{rank}.txt"
    if pid is None or not runs.belongs_to(pid, runs.run_id(run_dir)):
        return ""
    try:
        os.kill(pid, signal.SIGUSR1)
    except (ProcessLookupError, PermissionError):
        return ""
    deadline, size = time.monotonic() + wait_s, -1
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = path.stat().st_size if path.exists() else 0
        if now and now == size:
            break
        size = now
    text = path.read_text(errors="replace") if path.exists() else ""
    blocks = [b for b in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip()) if b]
    main = [b for b in blocks if "in _bootstrap" not in b]  # not a daemon thread
    return (main or blocks or [""])[0]


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

    ``pool``: run on a warm pool of ranks that already imported torch (:mod:`edu3d.pool`;
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
    if echo is True and not _in_kernel():
        print(f"edu3d: run folder {run_dir}", file=sys.stderr, flush=True)
    if payload:
        (run_dir / "call-args.pkl").write_bytes(payload)

    child_env = child_environment(env, torchrun_args, _import_root(target))
    rid = uuid.uuid4().hex  # in every process's environment: how kill_run knows its own
    child_env.update(EDU3D_RUN_DIR=str(run_dir), EDU3D_RUN_ID=rid)
    warm = None
    if not torchrun_args:
        from edu3d import pool as pools

        warm = pools.acquire(nprocs, child_env, pool, env)
    if warm is None:
        (run_dir / "command.json").write_text(json.dumps({"argv": cmd, "nprocs": nprocs,
                                                            "run_id": rid}))

    if progress is None:
        progress = _in_kernel() and os.environ.get("EDU3D_PROGRESS", "1") != "0"
    status = None
    try:
        if progress:
            status = _notebook_status(nprocs, warm is not None and warm.jobs == 0)
    except BaseException:
        if warm is not None:
            warm.busy = False  # acquired, never used: free for the next launch
        raise
    poll = on_poll
    if status is not None:
        def poll(elapsed: float, done: int) -> None:
            status.running(elapsed, done)
            if on_poll is not None:
                on_poll(elapsed, done)
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


def child_environment(env: dict | None = None, torchrun_args: Sequence[str] = (),
                      roots: Sequence[str] = ()) -> dict:
    """The environment a launch's ranks start with, before the run's own folder and id:
    this process's, ``env`` on top, one thread per rank unless said otherwise, loopback
    stores and gloo on the loopback interface for a single node, and the launching folder
    (a notebook's helpers) and ``roots`` (the target function's package) importable."""
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.update(EDU3D_LAUNCHER_PID=str(os.getpid()), PYTHONUNBUFFERED="1")
    if _single_node(torchrun_args):
        # gloo listens on the interface it is told (else the host name's address)
        child_env.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())
        child_env["EDU3D_LOOPBACK"] = "1"
    paths = [os.getcwd(), *roots, child_env.get("PYTHONPATH", "")]
    child_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return child_env


def _in_kernel() -> bool:
    if "ipykernel" not in sys.modules:
        return False
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None


def _notebook_status(nprocs: int, new_pool: bool = False):
    from edu3d.status import NotebookStatus

    return NotebookStatus(nprocs, new_pool)


def _launch(cmd, child_env, run_dir: Path, nprocs: int, timeout, echo, on_poll,
            heartbeat: float = 0.0) -> RunResult:
    """Start torchrun, stream its output, watch for errors, hangs and the timeout, collect
    results."""
    emit = _print_line if echo is True else (echo or (lambda *a: None))
    lines: queue.Queue = queue.Queue()
    output: list = []
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env,
                            start_new_session=True, text=True, errors="replace", bufsize=1)

    def pump(stream, tag):
        for raw in stream:
            lines.put((tag, raw.rstrip("\n")))
        lines.put((tag, None))

    readers = [threading.Thread(target=pump, args=(proc.stdout, "stdout"), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, "stderr"), daemon=True)]
    for t in readers:
        t.start()

    def drain(block_s: float) -> int:
        closed = 0
        try:
            item = lines.get(timeout=block_s)
            while True:
                tag, text = item
                if text is None:
                    closed += 1
                else:
                    m = _PREFIX_RE.match(text)
                    rank, body = (int(m.group(1)), m.group(2)) if m else (None, text)
                    output.append((rank, tag, body))
                    if rank is not None:  # torchrun's own chatter stays in result.output
                        emit(rank, tag, body)
                item = lines.get_nowait()
        except queue.Empty:
            pass
        return closed

    closed, failure, last_poll, last_beat = 0, None, 0.0, 0.0
    watch = hb.Watch(run_dir, nprocs, heartbeat) if heartbeat else None
    try:
        while closed < 2 or proc.poll() is None:
            closed += drain(0.05)
            now = time.monotonic() - start
            failure = _first_failure(run_dir)
            if failure is not None:
                break
            if watch is not None and now - last_beat >= 0.25:
                last_beat = now
                hung = watch.check()
                if hung is not None:
                    raise _hung_error(run_dir, hung, lambda: kill_run(proc, run_dir))
            if timeout is not None and now > timeout:
                raise _timeout_error(run_dir, nprocs, timeout, lambda: kill_run(proc, run_dir))
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
        for t in readers:
            t.join(timeout=1.0)
        drain(0.0)
        raise _rank_error(run_dir, nprocs, failure, output)
    return RunResult(run_dir, nprocs, time.monotonic() - start, _results(run_dir, nprocs), output)


# ---- the errors a run ends with (shared by the cold path and the warm pool, edu3d.pool) ------
def _hung_error(run_dir: Path, hung: dict, kill: Callable[[], None]) -> RankHung:
    """Ask the hung rank for its stack, kill every process, and say who hung."""
    stack = _stack_of(run_dir, hung["rank"])
    kill()
    return RankHung(hung["rank"], hung["message"] + "; every process was killed",
                    stack and f"Python stack of rank {hung['rank']} when it was "
                    f"declared hung (most recent call first):\n{stack}",
                    run_dir, hung["ranks"])


def _timeout_error(run_dir: Path, nprocs: int, timeout: float,
                   kill: Callable[[], None]) -> LaunchTimeout:
    done = {p.name for p in (run_dir / "done").glob("rank*")}
    pending = [r for r in range(nprocs) if f"rank{r}" not in done]
    report = runs.flight_report(run_dir, nprocs)
    kill()
    return LaunchTimeout(
        f"run did not finish within {timeout:g} s; rank(s) {pending} were still "
        f"running and every process was killed (run folder: {run_dir})\n"
        f"when it was stopped: {report}")


def _rank_error(run_dir: Path, nprocs: int, failure: dict | None, output: list) -> RankError:
    """The error of the first failing rank (from its error file, its recorded exit, or
    torchrun's report), with its traceback or its last lines."""
    failure = failure or _first_failure(run_dir, settle_s=0.0)
    if failure is None:
        rank, reason = _root_cause(output)
        failure = {"rank": rank, "message": reason}
    rank, message = failure["rank"], failure["message"]
    tail = failure.get("traceback") or "\n".join(
        text for r, _, text in output if r == rank)[-4000:]
    if runs._TIMEOUT.search(message):
        message += f"\nwhen the run was declared hung: {runs.flight_report(run_dir, nprocs)}"
    return RankError(rank, message, tail, run_dir)


def _results(run_dir: Path, nprocs: int) -> list:
    results = []
    for r in range(nprocs):
        f = run_dir / "results" / f"rank{r}.pkl"
        results.append(pickle.loads(f.read_bytes()) if f.exists() else None)
    return results


if __name__ == "__main__":
    _agent_main(sys.argv[1:])
