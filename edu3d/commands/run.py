"""``edu3d run``: a script or module on N ranks, through torchrun.

After reading this file you should understand what ``edu3d run -n 4 script.py`` adds to a
bare ``torchrun``: output prefixed by rank, the first failing rank ending the run with its
traceback (exit code 1), a timeout (124) and Ctrl-C (130) that kill every rank. torchrun's
multi-node options (``--nnodes``, ``--node-rank``, ``--rdzv-endpoint`` ...) pass through
unchanged, so the same script runs across machines (:func:`add_node_arguments`, which
``edu3d train`` shares; nodes on one machine keep every socket on loopback). Nothing here
imports torch: ``edu3d run`` costs what a bare torchrun costs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edu3d.commands.argtypes import (checked, integer, non_negative_int, positive_int, ranks,
                                     seconds)
from edu3d.launch import api
from edu3d.launch.api import NODE_OPTIONS, LaunchError, LaunchTimeout, endpoint, node_args

HELP = "run a script or module on N ranks"
NODE_HELP = {
    "nnodes": "how many nodes (machines) the world spans; start one edu3d command per node "
              "with the same rendezvous options (default: 1)",
    "node_rank": "this node's number, 0..nnodes-1 (static rendezvous: node 0 holds ranks "
                 "0..nprocs-1)",
    "rdzv_endpoint": "HOST:PORT every node meets at (c10d: one node hosts the store there)",
    "rdzv_backend": "torchrun's rendezvous: static (default; --node-rank orders the nodes) or "
                    "c10d (nodes ordered as they join)",
    "rdzv_id": "a name shared by the nodes of one run (c10d)",
    "master_addr": "static rendezvous: the host of node 0 (default: 127.0.0.1)",
    "master_port": "static rendezvous: its port",
}
NODE_TYPES = {"nnodes": positive_int, "node_rank": non_negative_int,
              "master_port": integer(1, "a port number 1..65535"),
              "rdzv_endpoint": checked(endpoint, "HOST[:PORT]")}


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """torchrun's multi-node options (:data:`edu3d.launch.api.NODE_OPTIONS`), as ``edu3d run``
    and ``edu3d train`` take them; each is ``None`` when not given. Every address defaults
    to loopback: only an address the user names outside it opens a socket beyond this
    machine (:func:`edu3d.launch.api.loopback_only`)."""
    group = parser.add_argument_group(
        "nodes (torchrun's options; start one command per node, loopback unless an address "
        "says otherwise)")
    for name in NODE_OPTIONS:
        group.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                           type=NODE_TYPES.get(name), help=NODE_HELP.get(name, argparse.SUPPRESS))


def node_options(namespace: argparse.Namespace) -> dict:
    """The node options of a parsed command line, by name (``None``: not given)."""
    given = vars(namespace)
    return {name: given.get(name) for name in NODE_OPTIONS}


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
    add_node_arguments(p)
    p.add_argument("target", help="script path, or module name with -m")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=main_from_args)


def main_from_args(args) -> int:
    """Launch, and turn the launcher's errors into exit codes (1 failed, 124, 130)."""
    try:
        torchrun_args = node_args(**node_options(args))
    except ValueError as err:
        print(f"edu3d run: {err}", file=sys.stderr)
        return 2
    try:
        api.launch(args.target, args.nprocs, args=args.args, module=args.module,
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
