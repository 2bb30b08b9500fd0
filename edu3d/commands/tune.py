"""``edu3d tune``: run the planner's best layouts for a few steps each and keep the fastest.

After reading this file you should know what ``edu3d tune --model tiny --gpus 2`` does and
prints:

* it asks the planner for every layout of the model on ``--gpus`` ranks and runs the best
  ``--top`` of them (varied: every layout, then ZeRO stages, micro-batches, recomputation)
  on this machine, ``--warmup`` steps dropped and ``--steps`` timed, one progress line per
  candidate on stderr (:mod:`edu3d.bench.autotune`);
* then a table: the performance model's step time (on ``--hardware``, default this
  machine's profile from ``edu3d calibrate``) and the planner's memory beside the measured
  median step, the error, tokens/s and peak memory; the winner (the fastest whose peak fits
  ``--gpu-mem``); and the grade of the model: Spearman's rank correlation of predicted
  against measured step times, the median error, and the candidate it misranked most
  (:mod:`edu3d.bench.ranking`). ``--json`` prints the whole report instead;
* bad input (an unknown model, more ranks than this machine hosts, ``--gpu-mem 0``, an
  unknown or broken ``--hardware`` profile, a model override outside the range a
  :class:`~edu3d.model.gpt.GPTConfig` accepts, such as ``--d-model 1000000007``) is refused
  in one line, exit code 2, before any rank starts.

Exit codes: 0 a winner, 1 none (every candidate failed or none fits), 2 bad options.

The tuner itself comes in through imports inside functions: it imports torch and the
trainer, and ``edu3d tune --help`` (like every ``edu3d`` command) must start without them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from edu3d.commands.argtypes import integer, non_negative_int, number, positive_int
from edu3d.model.config_schema import INT_RANGES

HELP = "measure the planner's best layouts; keep the fastest"
OVERRIDES = {"--layers": "n_layers", "--heads": "n_heads", "--d-model": "d_model",
             "--seq": "seq_len", "--vocab": "vocab_size", "--experts": "n_experts",
             "--topk": "topk"}  # edu3d train's model options and the GPTConfig field of each


def bucket_sizes(text: str) -> tuple[float, ...]:
    """argparse type for ``--bucket-mb 0.5,25``: gradient bucket sizes in MB, each > 0."""
    parse = number(0, False, "25")
    return tuple(parse(part) for part in text.split(","))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default="tiny",
                        help="one of the course's GPTs: tiny, small, medium, gpt2-small")
    parser.add_argument("--gpus", type=positive_int, required=True,
                        help="ranks: GPUs with NCCL, else gloo processes on the CPU")
    parser.add_argument("--gpu-mem", type=number(0, False, "80"), default=None,
                        help="GB per rank for the planner and the winner (default: 80 on "
                             "a GPU, the free host memory shared by the ranks on CPU)")
    parser.add_argument("--steps", type=positive_int, default=3,
                        help="timed steps per candidate (default: %(default)s)")
    parser.add_argument("--warmup", type=non_negative_int, default=1,
                        help="steps dropped before timing (default: %(default)s)")
    parser.add_argument("--top", type=positive_int, default=8,
                        help="candidates to run (default: %(default)s)")
    parser.add_argument("--global-batch", type=positive_int, default=8,
                        help="sequences per step (default: %(default)s)")
    parser.add_argument("--bucket-mb", type=bucket_sizes, default=(25.0,),
                        help="gradient bucket sizes to try, comma-separated (e.g. 0.05,25; "
                             "default 25)")
    model = parser.add_argument_group("model overrides (edu3d train's)")
    for flag, field in OVERRIDES.items():  # each within the range a GPTConfig accepts
        model.add_argument(flag, type=integer(1, "a positive integer (1, 2, 3 ...)",
                                              INT_RANGES[field][1]), default=None)
    parser.add_argument("--hardware", default=None, metavar="NAME|FILE.json",
                        help="the profile to predict with (default: this machine's, written "
                             "by edu3d calibrate; without one a stand-in and a note)")
    parser.add_argument("--timeout", type=number(0, False, "600"), default=600.0,
                        help="seconds for the whole tuning (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON "
                                                            "object (progress stays on stderr)")
    return parser


def add_subcommand(sub) -> None:
    """Register ``tune`` on ``edu3d``'s subcommands."""
    p = sub.add_parser("tune", help=HELP,
                       description="The planner's best layouts, ZeRO stages, micro-batches "
                                   "and recomputation, each run for a few steps on this "
                                   "machine: measured step time, tokens/s and peak memory "
                                   "beside the prediction, the winner, and how well the "
                                   "cost model ranked them.")
    add_arguments(p)
    p.set_defaults(func=main_from_args)


def _finite(value):
    return None if isinstance(value, float) and math.isnan(value) else value


def main_from_args(args) -> int:
    from edu3d.bench import autotune, ranking

    overrides = {k: getattr(args, k) for k in ("layers", "heads", "d_model", "seq", "vocab",
                                               "experts", "topk") if getattr(args, k)}
    try:
        autotune.check_request(args.model, args.gpus, args.gpu_mem, args.steps, args.top,
                               args.warmup)
        rep = autotune.tune(args.model, args.gpus, args.gpu_mem, args.steps, args.top,
                            args.warmup, args.global_batch, args.bucket_mb,
                            progress=autotune.main_progress, timeout=args.timeout,
                            hardware=args.hardware, **overrides)
    except ValueError as err:
        print(f"edu3d tune: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.json:
        rep["spearman"] = _finite(rep["spearman"])
        rep["median_error"] = _finite(rep["median_error"])
        print(json.dumps(rep))
    else:
        print(ranking.format_table(rep))
    return 0 if rep["winner"] else 1

