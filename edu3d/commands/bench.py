"""``edu3d bench NAME``: edu3d against PyTorch's own implementation, side by side.

After reading this file you should understand how a benchmark is found and run: each name
maps to ``module:function`` (:data:`BENCHMARKS`), a function of ``nprocs``, ``reps`` and
``json_out`` that launches its ranks and returns a report (:mod:`edu3d.bench.harness`:
medians of interleaved repetitions, ``ratio = edu3d_s / reference_s``). The benchmark's
module is imported by name only when it is asked for: each imports torch.

``--csv FILE`` appends every measurement of the report to a CSV a user keeps
(:mod:`edu3d.bench.records`: one row per measurement, with the date, commit, machine and
torch version), checked before the benchmark starts; ``edu3d bench plot FILE -o out.png``
draws such a file (:mod:`edu3d.bench.plot`, imported, with matplotlib, only for ``plot``).
A new benchmark needs one line in :data:`BENCHMARKS`: ``--csv`` reads any report in the
harness's shape.
"""

from __future__ import annotations

import importlib
import json
import sys

from edu3d.bench import records
from edu3d.bench.harness import format_table, progress
from edu3d.commands.argtypes import count, ranks

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
    "offload": "edu3d.bench.bench_offload:run_benchmark",
    "ep": "edu3d.bench.bench_5d:run_ep_benchmark",
    "cp": "edu3d.bench.bench_5d:run_cp_benchmark",
    "overhead": "edu3d.bench.bench_overhead:run_benchmark",
    "mfu": "edu3d.bench.bench_mfu:run_benchmark",
    "goals": "edu3d.bench.bench_goals:run_benchmark",
    "tune-model": "edu3d.bench.bench_tune_model:run_benchmark",
}
PLOT = "edu3d.bench.plot:draw"  # edu3d bench plot FILE -o OUT: (csv, out) -> panel titles


def add_subcommand(sub) -> None:
    """Register ``bench`` on ``edu3d``'s subcommands."""
    p = sub.add_parser("bench", help=HELP,
                       description="Time edu3d and the PyTorch implementation side by side in "
                                   "one process tree; medians of interleaved repetitions.")
    p.add_argument("name", choices=sorted(BENCHMARKS) + ["plot"],
                   help="what to time, or plot: draw a CSV written with --csv")
    p.add_argument("file", nargs="?", metavar="FILE", help="plot: the CSV to draw")
    p.add_argument("-n", "--nprocs", type=ranks, default=None,
                   help="ranks (default: per benchmark)")
    p.add_argument("--reps", type=count, default=None,
                   help="repetitions (default: per benchmark)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (progress still goes to stderr)")
    p.add_argument("--csv", metavar="FILE",
                   help="also append one row per measurement to FILE (the header once, when "
                        "FILE is new): date, git commit, machine, torch version, benchmark, "
                        "case, layout, world size, metric, value, reference, its value, ratio")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="plot: the picture to write (.png, .svg or .pdf; default FILE.png)")
    p.set_defaults(func=main_from_args)


def benchmark(name: str):
    """The function that runs benchmark ``name`` (its module imported now)."""
    module, _, fn = BENCHMARKS[name].partition(":")
    return getattr(importlib.import_module(module), fn)


def refuse(message: str) -> int:
    print(f"edu3d bench: {message}", file=sys.stderr)
    return 2


def plot(args) -> int:
    """``edu3d bench plot FILE [-o OUT]``: draw the CSV; one line on stderr if it cannot."""
    if not args.file:
        return refuse("plot: name the CSV to draw (edu3d bench plot FILE -o out.png)")
    stray = [o for o, v in (("--csv", args.csv), ("-n", args.nprocs), ("--reps", args.reps),
                            ("--json", args.json)) if v]
    if stray:
        return refuse(f"plot: {stray[0]} is for running a benchmark; plot takes FILE and -o")
    out = args.output or str(args.file).removesuffix(".csv") + ".png"
    module, _, fn = PLOT.partition(":")
    try:
        titles = getattr(importlib.import_module(module), fn)(args.file, out)
    except records.RecordsError as e:
        return refuse(str(e))
    print(f"edu3d bench plot: wrote {out} ({len(titles)} panels: "
          f"{'; '.join(t.split(' (')[0] for t in titles)})")
    return 0


def main_from_args(args) -> int:
    """Run the benchmark and print its table (or its JSON report); with ``--csv`` append its
    measurements to the file. ``plot`` draws a file instead."""
    if args.name == "plot":
        return plot(args)
    if args.file or args.output:
        return refuse(f"{args.file or '-o'}: only edu3d bench plot takes a file or -o; "
                      f"to keep {args.name}'s numbers pass --csv FILE")
    if args.csv:
        try:
            records.check_appendable(args.csv)
        except records.RecordsError as e:
            return refuse(str(e))
    options = {k: v for k, v in (("nprocs", args.nprocs), ("reps", args.reps)) if v is not None}
    rep = benchmark(args.name)(json_out=args.json, **options)
    print(json.dumps(rep) if args.json else format_table(rep))
    if args.csv:
        n = records.append(args.csv, records.measurements(rep))
        progress(f"appended {n} rows to {args.csv}")
    return 0
