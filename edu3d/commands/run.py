"""``edu3d run``: a script or module on N ranks, through torchrun.

After reading this file you should understand what ``edu3d run -n 4 script.py`` adds to a
bare ``torchrun``: output prefixed by rank, the first failing rank ending the run with its
traceback (exit code 1), a timeout (124) and Ctrl-C (130) that kill every rank. torchrun's
multi-node options (``--nnodes``, ``--node-rank``, ``--rdzv-endpoint`` ...) pass through
unchanged, so the same script runs across machines. Nothing here imports torch: ``edu3d run``
costs what a bare torchrun costs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edu3d.commands.argtypes import ranks, seconds
from edu3d.launch.api import LaunchError, LaunchTimeout, launch

HELP = "run a script or module on N ranks"
# torchrun options edu3d run forwards unchanged (multi-node and rendezvous)
PASSTHROUGH = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id",
               "--rdzv-conf", "--master-addr", "--master-port", "--local-addr")


def _dest(option: str) -> str:
    return "tr_" + option[2:].replace("-", "_")


def add_subcommand(sub) -> None:
    """Register ``run`` on ``edu3d``'s subcommands."""
    p = sub.add_parser("run", help=HELP,
                       description="Run a script (or -m module) on N ranks through torchrun. "
                                   "Output is prefixed by rank; the first failing rank ends "
                                   "the run with its traceback and exit code 1.")
    p.add_argument("-n", "--nprocs", type=ranks, default=2,
                   help="ranks on this node (default: %(default)s)")
    p.add_argument("--timeout", type=seconds("600"), default=None,
                   help="kill the run after this many seconds (default: no limit)")
    p.add_argument("-m", "--module", action="store_true", help="TARGET is a module name")
    for opt in PASSTHROUGH:
        p.add_argument(opt, dest=_dest(opt), default=None,
                       help=argparse.SUPPRESS if opt in ("--rdzv-conf", "--local-addr") else
                       f"passed to torchrun as {opt}")
    p.add_argument("target", help="script path, or module name with -m")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=main_from_args)


def main_from_args(args) -> int:
    """Launch, and turn the launcher's errors into exit codes (1 failed, 124, 130)."""
    given = vars(args)
    torchrun_args = [f"{opt}={given[_dest(opt)]}" for opt in PASSTHROUGH
                     if given[_dest(opt)] is not None]
    try:
        launch(args.target, args.nprocs, args=args.args, module=args.module,
               timeout=args.timeout, torchrun_args=torchrun_args, name=Path(args.target).stem)
    except LaunchTimeout as err:
        print(f"edu3d run: {err}", file=sys.stderr)
        return 124
    except LaunchError as err:
        print(f"edu3d run: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("edu3d run: interrupted; every rank was killed", file=sys.stderr)
        return 130
    return 0
