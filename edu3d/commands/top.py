"""``edu3d top [RUN]``: watch a run's ranks live from a second terminal.

After reading this file you should understand how to look into a run you did not start with
``--monitor``: name it as ``edu3d runs list`` shows it (its folder, its folder's name, or any
unique part of the name such as the id at its end; no name: the newest run), and ``top``
shows the table ``edu3d train --monitor`` shows (:mod:`edu3d.launch.live`), refreshed twice a
second until the run ends, then its last table. On a finished run it prints that last
table at once. Its watching is what makes the ranks publish (they write nothing while
nobody watches), so the first numbers come a fraction of a second after it starts.

Watching writes one file into the run folder (``status/watching``), and ``top`` writes it
only into a folder edu3d made (it holds the run marker, :func:`edu3d.launch.runs.is_run_folder`):
any other folder it is pointed at is left as it was. A folder with neither the marker nor
status records is not a run, and is refused.

Exit codes: 0 shown, 2 no such run (or several match), 130 interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path

from edu3d.launch import live, runs

HELP = "watch a run's ranks live: step time, tokens/s, communication, memory"


def candidates() -> list[Path]:
    """Run folders, least recently changed first: those ``edu3d runs list`` shows, and the
    runs of a notebook's warm ranks (no ``command.json``) that left status records."""
    found = set(runs.list_runs()) | {p.parent for p in runs.base().glob("*/status")}
    return sorted(found, key=lambda p: p.stat().st_mtime)


def find_run(name: str | None) -> Path:
    """The run folder ``name`` means (see the module docstring); ``ValueError`` saying which
    runs there are when none or several match."""
    if name and Path(name).is_dir():
        return Path(name)
    found = candidates()
    if not found:
        raise ValueError(f"no run folders under {runs.base().resolve()} (set EDU3D_RUNS, or "
                         "give the run's folder)")
    if not name:
        return found[-1]
    matches = [p for p in found if p.name == name] or [p for p in found if name in p.name]
    if len(matches) == 1:
        return matches[0]
    newest = ", ".join(p.name for p in found[-3:])
    what = "no run matches" if not matches else f"{len(matches)} runs match"
    raise ValueError(f"{name!r}: {what} under {runs.base().resolve()}; name one of "
                     f"'edu3d runs list' (newest: {newest})")


def main(name: str | None = None, once: bool = False, out=None) -> int:
    try:
        run_dir = find_run(name)
    except ValueError as err:
        print(f"edu3d top: {err}", file=sys.stderr)
        return 2
    ours = runs.is_run_folder(run_dir)
    if not ours and not (run_dir / "status").is_dir():
        print(f"edu3d top: {run_dir} is not a run folder (no {runs.MARKER} and no status "
              "records); name one of 'edu3d runs list'", file=sys.stderr)
        return 2
    nprocs = live.ranks_of(run_dir)
    done = live.finished(run_dir, nprocs)
    view = live.Terminal(run_dir, nprocs, out or sys.stdout, watch=ours and not done)
    try:
        view.follow(once=once or done)
    except KeyboardInterrupt:
        return 130
    return 0


def add_subcommand(sub) -> None:
    """Register ``top`` on ``edu3d``'s subcommands."""
    p = sub.add_parser("top", help=HELP, description=HELP + ". RUN: a run folder, its name, "
                       "or a unique part of it, as 'edu3d runs list' shows (default: newest).")
    p.add_argument("run", nargs="?", default=None, help="the run (default: the newest)")
    p.add_argument("--once", action="store_true", help="print one table and stop")
    p.set_defaults(func=lambda args: main(args.run, args.once))
