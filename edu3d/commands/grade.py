"""``edu3d grade``: run the exercise notebooks and count their verdicts.

After reading this file you should know how a score is made:

* each exercise notebook (``exercises/NN_name.ipynb`` of this checkout) runs top to bottom in
  a fresh kernel (nbclient), in memory: nothing is written back, the kernel works in a
  temporary folder and its runs go to a temporary ``EDU3D_RUNS``;
* the code graded is the learner's ``exercises/*.py`` (default), the reference solutions
  (``--solutions``: ``EDU3D_SOLUTIONS=1``), or one learner's folder (``--submission DIR``:
  ``EDU3D_SUBMISSION=DIR``, see :func:`edu3d.course.grading.source`; a module the folder lacks is
  graded as the untouched stub, so its checks fail). Nothing from ``DIR`` runs except the
  exercise modules the notebooks import, and nothing is written into it;
* the checks are the ``PASS``/``FAIL`` lines :func:`edu3d.course.grading.check` prints in the
  checked cells (tag ``nbval-check-output``), each ``FAIL`` with the hint printed under it. The committed
  notebook (outputs of the solutions) names each cell's checks in order, so a line that is
  not the cell's next check is ignored, and a cell that stops on an error counts its missing
  checks as failed, with the error's one-line reason;
* hints are tiered (concept, nudge, the answer's shape): each run counts every check's
  failures in edu3d's own state file, so grading a still-failing exercise again shows a
  closer hint; ``--hint-level N`` asks for tier N at once (:mod:`edu3d.commands.grade_hints`);
* a submission that loops past ``--timeout`` or kills its kernel (``os._exit``, a crash) is
  named as such (:mod:`edu3d.commands.grade_kernel`): the check that was running gets the
  limit or the exit code and the line of the learner's file, the checks after it in its
  cell say they did not run; after a timeout the next cells still run, after a dead kernel
  they cannot, and each says so.

``edu3d grade [EXERCISE ...] [--solutions | --submission DIR] [--hint-level N] [--json]``
prints a score table, every failed check with its hint (or one JSON object); exit code 0 when every check passed, 1 otherwise, 2 for bad input
(found before any kernel starts).

nbformat and nbclient come in through imports inside functions: they are optional (the
course's notebook extras), and a missing one is reported as one line with how to install it.
"""

from __future__ import annotations

import copy
import json
import re
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from edu3d.commands import grade_hints
from edu3d.commands.argtypes import between, seconds
from edu3d.commands.grade_kernel import EXITED, STOPPED, TIMED_OUT, execute, kernel_env
from edu3d.course import nbtools
from edu3d.course.grading import ROOT
from edu3d.launch.runs import RunsError

EXERCISES = ROOT / "exercises"
MARK = "# NBVAL_CHECK_OUTPUT"
HINT = "  hint: "
SAME = "the same as above"


class GradeError(ValueError):
    """Bad input (an unknown exercise, a missing folder): exit code 2, before any kernel."""


@dataclass(frozen=True)
class Exercise:
    name: str  # "03_zero1"
    path: Path
    modules: tuple[str, ...]  # the exercise modules its notebook loads ("zero1")

    @property
    def number(self) -> str:
        return self.name.split("_", 1)[0]

    @property
    def short(self) -> str:
        return self.name.split("_", 1)[-1]


def _read(path: Path):
    import nbformat

    return nbformat.read(path, as_version=4)


def exercises() -> list[Exercise]:
    """Every exercise notebook of the checkout, in order."""
    stems = sorted(p.stem for p in EXERCISES.glob("*.py"))
    out = []
    for path in sorted(EXERCISES.glob("[0-9][0-9]_*.ipynb")):
        text = "\n".join(c.source for c in _read(path).cells)
        # grading.load("zero1") in a cell, or "exercises/tp_layers.py" when a grader loads it
        mods = tuple(m for m in stems if re.search(
            rf"grading\.load\(\s*[\"']{m}[\"']|\b{m}\.py\b", text))
        out.append(Exercise(path.stem, path, mods))
    return out


def select(wanted: list[str], available: list[Exercise] | None = None) -> list[Exercise]:
    """The exercises named by number (``03``, ``3``), name (``zero1``, ``03_zero1``) or
    exercise module (``ring_allreduce``); all of them when ``wanted`` is empty."""
    available = exercises() if available is None else available
    if not wanted:
        return available
    chosen: list[Exercise] = []
    for w in wanted:
        key = w.removesuffix(".ipynb").lower()
        hits = [e for e in available if key in (e.name.lower(), e.short.lower()) or key in
                e.modules or (key.isdigit() and int(key) == int(e.number))]
        if not hits:
            names = ", ".join(e.name for e in available)
            raise GradeError(f"unknown exercise {w!r}; choose a number, a name or one of: "
                             f"{names}")
        chosen += [e for e in hits if e not in chosen]
    return sorted(chosen, key=lambda e: e.name)


def submission_folder(folder: str | Path, modules: set[str]) -> Path:
    """The folder holding one learner's exercise modules: ``DIR`` itself, or ``DIR/exercises``
    (a learner's whole checkout). Refuses a folder that holds none of them."""
    root = Path(folder).expanduser().resolve()
    if not root.is_dir():
        raise GradeError(f"--submission {folder}: no such folder")
    for cand in (root, root / "exercises"):
        if any((cand / f"{m}.py").is_file() for m in modules):
            return cand
    raise GradeError(f"--submission {folder}: holds none of the exercise modules "
                     f"({', '.join(sorted(f'{m}.py' for m in modules))}), neither does its "
                     "exercises/ folder")


# ---- scoring one executed notebook -------------------------------------------------------------
def checked_cells(nb) -> list[tuple[int, object]]:
    return [(i, c) for i, c in enumerate(nb.cells)
            if nbtools.is_checked(c)]


def committed_titles(cell) -> list[str]:
    """The check titles a committed cell passes (the solutions' ``PASS`` lines)."""
    text = "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")
    return [ln[5:] for ln in text.splitlines() if ln.startswith("PASS ")]


def error_reason(output) -> str:
    """One line for a cell's error output: ``NameError: name 'x' is not defined``."""
    value = (output.get("evalue") or "").strip().splitlines()
    if output.get("ename") in (TIMED_OUT, EXITED, STOPPED) and value:
        return value[0]  # the grader's own words
    text = f"{output.get('ename', 'error')}: {value[0]}" if value else output.get("ename", "")
    return text if len(text) <= 300 else text[:300] + " ..."


def score_cell(cell, titles: list[str], earlier_error: str | None,
               earlier_stop: bool = False) -> dict:
    """Verdicts of one executed checked cell against its committed ``titles``. A cell the
    grader stopped (a timeout, a dead kernel) blames the check that was running and says so
    for the checks after it; ``earlier_stop``: ``earlier_error`` stopped an earlier cell,
    and every failure here says so too."""
    verdicts: list[list] = []  # [passed, title, hint]
    last_hint, error, shown, stop = None, None, 0, None
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream":
            for line in out.get("text", "").splitlines():
                if out.get("name") == "stdout" and line.startswith(("PASS ", "FAIL ")) \
                        and len(verdicts) < len(titles) and line[5:] == titles[len(verdicts)]:
                    # the next check of the cell (a stray line that is not one is ignored)
                    verdicts.append([line.startswith("PASS "), line[5:], None])
                elif out.get("name") == "stderr" and line.startswith(HINT):
                    hint = line[len(HINT):]
                    hint = last_hint if hint == SAME and last_hint else hint
                    last_hint = hint
                    open_fail = [v for v in verdicts if not v[0] and v[2] is None]
                    if open_fail:
                        open_fail[0][2] = hint
        elif kind == "error":
            error = error_reason(out)
            stop = error if out.get("ename") in (TIMED_OUT, EXITED) else None
        else:
            shown += 1  # a displayed value under a checked cell: not a verdict
    if error and earlier_error:
        error = f"{error} (after an earlier cell failed: {earlier_error})"
    missing = error or earlier_error or "the check did not run"
    running = titles[len(verdicts)] if len(verdicts) < len(titles) else None
    after = f" (after an earlier cell {earlier_error})" if earlier_stop else ""
    checks = []
    for i, title in enumerate(titles):
        if i < len(verdicts):
            ok, printed, hint = verdicts[i]
            checks.append({"check": printed, "passed": ok,
                           "hint": None if ok else (hint or "no hint printed") + after})
        elif stop:
            checks.append({"check": title, "passed": False, "hint": f"{stop} (this check was "
                           "running)" if title == running else f"did not run: the cell stopped "
                           f"in check '{running}' ({stop})"})
        else:
            checks.append({"check": title, "passed": False, "hint": missing})
    return {"checks": checks, "error": error, "shown": shown, "running": running,
            "hints": sum(v[2] is not None for v in verdicts)}


def score(ran, committed) -> dict:
    """Per checked cell and in total: checks passed, failures with their hints."""
    cells, earlier, stop = [], None, False
    ran_checked = dict(checked_cells(ran))
    for i, cell in enumerate(ran.cells):
        if cell.cell_type != "code":
            continue
        if i not in ran_checked:
            errs = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
            if errs and earlier is None:
                earlier = error_reason(errs[0])
                stop = errs[0].get("ename") in (TIMED_OUT, EXITED)
                if stop:
                    first = (cell.source.strip().splitlines() or [""])[0][:80]
                    earlier = f"(cell {i}: {first}) {earlier}"
            continue
        cells.append({"cell": i, **score_cell(cell, committed_titles(committed.cells[i]),
                                              earlier, stop)})
    checks = [c for cell in cells for c in cell["checks"]]
    return {"passed": sum(c["passed"] for c in checks), "total": len(checks),
            "failures": [{"check": c["check"], "hint": c["hint"]} for c in checks
                         if not c["passed"]],
            "cells": [{"cell": c["cell"], "checks": len(c["checks"]),
                       "passed": sum(x["passed"] for x in c["checks"]), "error": c["error"],
                       "hints": c["hints"], "shown": c["shown"]} for c in cells]}


# ---- running a notebook ------------------------------------------------------------------------
def grade_one(ex: Exercise, *, solutions: bool = False, submission: Path | None = None,
              timeout: float = 240, hints: dict[str, str] | None = None) -> dict:
    """Score one exercise notebook (see the module docstring); ``hints``: the kernel's
    ``EDU3D_HINT_*`` variables."""
    committed = _read(ex.path)
    ran = copy.deepcopy(committed)
    graded = [submission or EXERCISES, ROOT / "solutions"]
    with tempfile.TemporaryDirectory(prefix="edu3d-grade-") as tmp:
        runs, cwd = Path(tmp) / "runs", Path(tmp) / "work"
        runs.mkdir()
        cwd.mkdir()
        stopped = execute(ran, kernel_env(solutions, submission, runs, hints), cwd, timeout,
                          graded)
    if stopped:  # cells the kernel never ran fail with that reason, naming where it died
        died = [score_cell(c, committed_titles(committed.cells[i]), None)["running"]
                for i, c in checked_cells(ran) if any(o.get("ename") == EXITED
                                                      for o in c.get("outputs", []))]
        stopped += f", check '{died[0]}'" if died and died[0] else ""
        for i, cell in checked_cells(ran):
            if cell.execution_count is None and not cell.get("outputs"):
                cell.outputs = [{"output_type": "error", "ename": STOPPED,
                                 "evalue": stopped, "traceback": []}]
    out = {"notebook": f"exercises/{ex.path.name}", "modules": list(ex.modules), **score(
        ran, committed)}
    if submission is not None:
        out["from_submission"] = [m for m in ex.modules if (submission / f"{m}.py").is_file()]
        out["stubs"] = [m for m in ex.modules if m not in out["from_submission"]]
    return out


def grade(chosen: list[Exercise], *, solutions: bool = False, submission: Path | None = None,
          timeout: float = 240, progress=sys.stderr, hint_level: int | None = None,
          counts: dict | None = None) -> dict:
    """Grade ``chosen``; a report ``{"graded", "passed", "total", "exercises": {name: ...}}``.
    ``counts`` (:func:`edu3d.commands.grade_hints.load`): earlier failures per check, updated
    in place with this run's (not with ``solutions``)."""
    report = {"graded": "solutions" if solutions else str(submission) if submission else
              "exercises", "passed": 0, "total": 0, "exercises": {}}
    target = str(submission or EXERCISES)
    for k, ex in enumerate(chosen, 1):
        t0 = time.perf_counter()
        if progress:
            print(f"[{k}/{len(chosen)}] {ex.name} ...", end="", file=progress, flush=True)
        hints = {"EDU3D_HINT_LEVEL": str(hint_level or 1)}
        if counts is not None and not solutions:
            hints["EDU3D_HINT_PRIOR"] = json.dumps(grade_hints.prior(counts, target, ex.name))
        r = grade_one(ex, solutions=solutions, submission=submission, timeout=timeout,
                      hints=hints)
        if counts is not None and not solutions:
            grade_hints.record(counts, target, ex.name, r)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        report["exercises"][ex.name] = r
        report["passed"] += r["passed"]
        report["total"] += r["total"]
        if progress:
            print(f" {r['passed']}/{r['total']} passed ({r['seconds']:.0f} s)", file=progress,
                  flush=True)
    return report


def table(report: dict, width: int = 100) -> str:
    """The score table: one row per exercise, and under it every failed check with its hint
    (a hint equal to the one above it is said so, not repeated)."""
    name_w = max([len("exercise")] + [len(n) for n in report["exercises"]])
    head = f"{'exercise':<{name_w}}  passed  total  failed checks"
    rule = "-" * min(width, max(len(head), 40))
    lines = [f"graded: {report['graded']}", head, rule]
    for name, r in report["exercises"].items():
        fails = r["failures"]
        lines.append(f"{name:<{name_w}}  {r['passed']:>6}  {r['total']:>5}  "
                     + (f"{len(fails)} failed" if fails else "all passed"))
        last = None
        for f in fails:
            lines += textwrap.wrap(f"FAIL {f['check']}", width, initial_indent="  ",
                                   subsequent_indent="      ")
            said = SAME if f["hint"] == last else f["hint"]
            lines += textwrap.wrap(f"hint: {said}", width, initial_indent="    ",
                                   subsequent_indent="      ")
            last = f["hint"]
    lines += [rule, f"{'total':<{name_w}}  {report['passed']:>6}  {report['total']:>5}"]
    return "\n".join(lines)


# ---- the command -------------------------------------------------------------------------------
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
    p.add_argument("--hint-level", type=between(1, 3), default=None, metavar="N",
                   help="hint tier for every failure: 1 the concept, 2 a closer nudge, 3 the "
                        "answer's shape (default: deeper each time a check fails again)")
    p.set_defaults(func=main)


def main(args) -> int:
    try:
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401
    except ImportError as err:
        print(f"edu3d grade: {err.name} is missing; pip install nbclient ipykernel",
              file=sys.stderr)
        return 2
    try:
        everything = exercises()
        chosen = select(args.exercise, everything)
        folder = None
        if args.submission is not None:
            folder = submission_folder(args.submission, {m for e in everything
                                                         for m in e.modules})
    except GradeError as err:
        print(f"edu3d grade: {err}", file=sys.stderr)
        return 2
    counts = None if args.solutions else grade_hints.load()
    report = grade(chosen, solutions=args.solutions, submission=folder, timeout=args.timeout,
                   hint_level=args.hint_level, counts=counts)
    if counts is not None:
        try:
            grade_hints.save(counts)
        except (OSError, RunsError) as err:
            print(f"edu3d grade: could not keep the hint counts ({err})", file=sys.stderr)
    print(json.dumps(report) if args.json else table(report))
    return 0 if report["total"] and report["passed"] == report["total"] else 1
