"""``edu3d schedule``: print a pipeline schedule as PyTorch actions, a table or JSON.

::

    edu3d schedule --name 1f1b --pp 4 --microbatches 8                  # torch notation
    edu3d schedule --name interleaved --pp 4 --vpp 2 --microbatches 8 --format table
    edu3d schedule --name zb-h1 --pp 4 --microbatches 8 --format json
    edu3d schedule --name dualpipev --pp 4 --microbatches 8 --format table  # two chunks, a V

``--format torch`` prints one line per rank, ``rank R: 0F0 0SEND_F0 ...``; ``table`` puts the
compute actions on a grid of unit time slots (every action one slot, ``.`` = idle), with the
checked peak of in-flight micro-batches and the bubble (simulated with ``F=1, B=2``) next to
the formula; ``json`` gives the same as data.
"""

from __future__ import annotations

import argparse
import json
import sys

from edu3d.commands.argtypes import integer

POSITIVE = "a positive integer (1, 2, 3 ...)"
from edu3d.schedules.check import ScheduleError, check
from edu3d.schedules.actions import (SCHEDULES, V_SHAPED, build, chunks, format_torch,
                                     placement)
from edu3d.schedules.simulate import Costs, bubble_formula, simulate

# --help is plain text: the module docstring's markup (``...``, ::) stays out of it
DESCRIPTION = "Print a pipeline schedule as PyTorch actions, a table or JSON."
EPILOG = """examples:
  edu3d schedule --name 1f1b --pp 4 --microbatches 8
  edu3d schedule --name interleaved --pp 4 --vpp 2 --microbatches 8 --format table
  edu3d schedule --name zb-h1 --pp 4 --microbatches 8 --format json
  edu3d schedule --name dualpipev --pp 4 --microbatches 8 --format table

zbv and dualpipev put two chunks on each rank as a V (rank r: stages r and 2p-1-r).
torch: one line per rank, "rank R: 0F0 0SEND_F0 ..." (stage, action, micro-batch).
table: compute actions on unit time slots ("." = idle), with the peak of in-flight
       micro-batches and the bubble (simulated with F=1, B=2) next to the formula.
json:  the same as data."""
TEXTS = {"description": DESCRIPTION, "epilog": EPILOG,
         "formatter_class": argparse.RawDescriptionHelpFormatter}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--name", required=True, choices=SCHEDULES, help="schedule")
    parser.add_argument("--pp", type=integer(1, POSITIVE, 32), required=True,
                        help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=integer(1, POSITIVE, 128), required=True,
                        help="micro-batches per step")
    parser.add_argument("--vpp", type=integer(1, POSITIVE, 4), default=1,
                        help="chunks per rank, interleaved only (default: %(default)s)")
    parser.add_argument("--format", choices=("torch", "table", "json"), default="torch",
                        help="output (default: %(default)s)")
    return parser



def add_subcommand(subparsers) -> argparse.ArgumentParser:
    """Register ``schedule`` on an ``argparse`` subparsers object (``edu3d``'s CLI)."""
    p = subparsers.add_parser("schedule", help="print a pipeline schedule", **TEXTS)
    add_arguments(p)
    p.set_defaults(func=_run)
    return p


def table(actions, pp: int) -> str:
    """Compute actions on unit time slots: what each rank does at each tick."""
    timeline = simulate(actions, pp, Costs(F=1, B=1, I=1, W=1))
    ticks = int(round(timeline.makespan))
    grid = [["."] * ticks for _ in range(pp)]
    for ev in timeline.events:
        if ev["lane"] == "compute":
            grid[ev["rank"]][int(round(ev["t0"]))] = f"{ev['stage']}{ev['op']}{ev['mb']}"
    width = max(len(c) for row in grid for c in row)
    return "\n".join(f"rank {r}: " + " ".join(c.rjust(width) for c in row)
                     for r, row in enumerate(grid))


def summary(name: str, pp: int, m: int, vpp: int = 1) -> dict:
    """Everything ``edu3d schedule`` knows about one schedule, as data."""
    v = chunks(name, vpp)
    actions = build(name, pp, m, vpp)
    report = check(actions, pp, m, v, placement(name))
    sim = simulate(actions, pp, Costs(F=1, B=2, I=1, W=1))
    return {"name": name, "pp": pp, "vpp": v, "microbatches": m,
            "actions": [[str(a) for a in ops] for ops in actions],
            "peak_in_flight": report.peak_in_flight,
            "bubble_simulated": sim.bubble,
            "bubble_formula": bubble_formula(name, pp, m, v)}


def _run(args) -> int:
    if args.vpp > 1 and args.name != "interleaved":
        print(f"--vpp {args.vpp} only applies to --name interleaved", file=sys.stderr)
        return 2
    try:
        info = summary(args.name, args.pp, args.microbatches, args.vpp)
    except (ValueError, ScheduleError) as err:
        print(f"edu3d schedule: {err}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(info))
    elif args.format == "torch":
        print(format_torch(build(args.name, args.pp, args.microbatches, args.vpp)))
    else:
        actions = build(args.name, args.pp, args.microbatches, args.vpp)
        print(table(actions, args.pp))
        print(f"peak in-flight micro-batches per rank: {info['peak_in_flight']}")
        shape = "(p-1)/(6m+p-1), F=I=W" if args.name in V_SHAPED else "(p-1)/(v*m+p-1)"
        print(f"bubble (simulated, F=1 B=2): {info['bubble_simulated']:.3f}   formula "
              f"{shape}: {info['bubble_formula']:.3f}")
    return 0


def schedule_main(argv: list[str] | None = None) -> int:
    """``edu3d schedule ...`` as a function (returns the exit code)."""
    parser = add_arguments(argparse.ArgumentParser(prog="edu3d schedule", **TEXTS))
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(schedule_main())
