"""The ``edu3d`` command: its parser and the dispatch to one module per subcommand.

::

    edu3d run -n 4 script.py [ARGS]     run a script on 4 ranks (torchrun underneath)
    edu3d run -n 4 -m package.module    ... or a module
    edu3d doctor                        versions, backends, GPUs, cores, a 2-rank smoke run
    edu3d train --steps 60 --json       train the reference GPT (one JSON object per step)
    edu3d train --dp 2 --tp 2 ...       ... on a parallel layout
    edu3d schedule --name 1f1b --pp 4 --microbatches 8   a pipeline schedule as data
    edu3d plan --model llama2-70b --gpus 64 --gpu-mem 80   will it fit, and which layout
    edu3d ckpt export DIR OUT           one consolidated file from a sharded checkpoint
    edu3d generate --ckpt DIR --prompt "1 2 3"   tokens from a trained checkpoint
    edu3d bench pp --json               edu3d vs PyTorch, side by side
    edu3d calibrate                     measure this machine: its hardware profile
    edu3d grade [EXERCISE ...] --json   grade the exercises, a score table
    edu3d runs list                     the run folders launches left
    edu3d top [RUN]                     a run's ranks live: step time, communication, memory
    edu3d course                        open the course in JupyterLab

Each subcommand is a module of :mod:`edu3d.commands` with ``add_subcommand(sub)``
(:data:`SUBCOMMANDS`). Only the invoked one is imported and built, by name: the other
subcommands appear as placeholders with their help line, so ``edu3d run`` starts without
torch and costs what a bare torchrun costs (``python -X importtime -m edu3d.cli --help``
shows no torch). That torch-free start-up is also why the subcommands that need torch
bring it in through imports inside functions.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from edu3d import __version__

SUBCOMMANDS = {  # name -> (help line, module with add_subcommand), in --help's order
    "run": ("run a script or module on N ranks", "edu3d.commands.run"),
    "doctor": ("check the installation and a 2-rank gloo run", "edu3d.commands.doctor"),
    "plan": ("will it fit? per-rank memory of a layout, and the best layout for a cluster",
             "edu3d.commands.plan"),
    "ckpt": ("inspect or export a sharded checkpoint (one consolidated file)",
             "edu3d.commands.ckpt"),
    "generate": ("generate text from a checkpoint, serially or under tensor parallelism",
                 "edu3d.commands.generate"),
    "grade": ("grade the exercises (yours, the solutions, or a learner's folder)",
              "edu3d.commands.grade"),
    "train": ("train the reference GPT, serially or on a parallel layout",
              "edu3d.commands.train"),
    "schedule": ("print a pipeline schedule (GPipe, 1F1B, interleaved, ZB-H1) as data",
                 "edu3d.commands.schedule"),
    "bench": ("benchmark edu3d against PyTorch's own implementations", "edu3d.commands.bench"),
    "tune": ("measure the planner's best layouts; keep the fastest", "edu3d.commands.tune"),
    "calibrate": ("measure this machine (a minute): the hardware profile plan and tune use",
                  "edu3d.commands.calibrate"),
    "runs": ("list or clean run folders ($EDU3D_RUNS, default ./runs)",
             "edu3d.commands.run_folders"),
    "top": ("watch a run's ranks live: step time, tokens/s, communication, memory",
            "edu3d.commands.top"),
    "course": ("open the course in JupyterLab", "edu3d.commands.course"),
}


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (what was wrong, where to look), not the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser for ``command`` (all commands when None); others as placeholders."""
    parser = Parser(
        prog="edu3d", description="edu3d: 3D-parallel LLM training you can see. Real runs "
                                  "(torch.distributed), measured and drawn.")
    parser.add_argument("--version", action="version", version=f"edu3d {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_, module) in SUBCOMMANDS.items():
        if command is None or command == name:
            importlib.import_module(module).add_subcommand(sub)
        else:
            sub.add_parser(name, help=help_, add_help=False)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``edu3d``'s arguments; ``edu3d course`` keeps the options it does not know for
    JupyterLab in ``args.jupyter_args``."""
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else "")
    if command != "course":
        return parser.parse_args(argv)
    args, unknown = parser.parse_known_args(argv)
    args.jupyter_args = unknown
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        return args.func(args) or 0
    except KeyboardInterrupt:  # e.g. while torch imports; the commands catch their own
        command = next((a for a in argv if not a.startswith("-")), None)
        print(f"{'edu3d ' + command if command else 'edu3d'}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
