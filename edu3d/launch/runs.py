"""Run folders: where every launched run leaves its output, and how they are kept tidy.

After reading this file you should understand what a run folder holds and its life cycle:

* each run gets a fresh folder under ``$EDU3D_RUNS`` (default ``./runs``), named
  ``YYYYmmdd-HHMMSS-<name>-<id>``: ``command.json``, the ranks' ``pids/``, ``errors/``,
  ``exits/``, ``done/`` markers, ``flight/`` (what each rank is doing now),
  ``trace-rank{R}.jsonl`` and ``results/`` (and ``shared/``, with several nodes: which
  failures the other nodes have), each file as :mod:`edu3d.launch.run_files` names it;
* the files that describe *a* run's state (pids, errors, exits, done, flight) are cleared when
  a folder is reused, so a new run is never judged by an old run's error;
* only the newest ``$EDU3D_KEEP_RUNS`` folders (default 50) are kept; ``edu3d runs list`` and
  ``edu3d runs clean`` show and remove them by hand. A run folder is one edu3d created: it
  holds the marker :data:`MARKER`, written when the folder is made. A folder that merely holds
  a ``command.json`` is never listed, pruned or removed, and neither is the folder of a run
  that is still running (:func:`live`), whatever its age;
* the launcher trusts what it reads there (``results/*.pkl`` are unpickled), so the runs
  folder must be the user's own and not writable by every user (unless it has the sticky
  bit, as ``/tmp``): anything else is refused in one line (:func:`check_private`);
* the records there (pids, errors, exits, flight) are read as anyone's, bounded and checked
  against their shape (:mod:`edu3d.launch.run_files`): a watcher's or a careless script's
  writes there are no record, and crash nothing;
* with several nodes a node's folder holds only its own ranks' records, one block of global
  ranks (:func:`ranks_here`).

Nothing here imports torch.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import sys
import time
import uuid
from pathlib import Path

from edu3d.launch import run_files as files
from edu3d.launch.run_files import STATE_DIRS, pid_files

DEFAULT_KEEP = 50
MARKER = ".edu3d-run"  # written into every run folder edu3d creates, and only there


class RunsError(RuntimeError):
    """The runs folder cannot be used (the message says which path and how to choose another)."""


def base() -> Path:
    """The folder that holds run folders: ``$EDU3D_RUNS``, else ``./runs``."""
    return Path(os.environ.get("EDU3D_RUNS") or "runs")


def _usable(path: Path) -> Path:
    """``path`` created if needed, or a one-line :class:`RunsError` saying what is wrong."""
    hint = "set EDU3D_RUNS to a writable folder, e.g. EDU3D_RUNS=/tmp/edu3d-runs"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunsError(f"run folder base {path} is a file, not a folder; {hint}") from None
    except OSError as err:
        raise RunsError(f"cannot create run folder base {path} ({err.strerror}); {hint}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise RunsError(f"run folder base {path} is not writable; {hint}")
    return path


def check_private(path: Path, what: str = "run folder base") -> None:
    """Refuse (:class:`RunsError`, one line) a folder of another user, or one every user may
    write to without the sticky bit: another user could plant the pickles the launcher
    loads, or swap a run's folder."""
    st = path.stat()
    fix = "set EDU3D_RUNS to a folder of your own, e.g. EDU3D_RUNS=$HOME/edu3d-runs"
    if st.st_uid != os.getuid():
        raise RunsError(f"{what} {path} belongs to user id {st.st_uid}, not to you "
                        f"({os.getuid()}): edu3d loads the pickles its ranks leave there; {fix}")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise RunsError(f"{what} {path} is writable by every user (mode "
                        f"{stat.S_IMODE(st.st_mode):o}, no sticky bit): edu3d loads the pickles "
                        f"its ranks leave there; chmod o-w {path}, or {fix}")


def new_run_dir(name: str = "run", create: bool = True) -> Path:
    """A fresh folder under :func:`base` for one run's files (older ones beyond
    ``$EDU3D_KEEP_RUNS`` are removed when it is created)."""
    root = base()
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)[:40]
    path = (root / f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}-{uuid.uuid4().hex[:6]}").resolve()
    if create:
        prepare(path)
    return path


def prepare(path: Path) -> None:
    """Create ``path`` (checked; marked as edu3d's when this call creates it) and clear any
    state an earlier run left in it. Under the runs folder both must be private
    (:func:`check_private`)."""
    _usable(path.parent)
    in_base = path.parent.resolve() == base().resolve()
    if in_base:
        check_private(path.parent)
    try:
        path.mkdir()
        created = True
    except FileExistsError:
        created = False
    except OSError as err:
        raise RunsError(f"cannot create run folder {path} ({err.strerror}); choose another "
                        "run_dir, or set EDU3D_RUNS to a writable folder") from None
    if not path.is_dir():
        raise RunsError(f"run folder {path} is not a folder; choose another run_dir")
    check_private(path, "run folder")
    if created:
        (path / MARKER).write_text("made by edu3d's launcher: `edu3d runs clean` may remove "
                                   "this folder\n")
    for sub in STATE_DIRS:
        shutil.rmtree(path / sub, ignore_errors=True)
    for old in path.glob(files.TRACE_FILE.format("*")):
        old.unlink(missing_ok=True)
    if in_base:
        prune(keep_runs(), protect=path)


def keep_runs() -> int:
    """How many run folders to keep: ``$EDU3D_KEEP_RUNS`` (0 keeps all), default 50."""
    text = os.environ.get("EDU3D_KEEP_RUNS", str(DEFAULT_KEEP))
    try:
        value = int(text)
    except ValueError:
        raise RunsError(f"EDU3D_KEEP_RUNS={text!r} is not a whole number "
                        "(how many run folders to keep; 0 keeps all)") from None
    if value < 0:
        raise RunsError(f"EDU3D_KEEP_RUNS={value} must be 0 (keep all) or more")
    return value


def list_runs(root: Path | None = None) -> list[Path]:
    """Run folders under ``root`` (folders edu3d made: they hold :data:`MARKER`; never a
    link), oldest first by their last run's ``command.json``."""
    root = root or base()
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        try:  # another process may prune a folder between listing and reading it
            if not is_run_folder(p):
                continue
            stamp = p / files.COMMAND_FILE if (p / files.COMMAND_FILE).exists() else p / MARKER
            found.append((stamp.stat().st_mtime, p.name, p))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return [p for _, _, p in sorted(found)]


def is_run_folder(path: Path) -> bool:
    """True for a folder edu3d made (it holds :data:`MARKER`), never a link: the only kind
    edu3d lists, prunes, removes, or writes into when it did not start the run."""
    return not path.is_symlink() and (path / MARKER).is_file()


def live(paths: list[Path]) -> set[Path]:
    """The run folders among ``paths`` that a running process still uses: one named by a
    process's environment (``EDU3D_RUN_DIR``: torchrun's agent and the ranks of a fresh
    launch), or one whose pid files name a rank that is the run's (:func:`belongs_to`) and has
    not written its ``done/`` marker (a warm pool's ranks outlive their jobs). The launching
    process carries neither: in the moments before torchrun starts and after it has ended
    (reading the results) a run's folder is not seen as live."""
    if not paths:
        return set()
    used = set()
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        try:
            env = (entry / "environ").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        used |= {v[len(b"EDU3D_RUN_DIR="):] for v in env if v.startswith(b"EDU3D_RUN_DIR=")}
    out = set()
    for path in paths:
        rid = run_id(path)
        if os.fsencode(str(path.resolve())) in used or any(
                not files.path(path, "done", rank).exists() and belongs_to(pid, rid)
                for rank, pid in pid_files(path).items()):
            out.add(path)
    return out


def prune(keep: int, root: Path | None = None, protect: Path | None = None) -> list[Path]:
    """Remove all but the newest ``keep`` run folders (0 keeps all), never a :func:`live`
    one; returns what was removed."""
    if keep <= 0:
        return []
    runs = [p for p in list_runs(root) if protect is None or p.resolve() != protect.resolve()]
    doomed = runs[:max(len(runs) - (keep - (protect is not None)), 0)]
    running = live(doomed)
    doomed = [p for p in doomed if p not in running]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


# ---- what the ranks left: pids, errors, exits, flight -----------------------------------------
def ranks_here(run_dir: Path, nprocs: int) -> list[int]:
    """The global ranks of this node's ``nprocs``: ``0..nprocs-1`` on one node; with several
    nodes, the block of ``nprocs`` that holds the ranks whose pid files are here (torchrun
    numbers a node's ranks in one block, ``node * nprocs + local rank``)."""
    pids = pid_files(run_dir)
    first = min(pids) // nprocs * nprocs if pids and nprocs > 0 else 0
    return list(range(first, first + nprocs))


def command(run_dir: Path) -> dict:
    """``command.json``'s ``nprocs`` and ``run_id``, those that are well formed."""
    return files.read_record(run_dir / files.COMMAND_FILE, files.COMMAND) or {}


def run_id(run_dir: Path) -> str | None:
    return command(run_dir).get("run_id")


def alive(pid: int) -> bool:
    """True if process ``pid`` exists (a zombie too: see :func:`edu3d.launch.procs.running`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def belongs_to(pid: int, rid: str | None) -> bool:
    """True only if process ``pid`` verifiably belongs to run ``rid``: its environment carries
    ``EDU3D_RUN_ID=rid``. Pids are recycled, so a pid file alone proves nothing."""
    if not rid:
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"EDU3D_RUN_ID={rid}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def signal_ranks(run_dir: Path, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each rank's process group (each rank leads a session of its own),
    after checking that the process is the run's; anything else is left alone."""
    rid = run_id(run_dir)
    for pid in pid_files(run_dir).values():
        if not belongs_to(pid, rid):
            continue
        try:
            os.killpg(pid, sig) if os.getpgid(pid) == pid else os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _read_all(run_dir: Path, kind: str, shape: dict, required: tuple) -> list[dict]:
    """The well-formed records of the run's files of ``kind`` (``errors``, ``exits``), each
    of its own rank."""
    out = []
    for rank in files.ranks(run_dir, kind):
        rec = files.read_record(files.path(run_dir, kind, rank), shape, ("rank", *required),
                                8 * files.SMALL)
        if rec is not None and rec["rank"] == rank:
            out.append(rec)
    return out


# a rank whose partner vanished fails with one of these: a consequence, never the cause
_PEER_LOST = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused|"
                        r"ECONNRESET|EPIPE|connection closed|peer .*(?:closed|gone)", re.I)
# a rank's error that says a collective timed out: its report adds what every rank was doing
TIMED_OUT = re.compile(r"time[ds]? ?out", re.I)


def how(exit_: dict) -> str:
    if "signal" in exit_:
        try:
            return f"killed by signal {signal.Signals(exit_['signal']).name}"
        except ValueError:
            return f"killed by signal {exit_['signal']}"
    return f"exited with code {exit_['code']}"


def failures(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """``(causes, consequences)``, each sorted by time. A cause is a Python error that is not
    a lost connection, or a rank that ended without a Python error (``os._exit``, a signal):
    ``{"rank", "time_ns", "message", "traceback"?}``. Deaths from the agent's own teardown
    (SIGTERM after ``exits/teardown``) are not causes. A death is recorded by a thread of the
    agent and may be stamped a little after the agent noticed it (and began its teardown), so
    a SIGKILL or a crash always counts, whatever its time."""
    errors = _read_all(run_dir, "errors", files.ERROR, ("type", "message", "time_ns"))
    erred = {e["rank"] for e in errors}
    teardown = (files.read_record(run_dir / files.TEARDOWN, {"time_ns": int},
                                  ("time_ns",)) or {}).get("time_ns")
    causes, consequences = [], []
    for e in errors:
        e = {**e, "message": f"{e['type']}: {e['message']}"}
        lost = _PEER_LOST.search(e["message"]) or _PEER_LOST.search(e.get("traceback", ""))
        (consequences if lost else causes).append(e)
    for x in _read_all(run_dir, "exits", files.EXIT, ("time_ns",)):
        if x["rank"] in erred or x.get("code") == 0 or ("code" not in x and "signal" not in x):
            continue
        if teardown is not None and x["time_ns"] >= teardown and x.get("signal") == signal.SIGTERM:
            continue  # torchrun stops the others with SIGTERM (SIGKILL only 30 s later)
        causes.append({"rank": x["rank"], "time_ns": x["time_ns"], "message": how(x)})
    return (sorted(causes, key=lambda e: e["time_ns"]),
            sorted(consequences, key=lambda e: e["time_ns"]))


def describe(rec: dict | None) -> str:
    """``waits in all_reduce(dp) at step 3``: one rank's flight record in words."""
    if rec is None:
        return "recorded no operation"
    what = rec["op"] + (f"({rec['group']})" if rec.get("group") else "")
    verb = {"in": "waits in" if rec.get("lane", "comm") == "comm" else "is in",
            "failed": "failed in"}.get(rec["state"], "last finished")
    where = "".join(f" {k} {rec[k]}" for k in ("step", "mb") if k in rec)
    return f"{verb} {what}{' at' + where if where else ''}"


def read_flight(run_dir: Path, rank: int) -> dict | None:
    """A rank's flight record (:class:`edu3d.distributed.trace.Flight`), or None before its
    first note (or when the file holds anything but such a record)."""
    data = files.read_small(files.path(run_dir, "flight", rank), 4096)
    return files.parse((data or b"").strip(b" \0"), files.FLIGHT, ("state", "op"))


SILENT_S = 2.0  # a flight record that beat longer ago than this: its rank is stopped or stuck


def silent_for(rec: dict | None, now: float | None = None) -> float | None:
    """Seconds since the rank's flight record last beat, when that is over :data:`SILENT_S`
    (a rank beats four times a second while its recorder is open); else None."""
    if rec is None or "beat" not in rec:
        return None
    quiet = (time.time() if now is None else now) - rec["beat"]
    return quiet if quiet > SILENT_S else None


def flight_report(run_dir: Path, nprocs: int) -> str:
    """What every rank of this node was doing, from its flight record:
    ``rank 0 waits in all_reduce(dp) at step 3; rank 1 waits in broadcast(tp) at step 3``,
    and ``(silent for 12.0 s: stopped or stuck)`` after a rank that stopped beating."""
    parts = []
    for r in ranks_here(run_dir, nprocs):
        rec = read_flight(run_dir, r)
        quiet = silent_for(rec)
        parts.append(f"rank {r} {describe(rec)}" + (
            f" (silent for {quiet:.1f} s: stopped or stuck)" if quiet is not None else ""))
    return "; ".join(parts)


def size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(action: str, keep: int = 0) -> int:
    """``edu3d runs list`` / ``edu3d runs clean [--keep N]``."""
    if action == "list":
        found = list_runs()
        for path in found:
            print(f"{size_bytes(path) / 1e6:8.1f} MB  {path}")
        print(f"{len(found)} run folder(s) under {base().resolve()}")
        return 0
    if keep < 0:
        print(f"edu3d runs clean: --keep {keep}: must be 0 or more", file=sys.stderr)
        return 2
    if base().is_dir():
        try:
            check_private(base())
        except RunsError as err:
            print(f"edu3d runs clean: {err}", file=sys.stderr)
            return 2
    found = list_runs()
    doomed = found[:max(len(found) - keep, 0)]
    running = live(doomed)
    doomed = [p for p in doomed if p not in running]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    others = [p for p in base().iterdir() if p.is_dir() and p not in found] \
        if base().is_dir() else []
    print(f"removed {len(doomed)} run folder(s) under {base().resolve()}, kept "
          f"{len(found) - len(doomed)}" + (f"; left alone {len(others)} folder(s) edu3d did "
                                           f"not make (no {MARKER})" if others else ""))
    for path in sorted(running):
        print(f"kept {path.name}: its run is still running (remove it when it has ended)")
    return 0
