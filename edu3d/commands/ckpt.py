"""``edu3d ckpt show|export``: a sharded checkpoint, inspected or exported, from the shell.

After reading this file you should understand the command line only; what it reads and
writes is :mod:`edu3d.ckpt.export`. (Reading a checkpoint needs torch, so ``edu3d`` builds
this parser only when ``edu3d ckpt`` is run: see :mod:`edu3d.cli`.)
"""

from __future__ import annotations

import sys

from edu3d.ckpt import export
from edu3d.ckpt.format import CheckpointError
from edu3d.commands.argtypes import step_number


def add_subcommand(sub) -> None:
    """Register ``ckpt`` (``show``, ``export``) on ``edu3d``'s subcommands."""
    p = sub.add_parser("ckpt", help="inspect or export a sharded checkpoint",
                       description="Inspect a sharded checkpoint folder (edu3d train "
                                   "--ckpt-dir) or export one consolidated file from it.")
    acts = p.add_subparsers(dest="action", required=True)
    shw = acts.add_parser("show", help="the steps, layout and files of a checkpoint folder")
    shw.add_argument("dir")
    shw.add_argument("--step", type=step_number, default=None, help="default: the newest")
    shw.add_argument("--no-verify", dest="verify", action="store_false",
                     help="do not read the files to check their sha256 (faster; the output "
                          "says they were not checked)")
    shw.set_defaults(func=show_command)
    exp = acts.add_parser("export", help="one consolidated file that torch.load and the "
                                         "serial GPT read")
    exp.add_argument("dir")
    exp.add_argument("out")
    exp.add_argument("--step", type=step_number, default=None, help="default: the newest")
    exp.add_argument("--format", choices=("torch", "dcp"), default="torch",
                     help="torch: one file {config, step, model}; dcp: a folder written by "
                          "torch.distributed.checkpoint.save")
    exp.set_defaults(func=export_command)


def show_command(args) -> int:
    """``edu3d ckpt show DIR``: what a checkpoint folder holds; exit code 2 when it cannot be
    read or a checkpoint in it is damaged (one line per damaged checkpoint on stderr)."""
    try:
        text, problems = export.describe(args.dir, args.step, check=args.verify)
    except CheckpointError as err:
        print(f"edu3d ckpt show: {err}", file=sys.stderr)
        return 2
    print(text)
    for line in problems:
        print(f"edu3d ckpt show: {line}", file=sys.stderr)
    return 2 if problems else 0


def export_command(args) -> int:
    """``edu3d ckpt export DIR OUT``: one consolidated file (exit code 2 when unreadable)."""
    try:
        out = export.export(args.dir, args.out, args.step, args.format)
    except CheckpointError as err:
        print(f"edu3d ckpt export: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
