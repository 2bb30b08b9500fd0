"""The grading engine behind ``edu3d grade``: run the exercise notebooks and count their verdicts.

After reading this file you should know how a score is made:

* each exercise notebook (``exercises/NN_name.ipynb`` of this checkout) runs top to bottom in
  a fresh kernel (nbclient), in memory: nothing is written back, the kernel works in a
  temporary folder and its runs go to a temporary ``EDU3D_RUNS``;
* the code graded is the learner's ``exercises/*.py`` (default), the reference solutions
  (``--solutions``: ``EDU3D_SOLUTIONS=1``), or one learner's folder (``--submission DIR``:
  ``EDU3D_SUBMISSION=DIR``, see :func:`edu3d.course.grading.source`; a module the folder lacks is
  graded as the untouched stub, so its checks fail). Nothing from ``DIR`` runs except the
  exercise modules the notebooks import, and nothing is written into it;
* the checks are what :func:`edu3d.course.grading.check` reports over the verdict channel
  (:mod:`edu3d.course.verdict_channel`, :mod:`edu3d.course.autograde.channel`), never the
  ``PASS``/``FAIL`` lines the checked cells (tag ``nbval-check-output``) print: those are the
  submission's to forge. Each checked cell of the checkout's notebook declares its checks'
  titles in order (its metadata, :func:`edu3d.course.nbtools.declared`; the committed
  notebooks store no ``PASS`` lines, which would show a learner green lines before any
  work): a record that is not the cell's next check is ignored, a check without a record
  fails (one that printed a verdict anyway says so), and a cell that stops on an error
  counts its missing checks as failed, with the error's one-line reason;
* hints are tiered (concept, nudge, the answer's shape): each run counts every check's
  failures in edu3d's own state file, so grading a still-failing exercise again shows a
  closer hint; ``--hint-level N`` asks for tier N at once (:mod:`edu3d.course.autograde.hints`);
* a submission that loops past ``--timeout`` or kills its kernel (``os._exit``, a crash) is
  named as such (:mod:`edu3d.course.autograde.kernel`): the check that was running gets the
  limit or the exit code and the line of the learner's file, the checks after it in its
  cell say they did not run; after a timeout the next cells still run, after a dead kernel
  they cannot, and each says so;
* the submission's processes end with its grade: after the kernel, the grader kills every
  process it left (:mod:`edu3d.course.autograde.processes`), before the report is written; the
  kernel runs in a fresh temporary home and working folder, and with ``--isolate`` in Linux
  namespaces without privileges (:mod:`edu3d.course.autograde.isolate`). What it wrote into
  the report's own file meanwhile is cut off (:mod:`edu3d.course.autograde.report`).

:func:`grade` returns the report (:func:`~edu3d.course.autograde.report.table` prints it);
``edu3d grade`` (:mod:`edu3d.commands.grade`) is its command line. Bad input (an unknown
exercise, a folder without exercise modules) is a :class:`GradeError`, raised before any
kernel starts.

nbformat and nbclient come in through imports inside functions: they are optional (the
course's notebook extras), and a missing one is reported as one line with how to install it.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from edu3d.course.autograde import hints as grade_hints
from edu3d.course.autograde import isolate as grade_isolate
from edu3d.course.autograde.channel import Channel
from edu3d.course.autograde.kernel import EXITED, STOPPED, TIMED_OUT, execute, kernel_env
from edu3d.course.autograde.processes import Watch
from edu3d.course import nbtools
from edu3d.course.grading import ROOT

EXERCISES = ROOT / "exercises"
MARK = "# NBVAL_CHECK_OUTPUT"


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


def declared_titles(cell) -> list[str]:
    """The check titles a checked cell of the checkout's notebook declares, in order (never
    what a run printed: that is the submission's to write)."""
    return nbtools.declared(cell) or []


def error_reason(output) -> str:
    """One line for a cell's error output: ``NameError: name 'x' is not defined``."""
    value = (output.get("evalue") or "").strip().splitlines()
    if output.get("ename") in (TIMED_OUT, EXITED, STOPPED) and value:
        return value[0]  # the grader's own words
    text = f"{output.get('ename', 'error')}: {value[0]}" if value else output.get("ename", "")
    return text if len(text) <= 300 else text[:300] + " ..."


def printed(cell) -> list[str]:
    """The verdict lines a cell printed (``PASS t``/``FAIL t``): shown, never counted."""
    text = "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")
    return [ln for ln in text.splitlines() if ln.startswith(("PASS ", "FAIL "))]


def score_cell(cell, titles: list[str], records: list[dict], earlier_error: str | None,
               earlier_stop: bool = False, silent: str | None = None) -> dict:
    """Verdicts of one executed checked cell: its ``records`` from the verdict channel
    against its declared ``titles``. A cell the grader stopped (a timeout, a dead kernel)
    blames the check that was running and says so for the checks after it; ``earlier_stop``:
    ``earlier_error`` stopped an earlier cell, and every failure here says so too;
    ``silent``: why the channel said nothing (the kernel never opened it)."""
    verdicts: list[list] = []  # [passed, title, hint]
    for rec in records:  # the next check of the cell (any other record is ignored)
        if len(verdicts) < len(titles) and rec["title"] == titles[len(verdicts)]:
            verdicts.append([rec["passed"], rec["title"], rec["hint"]])
    error, shown, stop = None, 0, None
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "error":
            error = error_reason(out)
            stop = error if out.get("ename") in (TIMED_OUT, EXITED) else None
        elif kind != "stream":
            shown += 1  # a displayed value under a checked cell: not a verdict
    lines = printed(cell)
    reported = Counter(v[1] for v in verdicts if v[0])
    unreported = Counter(ln[5:] for ln in lines if ln.startswith("PASS ")) - reported
    if error and earlier_error:
        error = f"{error} (after an earlier cell failed: {earlier_error})"
    missing = error or earlier_error or silent or "the check did not run"
    running = titles[len(verdicts)] if len(verdicts) < len(titles) else None
    after = f" (after an earlier cell {earlier_error})" if earlier_stop else ""
    said = {ln[5:] for ln in lines}
    checks = []
    for i, title in enumerate(titles):
        if i < len(verdicts):
            ok, title, hint = verdicts[i]
            checks.append({"check": title, "passed": ok,
                           "hint": None if ok else (hint or "no hint given") + after})
        elif stop:
            checks.append({"check": title, "passed": False, "hint": f"{stop} (this check was "
                           "running)" if title == running else f"did not run: the cell stopped "
                           f"in check '{running}' ({stop})"})
        elif title in said and not (error or earlier_error or silent):
            checks.append({"check": title, "passed": False, "hint": (
                "the notebook printed a verdict for this check, but the checker reported none "
                "to the grader (was edu3d.course.grading.check replaced?)")})
        else:
            checks.append({"check": title, "passed": False, "hint": missing})
    return {"checks": checks, "error": error, "shown": shown, "running": running,
            "hints": sum(not ok and hint is not None for ok, _, hint in verdicts),
            "unreported": sum(unreported.values())}


def score(ran, committed, records: dict[int, list[dict]], silent: str | None = None) -> dict:
    """Per checked cell and in total: checks passed, failures with their hints, from the
    verdict channel's ``records`` (per cell index)."""
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
        cells.append({"cell": i, **score_cell(cell, declared_titles(committed.cells[i]),
                                              records.get(i, []), earlier, stop, silent)})
    checks = [c for cell in cells for c in cell["checks"]]
    return {"passed": sum(c["passed"] for c in checks), "total": len(checks),
            "failures": [{"check": c["check"], "hint": c["hint"]} for c in checks
                         if not c["passed"]],
            "unreported_passes": sum(c["unreported"] for c in cells),
            "cells": [{"cell": c["cell"], "checks": len(c["checks"]),
                       "passed": sum(x["passed"] for x in c["checks"]), "error": c["error"],
                       "hints": c["hints"], "shown": c["shown"]} for c in cells]}


# ---- running a notebook ------------------------------------------------------------------------
def grade_one(ex: Exercise, *, solutions: bool = False, submission: Path | None = None,
              timeout: float = 240, hints: dict[str, str] | None = None,
              isolate: bool = False) -> dict:
    """Score one exercise notebook (see the module docstring); ``hints``: the kernel's
    ``EDU3D_HINT_*`` variables; ``isolate``: run the kernel in namespaces
    (:mod:`edu3d.course.autograde.isolate`)."""
    committed = _read(ex.path)
    ran = copy.deepcopy(committed)
    graded = [submission or EXERCISES, ROOT / "solutions"]
    token = secrets.token_hex(16)
    # a short path: the kernel's sockets live there, and a Unix socket's path is short
    where = tempfile.gettempdir() if len(tempfile.gettempdir()) <= 40 else "/tmp"
    with tempfile.TemporaryDirectory(prefix="edu3d-grade-", dir=where) as tmp, \
            Watch(token) as watch:
        root = Path(tmp)
        runs, cwd, home = root / "runs", root / "work", root / "home"
        for folder in (runs, cwd, home):
            folder.mkdir()
        channel = Channel(root, [c.source for c in committed.cells if c.cell_type == "code"])
        try:
            stopped = execute(ran, kernel_env(solutions, submission, runs, hints, home, token),
                              cwd, timeout, graded, channel,
                              grade_isolate.prefix(root) if isolate else None)
        finally:
            channel.close()
            left = watch.sweep()  # before the folder goes, and before any report is written
    records, rejected = channel.records()
    silent = None if channel.connected else (
        "no verdict reached the grader: the kernel never opened its verdict channel"
        + (f" ({channel.refused[0]})" if channel.refused else ""))
    if stopped:  # cells the kernel never ran fail with that reason, naming where it died
        died = [score_cell(c, declared_titles(committed.cells[i]), records.get(i, []),
                           None)["running"]
                for i, c in checked_cells(ran) if any(o.get("ename") == EXITED
                                                      for o in c.get("outputs", []))]
        stopped += f", check '{died[0]}'" if died and died[0] else ""
        for i, cell in checked_cells(ran):
            if cell.execution_count is None and not cell.get("outputs"):
                cell.outputs = [{"output_type": "error", "ename": STOPPED,
                                 "evalue": stopped, "traceback": []}]
    out = {"notebook": f"exercises/{ex.path.name}", "modules": list(ex.modules), **score(
        ran, committed, records, silent), "rejected_records": rejected,
        "left_running": left["killed"], "survivors": left["survivors"]}
    if submission is not None:
        out["from_submission"] = [m for m in ex.modules if (submission / f"{m}.py").is_file()]
        out["stubs"] = [m for m in ex.modules if m not in out["from_submission"]]
    return out


def grade(chosen: list[Exercise], *, solutions: bool = False, submission: Path | None = None,
          timeout: float = 240, progress=sys.stderr, hint_level: int | None = None,
          counts: dict | None = None, isolate: bool = False) -> dict:
    """Grade ``chosen``; a report ``{"graded", "passed", "total", "exercises": {name: ...}}``.
    ``counts`` (:func:`edu3d.course.autograde.hints.load`): earlier failures per check, updated
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
                      hints=hints, isolate=isolate)
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
