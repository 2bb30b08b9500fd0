"""``edu3d grade``: run the exercise notebooks and count their verdicts.

``edu3d grade [EXERCISE ...] [--solutions | --submission DIR] [--hint-level N] [--isolate]
[--json]`` prints a score table, every failed check with its hint (or one JSON object); exit
code 0 when every check passed, 1 otherwise, 2 for bad input (found before any kernel
starts). How a score is made (a fresh kernel per notebook, the sealed verdict channel, tiered
hints, the processes a submission leaves) is :mod:`edu3d.course.autograde.scoring`'s; this
module turns the command line into its calls.

nbformat and nbclient are optional (the course's notebook extras): :func:`main` looks for them
with imports inside functions, so a missing one is one line with how to install it.
"""

from __future__ import annotations

import json
import sys

from edu3d.commands.argtypes import between, seconds
from edu3d.course.autograde import hints as grade_hints
from edu3d.course.autograde import isolate as grade_isolate
from edu3d.course.autograde import scoring
from edu3d.course.autograde.processes import protect_grader
from edu3d.course.autograde.report import output_state, restore_output, table
from edu3d.launch.runs import RunsError


def add_subcommand(sub) -> None:
    p = sub.add_parser(
        "grade", help="grade the exercises (yours, the solutions, or a learner's folder)",
        description="Run the exercise notebooks (each in a fresh kernel) and count the checks "
                    "that pass. Exit code 0 when all pass, 1 otherwise, 2 for bad input.")
    p.add_argument("exercise", nargs="*", help="number, name or module (03, zero1, 03_zero1, "
                                                "ring_allreduce); default: all")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--solutions", action="store_true",
                       help="grade the reference solutions (EDU3D_SOLUTIONS=1)")
    which.add_argument("--submission", metavar="DIR",
                       help="grade one learner's folder of exercise modules (DIR/*.py or "
                            "DIR/exercises/*.py) instead of exercises/; a module missing "
                            "there is graded as the untouched stub")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=seconds("240"), default=240,
                   help="seconds per cell (default: %(default)s)")
    p.add_argument("--isolate", action="store_true",
                   help="run each kernel in Linux namespaces, without privileges: its own "
                        "processes and loopback network, every file system read-only but its "
                        "temporary folder (needs unshare, setpriv and user namespaces)")
    p.add_argument("--hint-level", type=between(1, 3), default=None, metavar="N",
                   help="hint tier for every failure: 1 the concept, 2 a closer nudge, 3 the "
                        "answer's shape (default: deeper each time a check fails again)")
    p.set_defaults(func=main)


def main(args) -> int:
    """Choose the exercises and check the input (exit 2 before any kernel), then grade."""
    try:
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401
    except ImportError as err:
        print(f"edu3d grade: {err.name} is missing; pip install nbclient ipykernel",
              file=sys.stderr)
        return 2
    try:
        everything = scoring.exercises()
        chosen = scoring.select(args.exercise, everything)
        folder = None
        if args.submission is not None:
            folder = scoring.submission_folder(args.submission, {m for e in everything
                                                                 for m in e.modules})
        why = grade_isolate.unavailable() if args.isolate else None
        if why:
            raise scoring.GradeError(why)
    except scoring.GradeError as err:
        print(f"edu3d grade: {err}", file=sys.stderr)
        return 2
    protect_grader()  # the submission's processes cannot open this one's files through /proc
    state = output_state()  # the report's file, to take back what a submission writes there
    counts = None if args.solutions else grade_hints.load()
    report = scoring.grade(chosen, solutions=args.solutions, submission=folder,
                           timeout=args.timeout, hint_level=args.hint_level, counts=counts,
                           isolate=args.isolate)
    restore_output(state)
    if counts is not None:
        try:
            grade_hints.save(counts)
        except (OSError, RunsError) as err:
            print(f"edu3d grade: could not keep the hint counts ({err})", file=sys.stderr)
    print(json.dumps(report) if args.json else table(report))
    return 0 if report["total"] and report["passed"] == report["total"] else 1
