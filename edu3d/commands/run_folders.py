"""``edu3d runs list|clean``: the run folders launches leave behind.

After reading this file you should understand where runs go and how to tidy them: every
launch writes its results and traces to a folder under ``$EDU3D_RUNS`` (default
``./runs``, :mod:`edu3d.launch.runs`); ``list`` shows them, ``clean --keep N`` removes all
but the newest N, except the folder of a run that is still running, which it keeps and names
(:func:`edu3d.launch.runs.live`).
"""

from __future__ import annotations

from edu3d.commands.argtypes import MAX_COUNT, integer
from edu3d.launch import runs

HELP = "list or clean run folders ($EDU3D_RUNS, default ./runs)"


def add_subcommand(sub) -> None:
    """Register ``runs`` on ``edu3d``'s subcommands."""
    r = sub.add_parser("runs", help=HELP)
    r.add_argument("action", choices=("list", "clean"), help="list them, or remove them")
    r.add_argument("--keep", type=integer(0, "an integer >= 0", MAX_COUNT), default=0,
                   help="clean: keep the newest N (default 0); a running run's folder is "
                        "always kept")
    r.set_defaults(func=lambda args: runs.main(args.action, args.keep))
