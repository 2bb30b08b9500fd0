"""The ``edu3d`` command.

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
    edu3d grade [EXERCISE ...] --json   grade the exercises, a score table
    edu3d course                        open the course in JupyterLab

``edu3d run`` passes torchrun's multi-node options through (``--nnodes``, ``--node-rank``,
``--rdzv-endpoint``, ``--rdzv-backend``, ``--rdzv-id``, ``--master-addr``, ``--master-port``),
so the same script runs across machines. This module imports no torch at start-up: ``edu3d
run`` costs what a bare torchrun costs.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from edu3d import __version__
from edu3d.train.options import positive_int

# torchrun options edu3d run forwards unchanged (multi-node and rendezvous)
PASSTHROUGH = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id",
               "--rdzv-conf", "--master-addr", "--master-port", "--local-addr")


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (what was wrong, where to look), not the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---- edu3d run ------------------------------------------------------------------------------
def _add_run(sub) -> None:
    p = sub.add_parser("run", help="run a script or module on N ranks",
                       description="Run a script (or -m module) on N ranks through torchrun. "
                                   "Output is prefixed by rank; the first failing rank ends "
                                   "the run with its traceback and exit code 1.")
    p.add_argument("-n", "--nprocs", type=positive_int, default=2,
                   help="ranks on this node (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=None,
                   help="kill the run after this many seconds (default: no limit)")
    p.add_argument("-m", "--module", action="store_true", help="TARGET is a module name")
    for opt in PASSTHROUGH:
        p.add_argument(opt, dest="tr_" + opt[2:].replace("-", "_"), default=None,
                       help=argparse.SUPPRESS if opt in ("--rdzv-conf", "--local-addr") else
                       f"passed to torchrun as {opt}")
    p.add_argument("target", help="script path, or module name with -m")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from edu3d.launch.api import LaunchError, LaunchTimeout, launch

    torchrun_args = [f"{opt}={getattr(args, 'tr_' + opt[2:].replace('-', '_'))}"
                     for opt in PASSTHROUGH
                     if getattr(args, "tr_" + opt[2:].replace("-", "_")) is not None]
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


# ---- edu3d doctor ---------------------------------------------------------------------------
def smoke(mesh) -> dict:
    """What ``edu3d doctor`` runs on 2 ranks: an all-reduce and a ring of send/recv."""
    import torch
    import torch.distributed as dist

    n, r = mesh.layout.world_size, mesh.rank
    t = torch.full((1024,), float(r + 1))
    dist.all_reduce(t)
    ok_reduce = bool(torch.all(t == n * (n + 1) / 2))
    got = torch.empty(1)
    reqs = [dist.isend(torch.tensor([float(r)]), (r + 1) % n),
            dist.irecv(got, (r - 1) % n)]
    for q in reqs:
        q.wait()
    return {"backend": dist.get_backend(), "all_reduce": ok_reduce,
            "send_recv": float(got.item()) == float((r - 1) % n)}


def _doctor(args) -> int:
    print(f"edu3d {__version__}   python {platform.python_version()}   "
          f"{platform.system()} {platform.machine()}")
    try:
        import torch
        import torch.distributed as dist
    except ImportError as err:
        print(f"torch: NOT importable ({err}); pip install 'torch>=2.4'")
        return 1
    print(f"torch {torch.__version__}")
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()),
                                      ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if ok]
    print(f"distributed backends compiled in: {', '.join(backends) or 'none'}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
    print(f"CUDA GPUs: {gpus}{' (' + names + ')' if gpus else ''}")
    print(f"CPU cores: {os.cpu_count()}   OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset (edu3d sets 1 per rank)')}")
    import importlib.util

    for mod in ("jupyterlab", "ipywidgets", "plotly", "matplotlib"):
        found = importlib.util.find_spec(mod) is not None
        print(f"{mod}: {'found' if found else f'NOT found (pip install {mod})'}")

    from edu3d.launch.api import LaunchError, launch

    t0 = time.perf_counter()
    try:
        res = launch(smoke, 2, env={"EDU3D_BACKEND": "gloo"}, timeout=args.timeout, echo=False,
                     name="doctor")
    except LaunchError as err:
        print(f"gloo smoke run on 2 ranks: FAILED\n{err}")
        return 1
    ok = all(r["all_reduce"] and r["send_recv"] for r in res.results)
    print(f"gloo smoke run on 2 ranks: {'OK' if ok else 'WRONG RESULTS'} "
          f"(all_reduce and send/recv, {time.perf_counter() - t0:.1f} s)")
    if gpus >= 2:
        print("NCCL: run `edu3d run -n 2` on a script calling edu3d.distributed.runtime.init() to use it")
    return 0 if ok else 1


# ---- edu3d bench ---------------------------------------------------------------------------
BENCHMARKS = {  # name -> "module:function(nprocs=, json_out=, reps=) -> report dict"
    "launch": "edu3d.bench.bench_launch:run_benchmark",
    "comm": "edu3d.bench.bench_comm:run_benchmark",
    "dp": "edu3d.bench.bench_dp:run_dp_benchmark",
    "zero": "edu3d.bench.bench_dp:run_zero_benchmark",
    "pp": "edu3d.bench.bench_pp:run_benchmark",
    "tp": "edu3d.bench.bench_tp:run_benchmark",
    "3d": "edu3d.bench.bench_3d:run_benchmark",
    "recompute": "edu3d.bench.bench_recompute:run_benchmark",
}


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark edu3d against PyTorch's own implementations",
                       description="Time edu3d and the PyTorch implementation side by side in "
                                   "one process tree; medians of interleaved repetitions.")
    p.add_argument("name", choices=sorted(BENCHMARKS), help="what to time")
    p.add_argument("-n", "--nprocs", type=positive_int, default=None,
                   help="ranks (default: per benchmark)")
    p.add_argument("--reps", type=positive_int, default=None,
                   help="repetitions (default: per benchmark)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (progress still goes to stderr)")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    import importlib
    import json

    from edu3d.bench.harness import format_table

    module, _, fn = BENCHMARKS[args.name].partition(":")
    options = {k: v for k, v in (("nprocs", args.nprocs), ("reps", args.reps)) if v is not None}
    rep = getattr(importlib.import_module(module), fn)(json_out=args.json, **options)
    print(json.dumps(rep) if args.json else format_table(rep))
    return 0


# ---- edu3d train, course --------------------------------------------------------------------
def _add_train(sub) -> None:
    from edu3d.train import loop as train

    p = sub.add_parser("train", help=LAZY["train"][0],
                       description="Train the reference GPT on the synthetic corpus, serially "
                                   "or on a parallel layout (dp * tp * pp ranks). With --json, "
                                   "stdout holds exactly one JSON object per step.")
    train.add_arguments(p)
    p.set_defaults(func=lambda a: train.main_from_args(a, p))


def _add_schedule(sub) -> None:
    from edu3d.commands.schedule import add_subcommand

    add_subcommand(sub)


def _module_subcommand(module: str):
    """A builder that lets ``module`` add its own subcommand (``add_subcommand(sub)``)."""
    def add(sub) -> None:
        import importlib

        importlib.import_module(module).add_subcommand(sub)

    return add


# Subcommands whose options need torch are built only when invoked, so `edu3d run` stays
# as fast as a bare torchrun: name -> (help, builder).
LAZY = {
    "plan": ("will it fit? per-rank memory of a layout, and the best layout for a cluster",
             _module_subcommand("edu3d.commands.plan")),
    "ckpt": ("inspect or export a sharded checkpoint (one consolidated file)",
             _module_subcommand("edu3d.ckpt.export")),
    "generate": ("generate text from a checkpoint, serially or under tensor parallelism",
                 _module_subcommand("edu3d.commands.generate")),
    "grade": ("grade the exercises (yours, the solutions, or a learner's folder)",
              _module_subcommand("edu3d.commands.grade")),
    "train": ("train the reference GPT, serially or on a parallel layout", _add_train),
    "schedule": ("print a pipeline schedule (GPipe, 1F1B, interleaved, ZB-H1) as data",
                 _add_schedule),
}


# ---- edu3d course ---------------------------------------------------------------------------
COURSE_ROOT = Path(__file__).resolve().parent.parent  # holds notebooks/ and exercises/


def _add_course(sub) -> None:
    p = sub.add_parser("course", help="open the course in JupyterLab",
                       description="Serve the course folder (chapters in notebooks/, exercises "
                                   "in exercises/) with JupyterLab, opening on the chapters. "
                                   "Options edu3d does not know are passed to JupyterLab "
                                   "(e.g. --ServerApp.token=SECRET).")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser")
    p.add_argument("--port", type=positive_int, default=None,
                   help="port to serve on (default: JupyterLab's, 8888 or the next free one)")
    p.add_argument("--ip", default="127.0.0.1",
                   help="address to listen on (default: %(default)s, this machine only; "
                        "0.0.0.0 exposes the server, and the code it runs, to the network)")
    p.set_defaults(func=_course, jupyter_args=[])


def course_command(args, root: Path = COURSE_ROOT, as_root: bool | None = None) -> list[str]:
    """The JupyterLab command line ``edu3d course`` runs (it starts nothing itself)."""
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}",
           "--LabApp.default_url=/lab/tree/notebooks", f"--ServerApp.ip={args.ip}"]
    if args.no_browser:
        cmd.append("--no-browser")
    if args.port:
        cmd.append(f"--port={args.port}")
    if as_root is None:
        as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    if as_root:
        cmd.append("--allow-root")  # JupyterLab refuses root without it
    return cmd + list(args.jupyter_args)


def _course(args) -> int:
    if not (COURSE_ROOT / "notebooks").is_dir():
        print(f"edu3d course: no notebooks/ folder in {COURSE_ROOT}; install edu3d from a "
              "checkout with `pip install -e .`", file=sys.stderr)
        return 1
    cmd = course_command(args)
    if "--allow-root" in cmd and "--allow-root" not in args.jupyter_args:
        print("edu3d course: running as root, so JupyterLab gets --allow-root", file=sys.stderr)
    print("opening", " ".join(cmd), file=sys.stderr)
    os.execv(sys.executable, cmd)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser for ``command`` (all commands when None); others as placeholders."""
    parser = Parser(
        prog="edu3d", description="edu3d: 3D-parallel LLM training you can see. Real "
                                  "torch.distributed runs, measured and drawn.")
    parser.add_argument("--version", action="version", version=f"edu3d {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_run(sub)
    d = sub.add_parser("doctor", help="check the installation and a 2-rank gloo run")
    d.add_argument("--timeout", type=float, default=120.0,
                   help="seconds allowed for the smoke run (default: %(default)s)")
    d.set_defaults(func=_doctor)
    for name, (help_, add) in LAZY.items():
        if command is None or command == name:
            add(sub)
        else:
            sub.add_parser(name, help=help_, add_help=False)
    _add_bench(sub)
    r = sub.add_parser("runs", help="list or clean run folders ($EDU3D_RUNS, default ./runs)")
    r.add_argument("action", choices=("list", "clean"), help="list them, or remove them")
    r.add_argument("--keep", type=int, default=0, help="clean: keep the newest N (default 0)")
    r.set_defaults(func=lambda a: __import__("edu3d.launch.runs").launch.runs.main(a.action, a.keep))
    _add_course(sub)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``edu3d``'s arguments; ``edu3d course`` keeps the options it does not know for
    JupyterLab in ``args.jupyter_args``."""
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in LAZY else "")
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
