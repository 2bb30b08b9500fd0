"""A live view of a run: every rank's status record, gathered into one table twice a second.

After reading this file you should understand how ``edu3d train --monitor``, ``edu3d top RUN``
and the notebook's live table see all the ranks of a run at once, and why watching costs the
ranks nothing when nobody watches:

* each rank of ``edu3d train`` keeps a small **status record**, ``status/rank{R}.json`` in
  its run folder (:mod:`edu3d.train.publish`): its coordinates, the step it reached, the mean
  step time and tokens/s since its last record, the milliseconds per step it spent in each
  group's collectives (from the trace), and its memory (CUDA's allocator on a GPU, the
  tensors it holds on a CPU). Each record overwrites the last in place behind a sequence
  lock, so a reader never takes half a record (:class:`StatusFile`), and a reader keeps only
  a record of the right shape (:data:`edu3d.launch.run_files.STATUS`): whatever else is
  written there, by a watcher or any other process, shows as no record and crashes nothing;
* a rank publishes **only while someone watches**: a watcher touches ``status/watching`` at
  every refresh (:func:`touch_watch`); a rank looks at that file's age at most every
  :data:`PUBLISH_S` seconds, one ``stat`` and no write while it is absent or stale. Whatever
  happens, each rank writes one record at the end, its whole run's averages, so ``edu3d top``
  on a finished run prints its last table;
* **the slowest rank** is not the one with the longest step: the ranks of a synchronous run
  wait for each other in their collectives, so they all take about as long. The straggler is
  the rank that computes longest, the one *least* in communication, while the others wait for
  it (:func:`busy_ms`: step time minus communication time; :func:`slowest`);
* a rank whose record is older than :data:`STALE_S` is shown doing what its flight record
  says (``waits in all_reduce(dp) at step 7``, :func:`edu3d.launch.runs.describe`).

:class:`Terminal` draws the table: redrawn in place with ANSI codes on a terminal, one line
per refresh with new numbers otherwise (a log file, a test), the full table at the end.
Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
import time
from pathlib import Path

from edu3d.launch import procs, runs
from edu3d.launch import run_files as files

PUBLISH_S = 0.25  # a rank looks for a watcher (and publishes) at most this often
REFRESH_S = 0.5  # a watcher reads the records this often
WATCH_S = 5.0  # a watch file older than this means nobody watches any more
STALE_S = 2.0  # a record older than this: show what the flight record says instead
AXES = ("dp", "cp", "dpcp", "tp", "pp", "ep", "edp", "world")  # column order of the shares
MIB = 2 ** 20
MAX_RANKS = 1 << 14  # the most rows a run folder may ask for (its command.json is anyone's)
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # an escape sequence takes no column


# ---- the files ------------------------------------------------------------------------------
def status_file(run_dir: Path, rank: int) -> Path:
    return files.path(run_dir, "status", rank)


def watch_file(run_dir: Path) -> Path:
    return Path(run_dir) / files.WATCHING


def touch_watch(run_dir: Path) -> None:
    """Say "someone watches" to the ranks of ``run_dir`` for the next :data:`WATCH_S` (if the
    folder lets us: watching is no reason to fail)."""
    path = watch_file(run_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        pass


def watched(run_dir: Path) -> bool:
    """True while a watcher touched the watch file less than :data:`WATCH_S` ago (one stat)."""
    try:
        return time.time() - watch_file(run_dir).stat().st_mtime < WATCH_S
    except OSError:
        return False


class StatusFile:
    """One rank's status record, rewritten in place with ``pwrite`` (as the flight record,
    :class:`edu3d.distributed.trace.Flight`), so a record costs a copy into the page cache,
    not a file system's rename (which on ext4 waits for the data to reach the disk:
    milliseconds). Not through a memory map: another process that shrinks the file
    (``truncate -s 0``) would kill the rank with SIGBUS at its next record.

    A reader must never take half of one record and half of the next for a record. The
    header is a **sequence lock**: the writer makes the counter odd, writes the record, makes
    it even again; a reader keeps what it read only if the counter was even and unchanged
    around its read (:func:`read_status`). Layout: counter (8 bytes), length (4), JSON."""

    SIZE = 4096

    def __init__(self, path: Path):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:  # a file of our own, over whatever another process put at its name
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.unlink(missing_ok=True)
            self._fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            os.replace(tmp, path)
        except OSError:  # (a folder there): no records; a monitor is no reason to fail
            self._fd = -1
        self.seq = 0

    def write(self, record: dict) -> None:
        data = json.dumps(record).encode()[: self.SIZE - 12]
        if self._fd < 0:
            return
        self.seq += 2
        try:
            os.pwrite(self._fd, (self.seq - 1).to_bytes(8, "little"), 0)  # odd: under way
            os.pwrite(self._fd, len(data).to_bytes(4, "little") + data, 8)
            os.pwrite(self._fd, self.seq.to_bytes(8, "little"), 0)  # even: the record is whole
        except OSError:  # a full disk: the monitor shows the last record
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_status(path: Path, shape: dict | None = None, tries: int = 3) -> dict | None:
    """The record in a :class:`StatusFile`, or None: none yet, a write kept racing us, or
    not a JSON object (of ``shape`` if given, :data:`edu3d.launch.run_files.STATUS`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        for _ in range(tries):
            raw = os.pread(fd, StatusFile.SIZE, 0)
            again = os.pread(fd, 8, 0)
            seq = int.from_bytes(raw[:8], "little")
            if len(raw) >= 12 and seq % 2 == 0 and raw[:8] == again:
                size = int.from_bytes(raw[8:12], "little")
                return files.parse(raw[12:12 + size], shape, ("rank", "t") if shape else ())
    except OSError:
        pass
    finally:
        os.close(fd)
    return None


def ranks_of(run_dir: Path) -> int:
    """How many ranks the run has: ``command.json``'s count, else the highest rank that left
    a status, flight or pid file, plus one."""
    run_dir = Path(run_dir)
    nprocs = runs.command(run_dir).get("nprocs")
    if nprocs is not None and 0 < nprocs <= MAX_RANKS:
        return nprocs
    seen = [r for kind in ("status", "flight", "pids") for r in files.ranks(run_dir, kind)]
    return min(max(seen) + 1, MAX_RANKS) if seen else 0


def finished(run_dir: Path, nprocs: int) -> bool:
    """True when every rank is done (its marker, or a final record), a rank failed, or none
    of the run's processes is alive any more."""
    run_dir = Path(run_dir)
    if len(files.ranks(run_dir, "done")) >= nprocs > 0:
        return True
    if files.ranks(run_dir, "errors"):
        return True
    records = read(run_dir, nprocs)
    if records and all(r.get("done") for r in records) and len(records) == nprocs:
        return True
    rid, pids = runs.run_id(run_dir), files.pid_files(run_dir)
    return bool(rid and pids) and not any(runs.belongs_to(p, rid) for p in pids.values())


# ---- reading --------------------------------------------------------------------------------
def read(run_dir: Path, nprocs: int | None = None) -> list[dict]:
    """Every rank's latest status record, in rank order, with ``age_s`` (seconds since it was
    written) and ``state``: ``done``, ``failed``, ``running``, or the flight record in words
    when the record is stale (:data:`STALE_S`)."""
    run_dir = Path(run_dir)
    nprocs = ranks_of(run_dir) if nprocs is None else nprocs
    failed = files.ranks(run_dir, "errors")
    out = []
    for r in range(nprocs):
        rec = read_status(status_file(run_dir, r), files.STATUS)
        if rec is None or rec["rank"] != r:
            continue
        rec["age_s"] = max(time.time() - rec["t"], 0.0)
        if r in failed:
            rec["state"] = "failed"
        elif rec.get("done"):
            rec["state"] = "done"
        elif rec["age_s"] > STALE_S:
            rec["state"] = runs.describe(runs.read_flight(run_dir, r))
        else:
            rec["state"] = "running"
        out.append(rec)
    return out


def comm_total_ms(rec: dict) -> float:
    return sum(rec.get("comm_ms", {}).values())


def busy_ms(rec: dict) -> float:
    """Milliseconds per step outside communication: what the rank itself took."""
    return rec.get("step_ms", 0.0) - comm_total_ms(rec)


def slowest(records: list[dict]) -> int | None:
    """The straggler's rank: the most time outside communication (the others wait for it in
    theirs); the longest step when no rank timed its communication. None for one rank."""
    if len(records) < 2:
        return None
    timed = any(r.get("comm_ms") for r in records)
    return max(records, key=busy_ms if timed else (lambda r: r.get("step_ms", 0.0)))["rank"]


def axes(records: list[dict]) -> list[str]:
    """The groups any rank communicated in, in :data:`AXES` order."""
    seen = {g for r in records for g in r.get("comm_ms", {})}
    return [a for a in AXES if a in seen] + sorted(seen - set(AXES))


def memory_text(rec: dict) -> str:
    mem = rec.get("memory") or {}
    if mem.get("kind") == "cuda" and "allocated" in mem and "reserved" in mem:
        return f"{mem['allocated'] / MIB:.0f}/{mem['reserved'] / MIB:.0f}"
    return "-" if mem.get("bytes") is None else f"{mem['bytes'] / MIB:.2f}"


def rows(records: list[dict]) -> tuple[list[str], list[list[str]], int | None]:
    """The table as text cells: ``(header, rows, slowest rank)``; a GPU column appears only
    when some rank reports its utilisation."""
    groups = axes(records)
    cuda = any((r.get("memory") or {}).get("kind") == "cuda" for r in records)
    util = any("gpu_util" in r for r in records)
    header = ["rank", "(pp,dp,tp)", "step", "step ms", "busy ms", "tokens/s",
              *[f"{g} comm" for g in groups],
              "MiB alloc/resv" if cuda else "MiB tensors", *(["GPU %"] if util else []), "state"]
    slow = slowest(records)
    out = []
    for r in records:
        c = r.get("coords", {})
        step_ms = r.get("step_ms", 0.0)
        shares = [f"{100 * r['comm_ms'][g] / step_ms:.0f}%" if g in r.get("comm_ms", {})
                  and step_ms else "-" for g in groups]
        out.append([("*" if r["rank"] == slow else "") + str(r["rank"]),
                    f"({c.get('pp', 0)},{c.get('dp', 0)},{c.get('tp', 0)})",
                    f"{r.get('step', 0)}/{r.get('steps', '?')}", f"{step_ms:.1f}",
                    f"{busy_ms(r):.1f}", f"{r.get('tokens_per_s', 0.0):,.0f}", *shares,
                    memory_text(r), *([str(r.get("gpu_util", "-"))] if util else []),
                    r.get("state", "")])
    return header, out, slow


def render(records: list[dict], title: str = "", ansi: bool = False) -> str:
    """The table as lines of text; the slowest rank marked ``*`` (and in reverse video with
    ``ansi``), a legend under it."""
    if not records:
        return (f"{title}\n" if title else "") + "no status records yet (the ranks publish " \
                                                 "after their first steps)"
    header, body, slow = rows(records)
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = [title] if title else []
    for i, cells in enumerate([header, *body]):
        text = "  ".join(x.rjust(w) for x, w in zip(cells, widths))
        if ansi and i and body[i - 1][0].startswith("*"):
            text = f"\x1b[1;7m{text}\x1b[0m"
        lines.append(text)
    cuda = any((r.get("memory") or {}).get("kind") == "cuda" for r in records)
    lines.append("memory: CUDA allocated/reserved" if cuda else
                 "memory: CPU: tracked tensors (params, grads, optimizer, peak activations)")
    lines.append("busy = step - communication" + (
        f"; * rank {slow}: the slowest, the others wait for it" if slow is not None else ""))
    return "\n".join(lines)


def one_line(records: list[dict], elapsed: float) -> str:
    """One refresh as one line (no terminal to redraw on)."""
    slow = slowest(records)
    parts = [f"r{r['rank']}{'*' if r['rank'] == slow else ''} step {r.get('step', 0)} "
             f"{r.get('step_ms', 0.0):.0f} ms busy {busy_ms(r):.0f} ms "
             f"{r.get('tokens_per_s', 0.0):,.0f} tok/s" for r in records]
    return f"[monitor {elapsed:5.1f} s] " + " | ".join(parts) + (
        f"  (* slowest: rank {slow})" if slow is not None else "")


# ---- the terminal view ----------------------------------------------------------------------
class Terminal:
    """The live table of the run in ``run_dir`` on ``out`` (default stderr).
    :meth:`launch_options` hands ``launch`` its run folder, an ``echo`` that keeps the table
    under the ranks' lines, and an ``on_poll`` that refreshes it every :data:`REFRESH_S`."""

    def __init__(self, run_dir: Path, nprocs: int, out=None, watch: bool = True):
        self.run_dir, self.nprocs = Path(run_dir), nprocs
        self.out = out or sys.stderr
        self.ansi = bool(getattr(self.out, "isatty", lambda: False)())
        self.watch, self.drawn, self.last, self.key = watch, 0, 0.0, None
        self.start = time.monotonic()
        self.refreshes = 0
        if watch:
            touch_watch(self.run_dir)  # before the ranks start: they publish from step 1

    def launch_options(self, echo) -> dict:
        """``launch(..., **view.launch_options(echo))``."""
        show = procs.print_line if echo is True else (echo or (lambda *a: None))

        def echo_above(rank, stream, line):
            self.erase()
            show(rank, stream, line)
        return {"run_dir": self.run_dir, "echo": echo_above, "on_poll": self.poll}

    def poll(self, elapsed: float | None = None, done: int | None = None) -> None:
        if time.monotonic() - self.last >= REFRESH_S:
            self.refresh()

    def erase(self) -> None:
        if self.ansi and self.drawn:
            self.out.write(f"\x1b[{self.drawn}F\x1b[J")
            self.out.flush()
            self.drawn = 0

    def title(self) -> str:
        return (f"edu3d monitor: {self.run_dir.name}, {self.nprocs} ranks, at "
                f"{time.strftime('%H:%M:%S')}")

    def refresh(self) -> list[dict]:
        """Read the records and show them: redrawn, or one line if they changed."""
        self.last = time.monotonic()
        if self.watch:
            touch_watch(self.run_dir)
        records = read(self.run_dir, self.nprocs)
        self.refreshes += 1
        if self.ansi:
            self.erase()
            text = render(records, self.title(), ansi=True)
            self.out.write(text + "\n")
            cols = max(shutil.get_terminal_size().columns, 20)  # a long line wraps
            self.drawn = sum(max(1, -(-len(ANSI.sub("", x)) // cols)) for x in text.split("\n"))
        else:
            key = [(r["rank"], r.get("step"), r.get("t")) for r in records]
            if records and key != self.key:
                self.key = key
                self.out.write(one_line(records, time.monotonic() - self.start) + "\n")
        self.out.flush()
        return records

    def close(self) -> list[dict]:
        """The final table, in full (whatever the output is)."""
        self.erase()
        records = read(self.run_dir, self.nprocs)
        self.out.write(render(records, self.title(), ansi=self.ansi) + "\n")
        self.out.flush()
        return records

    def follow(self, once: bool = False) -> list[dict]:
        """``edu3d top``: refresh until the run is over (or once), then the final table."""
        while not once and not finished(self.run_dir, self.nprocs):
            self.refresh()
            time.sleep(REFRESH_S)
        return self.close()
