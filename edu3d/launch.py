"""Launching ranks: torchrun as a subprocess, watched from Python.

After reading this file you should understand how one call turns into N cooperating processes
and how edu3d keeps that safe:

* ``launch(target, n)`` runs ``python -m torch.distributed.run`` in a new process session with
  rendezvous on ``127.0.0.1`` and a free port (never a fixed 29500), ``OMP_NUM_THREADS=1``,
  and :mod:`edu3d.worker` wrapped around your code on every rank;
* ``target`` is a script path, a module (``module=True``), or a function of an importable
  module (called on every rank as ``function(mesh, *args, **kwargs)``; a function defined in a
  notebook cell cannot travel to another process, use ``%%torchrun`` for that);
* output is streamed live with a rank prefix; return values, errors and traces are collected
  from the run folder;
* the first failing rank ends the run: every process is killed and one :class:`RankError`
  names that rank and carries its traceback. A timeout or an interrupt also kills every
  process; nothing is left running.

The launcher itself never imports torch, so ``edu3d run`` adds almost nothing to torchrun.
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
from pathlib import Path
from typing import Callable, Sequence

from edu3d.worker import PREFIX_FMT, _alive

_PREFIX_RE = re.compile(r"^\[rank (\d+)\] ?(.*)$")
# torchrun options that mean "the user is setting up rendezvous themselves" (multi-node)
_MULTINODE = ("--nnodes", "--node-rank", "--node_rank", "--rdzv", "--master-addr",
              "--master_addr", "--master-port", "--master_port", "--local-addr", "--local_addr")


class LaunchError(RuntimeError):
    """A run that could not start or did not finish cleanly."""


class RankError(LaunchError):
    """The first rank that failed, with its traceback."""

    def __init__(self, rank: int, message: str, traceback: str = "", run_dir: Path | None = None):
        self.rank, self.traceback, self.run_dir = rank, traceback, run_dir
        text = f"rank {rank} failed: {message}"
        if traceback:
            text += f"\n---- traceback of rank {rank} ----\n{traceback.rstrip()}"
        super().__init__(text)


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


def new_run_dir(name: str = "run", create: bool = True) -> Path:
    """A fresh folder under ``$EDU3D_RUNS`` (default ``./runs``) for one run's files."""
    base = Path(os.environ.get("EDU3D_RUNS", "runs"))
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)[:40]
    path = (base / f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}-{uuid.uuid4().hex[:6]}").resolve()
    if create:
        path.mkdir(parents=True)
    return path


def _loopback_ifname() -> str:
    names = [n for _, n in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), names[0] if names else "lo")


def torchrun_command(nprocs: int, worker_args: Sequence[str],
                     torchrun_args: Sequence[str] = ()) -> list[str]:
    """The torchrun command line edu3d runs (single node on 127.0.0.1 unless told otherwise)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
           "--max-restarts=0", "--monitor-interval=0.1"]
    if not any(a.startswith(_MULTINODE) for a in torchrun_args):
        cmd += ["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                f"--rdzv-id={uuid.uuid4().hex}", "--local-addr=127.0.0.1"]
    return cmd + list(torchrun_args) + ["-m", "edu3d.worker", *worker_args]


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


def _pids(run_dir: Path) -> list[int]:
    pids = []
    for f in (run_dir / "pids").glob("rank*.pid"):
        try:
            pids.append(int(f.read_text()))
        except (OSError, ValueError):
            pass
    return pids


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
    """Kill every process of a run: the workers (each in its own session), then torchrun."""
    workers = _pids(run_dir)
    for pid in workers:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc.poll() is None:
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
    deadline = time.monotonic() + grace_s
    while any(_running(p) for p in _pids(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in _pids(run_dir):  # late starters killed after they wrote their pid
        if _running(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _first_error(run_dir: Path) -> dict | None:
    errors = []
    for f in (run_dir / "errors").glob("rank*.json"):
        try:
            errors.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass
    return min(errors, key=lambda e: e["time_ns"]) if errors else None


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


def launch(target, nprocs: int = 2, *, args: Sequence = (), kwargs: dict | None = None,
           module: bool = False, layout=None, init: bool = True, timeout: float | None = None,
           run_dir: str | os.PathLike | None = None, env: dict | None = None,
           echo: bool | Callable[[int | None, str, str], None] = True,
           on_poll: Callable[[float, int], None] | None = None, progress: bool | None = None,
           torchrun_args: Sequence[str] = (), name: str | None = None) -> RunResult:
    """Run ``target`` on ``nprocs`` ranks and wait for it.

    ``echo``: ``True`` prints each line with its rank prefix, ``False`` prints nothing, a
    callable receives ``(rank, stream, line)`` (rank ``None`` for torchrun's own lines).
    ``on_poll(elapsed_s, ranks_done)`` is called a few times a second (progress displays).
    ``progress`` shows a live status line under the cell (default: in a Jupyter kernel,
    unless ``EDU3D_PROGRESS=0``). ``timeout`` (seconds) bounds the whole run. Raises :class:`RankError`,
    :class:`LaunchTimeout` or :class:`LaunchError`; ``KeyboardInterrupt`` kills the run.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise LaunchError(f"nprocs must be a positive integer, not {nprocs!r}")
    if layout is not None:
        nnodes = next((int(a.split("=", 1)[1]) for a in torchrun_args
                       if a.startswith("--nnodes=") and a.split("=", 1)[1].isdigit()), 1)
        layout.validate(world_size=nprocs * nnodes)
    if timeout is not None and timeout <= 0:
        raise LaunchError(f"timeout must be positive seconds, not {timeout!r}")
    label = name or (getattr(target, "__name__", None) or Path(os.fspath(target)).stem)
    run_dir = Path(run_dir).resolve() if run_dir else new_run_dir(label, create=False)
    worker_argv, payload = _worker_args(target, module, args, kwargs, layout, init, run_dir)
    cmd = torchrun_command(nprocs, worker_argv, torchrun_args)
    run_dir.mkdir(parents=True, exist_ok=True)
    if payload:
        (run_dir / "call-args.pkl").write_bytes(payload)

    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.update(EDU3D_RUN_DIR=str(run_dir), EDU3D_LAUNCHER_PID=str(os.getpid()),
                     PYTHONUNBUFFERED="1")
    if not any(a.startswith(_MULTINODE) for a in torchrun_args):
        child_env.setdefault("GLOO_SOCKET_IFNAME", _loopback_ifname())
    # the launching directory's modules (a notebook's helpers) and the target function's
    # package import on every rank
    paths = [os.getcwd(), *_import_root(target), child_env.get("PYTHONPATH", "")]
    child_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    (run_dir / "command.json").write_text(json.dumps({"argv": cmd, "nprocs": nprocs}))

    if progress is None:
        progress = _in_kernel() and os.environ.get("EDU3D_PROGRESS", "1") != "0"
    status = _notebook_status(nprocs) if progress else None
    poll = on_poll
    if status is not None:
        def poll(elapsed: float, done: int) -> None:
            status.running(elapsed, done)
            if on_poll is not None:
                on_poll(elapsed, done)
    try:
        result = _launch(cmd, child_env, run_dir, nprocs, timeout, echo, poll)
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


def _in_kernel() -> bool:
    if "ipykernel" not in sys.modules:
        return False
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None


def _notebook_status(nprocs: int):
    from edu3d.magic import NotebookStatus

    return NotebookStatus(nprocs)


def _launch(cmd, child_env, run_dir: Path, nprocs: int, timeout, echo, on_poll) -> RunResult:
    """Start torchrun, stream its output, watch for errors and the timeout, collect results."""
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

    closed, failed, last_poll = 0, False, 0.0
    errors_dir = run_dir / "errors"
    try:
        while closed < 2 or proc.poll() is None:
            closed += drain(0.05)
            now = time.monotonic() - start
            if errors_dir.exists() and any(errors_dir.glob("rank*.json")):
                failed = True
                break
            if timeout is not None and now > timeout:
                done = {p.name for p in (run_dir / "done").glob("rank*")}
                pending = [r for r in range(nprocs) if f"rank{r}" not in done]
                kill_run(proc, run_dir)
                raise LaunchTimeout(
                    f"run did not finish within {timeout:g} s; rank(s) {pending} were still "
                    f"running and every process was killed (run folder: {run_dir})")
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

    if failed or proc.returncode != 0:
        for t in readers:
            t.join(timeout=1.0)
        drain(0.0)
        err = _first_error(run_dir)
        if err is not None:
            raise RankError(err["rank"], f"{err['type']}: {err['message']}", err["traceback"],
                            run_dir)
        rank, reason = _root_cause(output)
        tail = "\n".join(text for r, _, text in output if r == rank)[-4000:]
        raise RankError(rank, reason, tail, run_dir)

    results = []
    for r in range(nprocs):
        f = run_dir / "results" / f"rank{r}.pkl"
        results.append(pickle.loads(f.read_bytes()) if f.exists() else None)
    return RunResult(run_dir, nprocs, time.monotonic() - start, results, output)
