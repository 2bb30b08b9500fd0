"""``edu3d bench NAME``: edu3d against PyTorch's own implementation, side by side.

After reading this file you should understand how a benchmark is found and run: each name
maps to ``module:function`` (:data:`BENCHMARKS`), a function of ``nprocs``, ``reps`` and
``json_out`` that launches its ranks and returns a report (:mod:`edu3d.bench.harness`:
medians of interleaved repetitions, ``ratio = edu3d_s / reference_s``). The benchmark's
module is imported by name only when it is asked for: each imports torch.
"""

from __future__ import annotations

import importlib
import json

from edu3d.bench.harness import format_table
from edu3d.commands.argtypes import positive_int

HELP = "benchmark edu3d against PyTorch's own implementations"
BENCHMARKS = {  # name -> "module:function(nprocs=, json_out=, reps=) -> report dict"
    "launch": "edu3d.bench.bench_launch:run_benchmark",
    "comm": "edu3d.bench.bench_comm:run_benchmark",
    "dp": "edu3d.bench.bench_dp:run_dp_benchmark",
    "zero": "edu3d.bench.bench_dp:run_zero_benchmark",
    "pp": "edu3d.bench.bench_pp:run_benchmark",
    "tp": "edu3d.bench.bench_tp:run_benchmark",
    "3d": "edu3d.bench.bench_3d:run_benchmark",
    "recompute": "edu3d.bench.bench_recompute:run_benchmark",
    "ep": "edu3d.bench.bench_5d:run_ep_benchmark",
    "cp": "edu3d.bench.bench_5d:run_cp_benchmark",
    "overhead": "edu3d.bench.bench_overhead:run_benchmark",
    "mfu": "edu3d.bench.bench_mfu:run_benchmark",
}


def add_subcommand(sub) -> None:
    """Register ``bench`` on ``edu3d``'s subcommands."""
    p = sub.add_parser("bench", help=HELP,
                       description="Time edu3d and the PyTorch implementation side by side in "
                                   "one process tree; medians of interleaved repetitions.")
    p.add_argument("name", choices=sorted(BENCHMARKS), help="what to time")
    p.add_argument("-n", "--nprocs", type=positive_int, default=None,
                   help="ranks (default: per benchmark)")
    p.add_argument("--reps", type=positive_int, default=None,
                   help="repetitions (default: per benchmark)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (progress still goes to stderr)")
    p.set_defaults(func=main_from_args)


def benchmark(name: str):
    """The function that runs benchmark ``name`` (its module imported now)."""
    module, _, fn = BENCHMARKS[name].partition(":")
    return getattr(importlib.import_module(module), fn)


def main_from_args(args) -> int:
    """Run the benchmark and print its table (or its JSON report)."""
    options = {k: v for k, v in (("nprocs", args.nprocs), ("reps", args.reps)) if v is not None}
    rep = benchmark(args.name)(json_out=args.json, **options)
    print(json.dumps(rep) if args.json else format_table(rep))
    return 0
