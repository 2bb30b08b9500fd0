"""``edu3d`` commands run as a shell runs them, one child process each, measured.

``python -m tests.workers_refusals`` reads ``{"runs": [[key, argv], ...], "folder": DIR,
"timeout": seconds}`` on stdin, imports edu3d's command line once, then forks one child per
run: the child points its stdout and stderr at files, runs ``edu3d ARGV`` (:func:`edu3d.cli.main`)
and exits with its code. The parent reaps each child with ``wait4``, whose resource usage is
that child's alone: its peak resident memory and its time. The child's ``ru_maxrss`` counts
what it shares with this parent, as a fresh ``edu3d`` process holds the same imports, except
the pages of the libraries it has not touched yet (a forked child maps them lazily): those,
this process's resident memory less the child's as it starts, are added back. A fresh
process also peaks while it imports, so the figure reported is the larger of that sum and
this process's own peak (:func:`status_mb`): an upper bound of what ``edu3d ARGV`` holds
when run alone. One JSON
object by key goes to stdout. A child that runs past ``timeout`` is killed and reported as
hung. Each child's address space is capped (``RLIMIT_AS``) so that a reader that tries to
load a multi-GiB file fails with MemoryError instead of taking the shared machine's memory.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import traceback

import edu3d.commands.ckpt  # noqa: F401 - imported once here, not in every child
import edu3d.commands.generate  # noqa: F401
import edu3d.commands.train  # noqa: F401
import edu3d.commands.tune  # noqa: F401
from edu3d.cli import main

ADDRESS_SPACE = 3 * 2**30


def child(argv: list[str], out: str, err: str) -> None:
    """In the forked child: note its resident memory as it starts (into ``out + ".rss"``),
    run ``edu3d ARGV`` with stdout/stderr into files, then exit."""
    code = 1
    try:
        with open(out + ".rss", "w") as f:
            f.write(str(status_mb("VmRSS")))
        for fd, name in ((1, out), (2, err)):
            target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - what a shell would see: a traceback, code 1
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def status_mb(field: str) -> float:
    """A memory figure of this process from ``/proc/self/status``, in MB: ``VmRSS`` (resident
    now), ``VmHWM`` (its peak since its exec; ``ru_maxrss`` would also count the process
    that started this one, from before the exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def measure(key: str, argv: list[str], folder: str, timeout: float) -> dict:
    out, err = os.path.join(folder, f"{key}.out"), os.path.join(folder, f"{key}.err")
    sys.stdout.flush()
    sys.stderr.flush()
    imports, resident = status_mb("VmHWM"), status_mb("VmRSS")
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(argv, out, err)
    hung = False
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > timeout:
            os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            hung = True
            break
        time.sleep(0.01)
    with open(out + ".rss") as f:  # a forked child counts the libraries' pages only once it
        unmapped = max(0.0, resident - float(f.read()))  # touches them; a fresh process all
    with open(out, errors="replace") as f_out, open(err, errors="replace") as f_err:
        return {"argv": argv, "rc": None if hung else os.waitstatus_to_exitcode(status),
                "hung": hung, "seconds": time.monotonic() - t0,
                "rss_mb": max(usage.ru_maxrss / 1024 + unmapped, imports),
                "child_mb": usage.ru_maxrss / 1024, "out": f_out.read()[-4000:],
                "err": f_err.read()[-4000:]}


if __name__ == "__main__":
    request = json.load(sys.stdin)
    results = {key: measure(key, argv, request["folder"], request["timeout"])
               for key, argv in request["runs"]}
    print(json.dumps(results))
