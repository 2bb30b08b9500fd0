"""The wrapper torchrun starts on every rank: ``python -m edu3d.launch.worker --script|--module|--call``.

After reading this file you should understand what edu3d adds around your code on each rank,
and why:

* **a rank prefix** on every line written to its stdout and stderr, by Python or anything
  else (``[rank 3] ...``), so the launcher can stream the output of many ranks through one
  pipe and still say who said what;
* **an error file** ``errors/rank{R}.json`` written the moment your code raises, with the
  traceback and a timestamp. When one rank fails the others soon fail too (their partner is
  gone), so the launcher names the rank whose error came *first*;
* **a pid file** ``pids/rank{R}.pid``, because torchrun starts each worker in a session of
  its own, so killing torchrun's process group does not reach them (the launcher checks that
  the pid still carries the run's ``EDU3D_RUN_ID`` before it signals it: pids recycle);
* **a watchdog** thread that ends the rank if torchrun or the launcher disappears (or, for a
  warm rank forked by a pool's zygote, the zygote or the stub torchrun started for it), so
  an interrupted notebook never leaves ranks behind;
* **a stack on request**: ``SIGUSR1`` makes the rank write every thread's Python stack to
  ``stacks/rank{R}.txt`` (:mod:`faulthandler`, from inside the signal handler, so it works
  even while the rank is blocked in C++). The launcher asks a rank it declares hung.

This module imports no torch unless it calls a function for you (``--call``), so launching
an empty script costs the same as a bare torchrun. A warm rank (:mod:`edu3d.launch.warm.rank`)
starts the same way (:func:`start_rank`) and runs job after job, each through the same code a
cold rank runs (:func:`parser`, :func:`run_target`, :func:`fail`).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import pickle
import re
import runpy
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from edu3d.distributed import runtime, trace
from edu3d.config.layout import Layout
from edu3d.launch import run_files
from edu3d.launch.run_files import PREFIX_FMT, write_atomic
from edu3d.launch.runs import alive

_EOL = re.compile(rb"([^\r\n]*)(\r\n|\n|\r)")


def _split_lines(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines of ``buf`` and the unfinished rest. ``\r`` ends a line too (a progress
    bar redraws its line with it); a ``\r`` at the very end waits, it may start ``\r\n``."""
    lines, pos = [], 0
    for m in _EOL.finditer(buf):
        if m.group(2) == b"\r" and m.end() == len(buf):
            break
        if m.group(1) or m.group(2) != b"\r":
            lines.append(m.group(1))
        pos = m.end()
    return lines, buf[pos:]


def _prefix_fd(fd: int, prefix: bytes, idle_s: float = 0.2) -> threading.Thread:
    """Send everything written to ``fd`` (by Python, C++ or a child process) through a pipe;
    a thread writes it on to the original with ``prefix`` before each line.

    Working on the file descriptor, not on ``sys.stdout``, catches ``os.write(1, ...)`` and
    C++ logs, and leaves ``sys.stdout`` the ordinary text stream a script expects
    (``.buffer``, ``.encoding``, ``.reconfigure``). A partial line (``50%`` with no newline)
    is shown after ``idle_s`` without more output."""
    original = os.dup(fd)
    read_end, write_end = os.pipe()
    os.dup2(write_end, fd)
    os.close(write_end)

    def pump():
        rest = b""
        while True:
            ready, _, _ = select.select([read_end], [], [], idle_s if rest else None)
            chunk = os.read(read_end, 65536) if ready else b""
            lines, rest = _split_lines(rest + chunk)
            if ready and not chunk or not ready and rest:  # end of output, or a quiet partial
                lines, rest = lines + [rest.rstrip(b"\r")] if rest else lines, b""
            if lines:  # one write per batch keeps lines whole when ranks share a pipe
                os.write(original, b"".join(prefix + line + b"\n" for line in lines))
            if ready and not chunk:
                return

    thread = threading.Thread(target=pump, name=f"edu3d-prefix-{fd}", daemon=True)
    thread.start()
    return thread


def _close_output(pumps: list[threading.Thread], timeout_s: float = 2.0) -> None:
    """Flush Python's streams, close the pipes' write ends and let the pumps finish."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if pumps:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(devnull, fd)
        for t in pumps:
            t.join(timeout_s)


def _start_watchdog(interval: float = 0.2, also_watch: int = 0) -> None:
    """Exit (code 3) when the parent, the launcher (``EDU3D_LAUNCHER_PID``) or the process
    ``also_watch`` (a forked pool rank's stub, :mod:`edu3d.launch.warm.zygote`) is gone."""
    parent = os.getppid()
    launcher = int(os.environ.get("EDU3D_LAUNCHER_PID", "0"))

    def watch():
        while True:
            time.sleep(interval)
            if os.getppid() != parent or (launcher and not alive(launcher)) or \
                    (also_watch and not alive(also_watch)):
                os._exit(3)

    threading.Thread(target=watch, name="edu3d-watchdog", daemon=True).start()


_STACKS = []  # the open file faulthandler writes to (kept open while it is registered)


def stack_on_signal(run_dir: Path, rank: int) -> None:
    """``SIGUSR1`` dumps every thread's Python stack to ``stacks/rank{R}.txt`` of ``run_dir``
    (a warm rank calls it again for each job's folder: the previous file is then closed)."""
    path = run_files.path(run_dir, "stacks", rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = list(_STACKS)
    _STACKS.append(open(path, "w"))
    faulthandler.register(signal.SIGUSR1, file=_STACKS[-1], all_threads=True)
    for f in old:
        f.close()
        _STACKS.remove(f)


def user_traceback(err: BaseException) -> str:
    """The traceback of ``err`` without this wrapper's own frames (worker.py, runpy)."""
    tb = err.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")
                              or tb.tb_frame.f_code.co_filename.endswith("runpy.py")):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(err), err, tb))


def _parse_layout(text: str | None):
    if not text:
        return None
    return Layout(**json.loads(text))


def _call(spec: str, layout_json: str | None, args_file: str | None, init: bool):
    module, _, name = spec.partition(":")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    args, kwargs = ((), {})
    if args_file:
        with open(args_file, "rb") as f:
            args, kwargs = pickle.load(f)
    if not init:
        return fn(*args, **kwargs)
    mesh = runtime.init(_parse_layout(layout_json))
    try:
        return fn(mesh, *args, **kwargs)
    finally:
        runtime.shutdown(mesh)


def parser() -> argparse.ArgumentParser:
    """The wrapper's arguments (a warm rank parses each job's with it too)."""
    p = argparse.ArgumentParser(prog="python -m edu3d.launch.worker")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--script")
    target.add_argument("--module")
    target.add_argument("--call", help="module:function, called as function(mesh, *args, **kw)")
    p.add_argument("--layout", help="JSON of Layout fields for --call")
    p.add_argument("--args-file", help="pickled (args, kwargs) for --call")
    p.add_argument("--no-init", action="store_true", help="--call without runtime.init")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def run_target(a, rest: list[str], rank: int, run_dir: Path | None) -> dict | None:
    """Run the script, module or function of the parsed arguments ``a``; the error (a dict
    for ``errors/rank{R}.json``) or None. A function's return value goes to ``results/``."""
    try:
        if a.script:
            sys.argv = [a.script, *rest]
            sys.path.insert(0, str(Path(a.script).resolve().parent))
            runpy.run_path(a.script, run_name="__main__")
        elif a.module:
            sys.argv = [a.module, *rest]
            runpy.run_module(a.module, run_name="__main__", alter_sys=True)
        else:
            result = _call(a.call, a.layout, a.args_file, not a.no_init)
            if run_dir:
                write_atomic(run_files.path(run_dir, "results", rank), pickle.dumps(result))
    except SystemExit as e:
        if e.code not in (None, 0):
            return {"type": "SystemExit", "message": f"exited with code {e.code}",
                    "traceback": f"SystemExit: {e.code}\n"}
    except BaseException as e:  # noqa: BLE001 - every failure must be reported, then exit
        return {"type": type(e).__name__, "message": str(e), "traceback": user_traceback(e)}
    return None


def fail(error: dict, rank: int, run_dir: Path | None, pumps: list) -> None:
    """Write the error file and the traceback, then leave at once."""
    error.update(rank=rank, time_ns=time.time_ns(), pid=os.getpid())
    if run_dir:
        write_atomic(run_files.path(run_dir, "errors", rank), json.dumps(error))
    sys.stderr.write(error["traceback"])
    _close_output(pumps)
    os._exit(1)  # skip finalization: a broken process group can hang on teardown


def start_rank(rank: int, run_dir: Path | None, also_watch: int = 0) -> list:
    """What every rank does first, cold or warm: the watchdog, the stack on ``SIGUSR1``, the
    pid file, and the rank prefix on its output (the prefixing threads are returned)."""
    _start_watchdog(also_watch=also_watch)
    if run_dir:
        stack_on_signal(run_dir, rank)
        write_atomic(run_files.path(run_dir, "pids", rank), str(os.getpid()))
    pumps = []
    if os.environ.get("EDU3D_PREFIX", "1") != "0":
        for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
            stream.flush()
            pumps.append(_prefix_fd(fd, PREFIX_FMT.format(rank).encode()))
    return pumps


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest

    rank = int(os.environ.get("RANK", "0"))
    run_dir = Path(os.environ["EDU3D_RUN_DIR"]) if os.environ.get("EDU3D_RUN_DIR") else None
    pumps = start_rank(rank, run_dir)
    error = run_target(a, rest, rank, run_dir)
    if error is not None:
        fail(error, rank, run_dir, pumps)
    trace.current().flush()
    if run_dir:
        write_atomic(run_files.path(run_dir, "done", rank), "")
    _close_output(pumps)
    # Everything is written. Leaving through os._exit skips interpreter finalization, where
    # process-group objects a script kept alive would be destroyed late and abort gloo.
    os._exit(0)


if __name__ == "__main__":
    main()
