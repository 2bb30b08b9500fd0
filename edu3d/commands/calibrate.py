"""``edu3d calibrate``: measure this machine and write its hardware profile.

After reading this file you should know what ``edu3d calibrate`` does and where its result
goes:

* it measures this machine for about ``--budget`` seconds (default 60; progress on stderr):
  matmuls by size, memory bandwidth, the attention core, eager PyTorch's overhead per kernel
  and per step, and collectives over a real 2-rank launch (:mod:`edu3d.bench.calibration`);
* it fits the profile's constants, each with its source (:mod:`edu3d.bench.profile_fit`),
  checks the profile as any profile is checked (:func:`edu3d.plan.hardware.profile_from_dict`),
  and writes it to ``this-machine.json`` in :func:`edu3d.plan.hardware.user_profiles` (or
  ``--output FILE.json``), where ``edu3d plan --hardware this-machine`` and ``edu3d tune``
  find it; then prints the constants (``--json``: the profile itself on stdout);
* bad options and failed measurements are one line on stderr: exit 2 for bad options, 1 for
  a measurement that could not be used (a busy machine can spoil one: rerun).

The measuring comes in through imports inside functions: it imports torch, and ``edu3d
calibrate --help`` (like every ``edu3d`` command) must start without it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from edu3d.commands.argtypes import number
from edu3d.plan import hardware

HELP = "measure this machine (a minute): the hardware profile plan and tune use"
UNITS = (("FLOP/s", 1e9, "GFLOP/s"), ("B/s", 1e9, "GB/s"), ("B", 2**30, "GiB"), ("s", 1e-6, "us"),
         ("FLOP", 1e6, "MFLOP"))


def json_path(text: str) -> Path:
    """argparse type for ``--output``: a file name ending in ``.json``."""
    if not text.endswith(".json"):
        raise argparse.ArgumentTypeError(f"{text[:60]}: must be a file name ending in .json "
                                         "(e.g. my-laptop.json)")
    return Path(text)


def add_subcommand(sub) -> None:
    """Register ``calibrate`` on ``edu3d``'s subcommands."""
    p = sub.add_parser("calibrate", help=HELP, description=(
        "Measure this machine as edu3d's ranks run on it (one thread each): matmuls by size, "
        "memory bandwidth, the attention core, eager overhead per kernel and per step, and "
        "collectives on 2 ranks; write the hardware profile that edu3d plan --hardware "
        "this-machine and edu3d tune use."))
    p.add_argument("--budget", type=number(15, True, "60", 600), default=60.0,
                   help="seconds to spend measuring, 15 to 600 (default: %(default)g)")
    p.add_argument("--output", type=json_path, default=None,
                   help="the profile file to write (default: this-machine.json in "
                        "$EDU3D_PROFILES, else ~/.cache/edu3d/profiles)")
    p.add_argument("--json", action="store_true",
                   help="print the profile as JSON on stdout (progress stays on stderr)")
    p.set_defaults(func=main_from_args)


def say(line: str) -> None:
    print(f"calibrate: {line}", file=sys.stderr, flush=True)


def readable(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    for name, scale, shown in UNITS:
        if unit == name:
            return f"{value / scale:.4g} {shown}"
    return f"{value:.4g} {unit}"


def rows(profile: dict, prefix: str = "") -> list[tuple[str, str]]:
    """``(dotted key, value in a readable unit)`` of every constant of ``profile``."""
    out = []
    for key, node in profile.items():
        if isinstance(node, dict) and "value" in node:
            out.append((prefix + key, readable(node["value"], node["unit"])))
        elif isinstance(node, dict):
            out += rows(node, f"{prefix}{key}.")
    return out


def main_from_args(args) -> int:
    from edu3d.bench import calibration, cpu_fit, profile_fit

    path = args.output or hardware.user_profiles() / f"{hardware.USER_PROFILE}.json"
    t0 = time.perf_counter()
    try:
        measured = calibration.measure(args.budget, progress=say)
        if args.output is not None:
            measured["name"] = path.stem
        profile = profile_fit.profile_from(measured, calibration.about())
        hardware.profile_from_dict(profile, str(path))  # refused here, not when plan reads it
        profile_fit.write(profile, path)
    except (cpu_fit.CalibrationError, hardware.ProfileError) as err:
        print(f"edu3d calibrate: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"edu3d calibrate: cannot write {path} ({err.strerror}); pass --output "
              "FILE.json in a folder you can write, or set EDU3D_PROFILES", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(profile))
    else:
        width = max(len(k) for k, _ in rows(profile))
        print("\n".join(f"{k:<{width}}  {v}" for k, v in rows(profile)))
        print("(each constant's source, with its fit, is in the file)")
    say(f"wrote {path} in {time.perf_counter() - t0:.0f} s; use it with edu3d plan --hardware "
        f"{path.stem if args.output is None else path} or edu3d tune")
    return 0
