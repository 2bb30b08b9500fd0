"""Running one exercise notebook for ``edu3d grade`` in a watched kernel.

After reading this file you should understand what the grader sees when a submission does
not simply pass or fail:

* every cell runs in a fresh kernel (nbclient) with a per-cell limit, ``--timeout`` seconds;
  a cell still running then is interrupted and its error becomes :data:`TIMED_OUT`, naming
  the limit and the innermost frame of the learner's file (``alice/ranks.py:3 in coords_of``,
  read from the ``KeyboardInterrupt`` traceback); the cells after it still run. A submission
  that swallows the interrupt has its kernel stopped at twice the limit;
* a kernel that dies (``os._exit``, a crash, that kill) leaves :data:`EXITED` in the cell it
  was running, with the exit code (or signal) and, where Python could write one, its last
  frame: an IPython startup file makes ``os._exit`` and fatal signals dump the stack
  (faulthandler) into a file the grader reads. The cells after it cannot run
  (:data:`STOPPED`, said by :func:`edu3d.course.autograde.scoring.grade_one`);
* the kernel starts in the grade's own temporary folder: a fresh ``HOME``, working folder,
  ``TMPDIR`` and ``EDU3D_RUNS``, all removed after the grade, and the marker
  ``EDU3D_GRADE_TOKEN`` its processes are found by (:mod:`edu3d.course.autograde.processes`).
  The same startup file seals the checker before the first cell
  (:func:`edu3d.course.verdict_channel.seal`), and the cells' boundaries are marked on the
  verdict channel (:mod:`edu3d.course.autograde.channel`). The kernel's own channels are Unix
  sockets in that folder (ZMQ's ``ipc`` transport), not TCP ports: no port chosen then taken
  by another process before the kernel binds it, none that another local user can reach.
  With ``--isolate`` the kernel's command line is prefixed (:mod:`edu3d.course.autograde.isolate`).

How the verdicts are counted is :mod:`edu3d.course.autograde.scoring`'s.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

from jupyter_client import AsyncKernelManager

from edu3d.course.autograde.channel import Channel
from edu3d.course.autograde.processes import TOKEN
from edu3d.course.nbtools import notebook_client

# a cell the grader stopped, one whose kernel died, one not run after that
TIMED_OUT, EXITED, STOPPED = "CellTimedOut", "KernelExited", "KernelStopped"


def kernel_env(solutions: bool, submission: Path | None, runs: Path,
               hints: dict[str, str] | None = None, home: Path | None = None,
               token: str | None = None) -> dict[str, str]:
    """The graded kernel's environment; ``hints``: ``EDU3D_HINT_LEVEL`` / ``EDU3D_HINT_PRIOR``
    (:mod:`edu3d.course.autograde.hints`), never inherited from the caller's shell; ``home``:
    a fresh folder for ``HOME``, ``TMPDIR`` and the XDG folders; ``token``: the grade's
    process marker."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "EDU3D_SUBMISSION", "EDU3D_HINT_LEVEL", "EDU3D_HINT_PRIOR", TOKEN)
        and not k.startswith("XDG_")}
    env.update(EDU3D_SOLUTIONS="1" if solutions else "0", OMP_NUM_THREADS="1",
               EDU3D_RUNS=str(runs), EDU3D_PROGRESS="0", PYTHONDONTWRITEBYTECODE="1",
               **(hints or {}))
    if submission is not None:
        env["EDU3D_SUBMISSION"] = str(submission)
    if home is not None:
        env.update(HOME=str(home), TMPDIR=str(home / "tmp"),
                   XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"),
                   XDG_DATA_HOME=str(home / ".local" / "share"))
        (home / "tmp").mkdir(parents=True, exist_ok=True)
    if token is not None:
        env[TOKEN] = token
    return env


# Run by the kernel before the first cell (an IPython startup file): a crash (SIGSEGV, ...) or
# an ``os._exit`` leaves its Python stack in the file $EDU3D_GRADE_STACKS for the grader to read.
STARTUP = """\
import faulthandler as _fh, os as _os
_stacks = open(_os.environ["EDU3D_GRADE_STACKS"], "a")
_fh.enable(_stacks)
def _exit(code, _real=_os._exit):
    _stacks.write(f"os._exit({code})\\n"); _stacks.flush(); _fh.dump_traceback(_stacks, False)
    _real(code)
_os._exit = _exit
from edu3d.course import verdict_channel as _verdicts
_verdicts.seal()  # before the first cell, so before the submission is imported
"""
ANSI = re.compile(r"\x1b\[[0-9;]*m")
FRAME = re.compile(r'File "(?P<a>[^"]+)", line (?P<al>\d+),? in (?P<af>\S+)'  # python, faulthandler
                   r'|File (?P<b>\S[^\n]*?):(?P<bl>\d+), in (?P<bf>[\w<>]+)'  # IPython
                   r'|Cell In\[\d+\], line (?P<cl>\d+)')  # the cell's own code


def last_frame(text: str, graded: list[Path]) -> str | None:
    """The innermost frame of a traceback or stack dump in a graded file (``alice/ranks.py:3
    in coords_of``), else in the notebook cell (``the cell, line 2``); None without one."""
    mine, cell = None, None
    for m in FRAME.finditer(ANSI.sub("", text)):
        if m["cl"]:
            cell = f"the cell, line {m['cl']}"
            continue
        path, line, func = (m["a"], m["al"], m["af"]) if m["a"] else (m["b"], m["bl"], m["bf"])
        if Path(path).parent.resolve() in graded:
            mine = f"{Path(path).parent.name}/{Path(path).name}:{line} in {func}"
    return mine or cell


def exit_words(code: int | None) -> str:
    if code is None:
        return "the submission's kernel exited"
    if code < 0:
        return f"the submission's kernel was killed by signal {signal.Signals(-code).name}"
    return f"the submission's kernel exited with code {code}"


class PrefixedKernelManager(AsyncKernelManager):
    """A kernel manager whose kernel command line starts with :attr:`prefix` (``--isolate``)."""

    prefix: list[str] = []

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        return [*self.prefix, *super().format_kernel_cmd(extra_arguments)]


def execute(nb, env: dict[str, str], cwd: Path, timeout: float,
            graded: list[Path] | None = None, channel: Channel | None = None,
            prefix: list[str] | None = None) -> str | None:
    """Run ``nb`` in place in a fresh kernel started in ``cwd``; None, or why the run stopped
    early (a dead kernel). Cells that raise are recorded and the next ones still run.

    A cell still running after ``timeout`` s is interrupted (its output becomes a
    :data:`TIMED_OUT` error naming the limit and the innermost frame of ``graded`` files);
    one that ignores the interrupt has its kernel stopped at twice the limit (SIGABRT, so it
    says where). A kernel that
    dies (``os._exit``, a crash, that kill) leaves an :data:`EXITED` error with its exit code
    and last frame in the cell it was running, and the cells after it do not run. The
    kernel's own console output (not the cells') goes to ``cwd/kernel.log``. ``channel``: the
    verdict channel, told where each cell starts and ends; ``prefix``: what the kernel's
    command line starts with."""
    for cell in nb.cells:  # no committed output may stand in for one the run did not produce
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    graded = [g.resolve() for g in graded or []]
    startup, stacks = cwd / "ipython" / "profile_default" / "startup", cwd / "stacks.log"
    startup.mkdir(parents=True)
    (startup / "00-edu3d-grade.py").write_text(STARTUP)
    env = {**env, "IPYTHONDIR": str(cwd / "ipython"), "EDU3D_GRADE_STACKS": str(stacks),
           **(channel.env if channel is not None else {})}
    km = PrefixedKernelManager(kernel_name="python3")
    km.prefix, km.connection_file = list(prefix or []), str(cwd / "kernel.json")
    if len(os.fsencode(cwd)) < 80:  # Unix sockets (path <= 107 bytes) in the grade's folder:
        km.transport = "ipc"  # no TCP port to race for or for other local users to reach
    client = notebook_client(nb, km=km, timeout=timeout, kernel_name="python3",
                             allow_errors=True, interrupt_on_timeout=True,
                             resources={"metadata": {"path": str(cwd)}})
    client.owns_km = True  # so it shuts the kernel down at the end, as with its own manager
    now: dict = {}  # the cell running: index, start, watchdog, the kernel's process

    def stop_kernel():  # SIGABRT first: faulthandler writes where it was; then SIGKILL
        now["killed"] = True
        now["kernel"].send_signal(signal.SIGABRT)
        last = threading.Timer(5, lambda: now["kernel"].poll() is None and now["kernel"].kill())
        last.daemon = True
        last.start()

    def started(cell, cell_index):
        if channel is not None:
            channel.mark("start", cell_index)
        killer = threading.Timer(2 * timeout + 5, stop_kernel)
        killer.daemon = True
        now.update(index=cell_index, t0=time.monotonic(), killer=killer,
                   kernel=client.km.provisioner.process)
        killer.start()

    def finished(cell, cell_index, execute_reply):
        now["killer"].cancel()
        if channel is not None:
            channel.mark("end", cell_index)
        content = (execute_reply or {}).get("content", {})
        if content.get("ename") == "KeyboardInterrupt" and \
                time.monotonic() - now["t0"] >= timeout:  # nbclient interrupted it
            err = [o for o in cell.outputs if o.get("output_type") == "error"]
            where = last_frame("\n".join(err[-1].get("traceback", [])) if err else "", graded)
            cell.outputs = [o for o in cell.outputs if o.get("output_type") != "error"] + [
                {"output_type": "error", "ename": TIMED_OUT, "traceback": [],
                 "evalue": f"the submission timed out: still running after {timeout:g} s "
                           "(the limit per cell, --timeout)" + (f", at {where}" if where else "")}]

    client.on_cell_execute, client.on_cell_executed = started, finished
    log = cwd / "kernel.log"
    try:
        with open(log, "w") as console:
            client.execute(env=env, stdout=console, stderr=console)
    except Exception as err:  # noqa: BLE001 - a dead kernel fails what had not run yet
        if "killer" in now:
            now["killer"].cancel()
        kernel = now.get("kernel")
        code = kernel.poll() if kernel is not None else None
        what = (f"the submission timed out and ignored the interrupt at {timeout:g} s (the "
                f"limit per cell, --timeout): its kernel was stopped at {2 * timeout + 5:g} s"
                if now.get("killed") else exit_words(code) if code is not None else
                f"the kernel stopped: {type(err).__name__}: "
                + (str(err).strip().splitlines() or [""])[0])
        dump = stacks.read_text(errors="replace") if stacks.exists() else ""
        where = last_frame(dump, graded)
        last = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()
                and "without encryption" not in ln]
        what += (f", at {where}" if where else ", where: no Python stack left"
                 if code is not None and code >= 0 and not now.get("killed") else "") + (
            f" (its last words: {last[-1].strip()[:200]})" if last else "")
        index = now.get("index")
        if index is not None and not any(o.get("output_type") == "error"
                                         for o in nb.cells[index].outputs):
            nb.cells[index].outputs.append(
                {"output_type": "error", "ename": EXITED, "evalue": what, "traceback": []})
        return f"could not run: {what.split(', at ')[0].split(' (its last')[0]} in cell " \
            f"{index}" if index is not None else what
    return None
