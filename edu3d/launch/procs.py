"""The processes of a run, and how it ended: what :mod:`edu3d.launch.api` (a cold run),
:mod:`edu3d.launch.warm.pool` (a job on warm ranks) and :mod:`edu3d.launch.supervise` (the
loop that watches either) share.

* how ranks are started: :func:`torchrun_command` and :func:`child_environment`;
* their output: :class:`Pipes` reads the agent's stdout and stderr line by line, and
  :func:`print_line` echoes a rank's line with its prefix;
* stopping them: :func:`kill_run` (each pid checked to be the run's before it is signalled);
* how a run ended, read from its run folder: :func:`first_failure` (the failure that caused
  the others), the error a run raises (:func:`rank_error`, :func:`hung_error`,
  :func:`timeout_error`) and the ranks' return values (:func:`read_results`);
* a warm pool's processes, found by the pool's id in their environment (:func:`pool_pids`).

Like the launcher, this module never imports torch. It keeps one of its
imports inside functions, IPython's (:func:`in_kernel`, asked only where ``ipykernel`` is
loaded): the launcher's start-up (``edu3d run``, torchrun's agent) stays free of IPython's
import, which takes longer than the rest of the launcher's.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from edu3d.distributed import trace
from edu3d.distributed.runtime import loopback_ifname
from edu3d.launch import run_files, runs
from edu3d.launch.run_files import PREFIX_FMT, write_atomic
from edu3d.launch.runs import alive

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
        """The merged trace of every rank (see :mod:`edu3d.distributed.trace`)."""
        return trace.load(self.run_dir)

    def chrome_trace(self, path: str | os.PathLike | None = None) -> Path:
        """Write the run's trace as Chrome trace JSON (open it in https://ui.perfetto.dev)."""
        path = Path(path or self.run_dir / "trace.json")
        trace.to_chrome(self.events(), path)
        return path

    def lines(self, rank: int = 0, stream: str = "stdout") -> list[str]:
        return [text for r, s, text in self.output if r == rank and s == stream]



def single_node(torchrun_args: Sequence[str]) -> bool:
    return not any(a.startswith(_MULTINODE) for a in torchrun_args)


def torchrun_command(nprocs: int, worker_args: Sequence[str], torchrun_args: Sequence[str] = (),
                     entry: str = "edu3d.launch.worker") -> list[str]:
    """The torchrun command line edu3d runs (single node on 127.0.0.1 unless told otherwise).

    ``python -m edu3d.launch.agent`` is torchrun's own agent (``torch.distributed.run.main``)
    with the two additions of :func:`edu3d.launch.agent.main`; it takes exactly torchrun's
    options. Each rank runs ``python -m ENTRY WORKER_ARGS``: :mod:`edu3d.launch.worker` around
    one run's code, or :mod:`edu3d.launch.warm.rank` for a warm rank."""
    cmd = [sys.executable, "-m", "edu3d.launch.agent", f"--nproc-per-node={nprocs}",
           "--max-restarts=0", "--monitor-interval=0.1"]
    if single_node(torchrun_args):
        cmd += ["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                f"--rdzv-id={uuid.uuid4().hex}", "--local-addr=127.0.0.1"]
    return cmd + list(torchrun_args) + ["-m", entry, *worker_args]



def print_line(rank: int | None, stream: str, text: str) -> None:
    out = sys.stdout if stream == "stdout" else sys.stderr
    out.write((PREFIX_FMT.format(rank) if rank is not None else "") + text + "\n")
    out.flush()


class Pipes:
    """The stdout and stderr of a started agent, read line by line by two threads into one
    queue of ``(stream, line)``; ``(stream, None)`` when that stream closes."""

    def __init__(self, proc: subprocess.Popen, name: str = "edu3d"):
        self.lines: queue.Queue = queue.Queue()
        self.readers = [threading.Thread(target=self._pump, args=(s, tag), daemon=True,
                                         name=f"{name}-{tag}")
                        for s, tag in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
        for t in self.readers:
            t.start()

    def _pump(self, stream, tag: str) -> None:
        for raw in stream:
            self.lines.put((tag, raw.rstrip("\n")))
        self.lines.put((tag, None))

    def join(self, timeout: float = 1.0) -> None:
        """Wait (a little) for the last lines of an agent that ended."""
        for t in self.readers:
            t.join(timeout=timeout)


def start(cmd: list[str], env: dict) -> tuple[subprocess.Popen, Pipes]:
    """Start an agent in a session of its own (so it and its ranks can be killed as a group),
    its output read by :class:`Pipes`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True, text=True, errors="replace", bufsize=1)
    return proc, Pipes(proc)



def running(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    if not alive(pid):
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
    nprocs = runs.command(run_dir).get("nprocs")
    all_started = nprocs is not None and len(run_files.pid_files(run_dir)) >= nprocs
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
        return [p for p in run_files.pid_files(run_dir).values()
                if running(p) and runs.belongs_to(p, rid)]

    deadline = time.monotonic() + grace_s
    while ours_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    if ours_running():  # late starters killed after they wrote their pid
        runs.signal_ranks(run_dir)


def first_failure(run_dir: Path, settle_s: float = 5.0) -> dict | None:
    """The failure that caused the others, or None while every rank is fine.

    A rank that dies without a Python error (``os._exit``, a segfault, ``kill -9``) makes its
    partners fail with "Connection closed by peer" a moment later; those are consequences.
    When only consequences are known, wait up to ``settle_s`` for the death that caused them
    (the agent records it, see :mod:`edu3d.launch.agent`) before settling for the
    earliest. (2 s was not enough on a 2-core machine at load 20: the agent's thread wrote
    the death of the rank that called ``os._exit`` after its partner's lost connection had
    waited 2 s.)"""
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


def root_cause(output: list) -> tuple[int, str]:
    """Rank and exit reason from torchrun's failure report, for a rank that left no error file
    (killed by a signal, os._exit, a crash in C++)."""
    text = "\n".join(line for r, _, line in output if r is None)
    text = text[text.find("Root Cause"):] if "Root Cause" in text else text
    m = re.search(r"rank\s*:\s*(\d+).*?\n.*?exitcode\s*:\s*(-?\d+)", text, re.S)
    if not m:
        return -1, "torchrun exited with an error and no rank reported one"
    rank, code = int(m.group(1)), int(m.group(2))
    return rank, runs.how({"signal": -code} if code < 0 else {"code": code})


def stack_of(run_dir: Path, rank: int, wait_s: float = 1.5) -> str:
    """Ask a (hung) rank for its Python stack (``SIGUSR1``, see :mod:`edu3d.launch.worker`) and
    return its main thread's, most recent call first ("" if it cannot answer)."""
    pid, path = run_files.pid_files(run_dir).get(rank), run_files.path(run_dir, "stacks", rank)
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



def child_environment(env: dict | None = None, torchrun_args: Sequence[str] = (),
                      roots: Sequence[str] = ()) -> dict:
    """The environment a launch's ranks start with, before the run's own folder and id:
    this process's, ``env`` on top, one thread per rank unless said otherwise, loopback
    stores and gloo on the loopback interface for a single node, and the launching folder
    (a notebook's helpers) and ``roots`` (the target function's package) importable."""
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.update(EDU3D_LAUNCHER_PID=str(os.getpid()), PYTHONUNBUFFERED="1")
    if single_node(torchrun_args):
        # gloo listens on the interface it is told (else the host name's address)
        child_env.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())
        child_env["EDU3D_LOOPBACK"] = "1"
    paths = [os.getcwd(), *roots, child_env.get("PYTHONPATH", "")]
    child_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return child_env


def in_kernel() -> bool:
    if "ipykernel" not in sys.modules:
        return False
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None



# ---- the errors a run ends with ------------------------------------------------------------
def hung_error(run_dir: Path, hung: dict, kill: Callable[[], None]) -> RankHung:
    """Ask the hung rank for its stack (unless it is stopped: it cannot answer), write the
    verdict as its error (with several nodes, the others learn it from there:
    :func:`tell_the_nodes`), kill every process, and say who hung."""
    stack = stack_of(run_dir, hung["rank"]) if hung.get("stack", True) else ""
    tell_the_nodes(run_dir, hung["rank"], "RankHung", hung["message"])
    kill()
    return RankHung(hung["rank"], hung["message"] + "; every process was killed",
                    stack and f"Python stack of rank {hung['rank']} when it was "
                    f"declared hung (most recent call first):\n{stack}",
                    run_dir, hung["ranks"])


def tell_the_nodes(run_dir: Path, rank: int, kind: str, message: str, wait_s: float = 5.0) -> None:
    """Write the launcher's verdict on ``rank`` as its error (``errors/rank{R}.json``, as the
    rank itself would), and, when the run spans several nodes (its agent made ``shared/``),
    wait until every other node has it (``shared/rank{R}``, :class:`edu3d.launch.agent.
    SharedFailures`): the kill that follows also ends this node's agent, the messenger."""
    error = run_files.path(run_dir, "errors", rank)
    if not error.exists():
        write_atomic(error, json.dumps(
            {"rank": rank, "type": kind, "message": message, "time_ns": time.time_ns()}))
    deadline = time.monotonic() + wait_s
    while (run_dir / "shared").is_dir() and not run_files.path(run_dir, "shared", rank).exists() \
            and time.monotonic() < deadline:
        time.sleep(0.05)


def timeout_error(run_dir: Path, nprocs: int, timeout: float,
                   kill: Callable[[], None]) -> LaunchTimeout:
    done = run_files.ranks(run_dir, "done")
    pending = [r for r in runs.ranks_here(run_dir, nprocs) if r not in done]
    report = runs.flight_report(run_dir, nprocs)
    kill()
    return LaunchTimeout(
        f"run did not finish within {timeout:g} s; rank(s) {pending} were still "
        f"running and every process was killed (run folder: {run_dir})\n"
        f"when it was stopped: {report}")


def rank_error(run_dir: Path, nprocs: int, failure: dict | None,
               output: list) -> RankError | LaunchError:
    """The error of the first failing rank (from its error file, its recorded exit, or
    torchrun's report), with its traceback or its last lines; a :class:`LaunchError` with
    torchrun's last lines when no rank is to blame."""
    failure = failure or first_failure(run_dir, settle_s=0.0)
    if failure is None:
        rank, reason = root_cause(output)
        if rank < 0:  # no rank to blame: torchrun itself failed (a rendezvous, a port)
            said = [text for r, _, text in output if r is None and text.strip()][-12:]
            return LaunchError(f"{reason}; torchrun's last lines:\n" + "\n".join(said)
                               if said else reason)
        failure = {"rank": rank, "message": reason}
    rank, message = failure["rank"], failure["message"]
    tail = failure.get("traceback") or "\n".join(
        text for r, _, text in output if r == rank)[-4000:]
    if runs.TIMED_OUT.search(message):
        message += f"\nwhen the run was declared hung: {runs.flight_report(run_dir, nprocs)}"
    return RankError(rank, message, tail, run_dir)


def read_results(run_dir: Path, nprocs: int) -> list:
    results = []
    for r in range(nprocs):
        f = run_files.path(run_dir, "results", r)
        results.append(pickle.loads(f.read_bytes()) if f.exists() else None)
    return results


def pool_pids(pool_id: str) -> list[int]:
    """Every process whose environment carries ``EDU3D_POOL_ID=pool_id``: the agent, the
    zygote, the stubs and the ranks (to check that nothing was left behind, or to add up
    what a pool costs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"EDU3D_POOL_ID={pool_id}".encode() in env:
                found.append(int(entry.name))
    return found
