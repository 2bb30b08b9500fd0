"""Every exercise fails its most likely wrong answers and passes its reference.

For each exercise module, three wrong submissions or more (a fourth where a grader hole was
found, one for a design part): the reference solution with one function
replaced by a mistake a learner is likely to make (a definition appended to the solution's
source overrides it). Each is graded the way ``edu3d grade --submission DIR`` grades it: the
exercise notebook's own cells run top to bottom with ``EDU3D_SUBMISSION=DIR`` (so
:func:`edu3d.course.grading.load`, in this process and in every rank a check launches, loads
the wrong module), and the ``PASS``/``FAIL`` lines its checks print are read. The cells run
in this process (warm ranks for the launches, see tests/conftest.py) and stop at the first
checked cell where the wrong answer's check failed: no kernel per notebook, no checks after
the one that matters, so 45 wrong answers take about half a minute instead of three full
``edu3d grade`` runs (14 minutes on two shared cores).

* the reference (``EDU3D_SOLUTIONS=1``) runs the same way first, every cell: it prints
  ``PASS`` for exactly the checks the cells declare (what ``edu3d grade`` counts), no
  ``FAIL``;
* each wrong answer fails at least the check named here (a word of its title);
* once through the command itself: ``edu3d grade EXERCISE --submission DIR --json`` on one
  small exercise (a fresh kernel, the instructor's path) fails the wrong answer, exit code 1.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import nbformat
import pytest

from edu3d.course.autograde.scoring import exercises
from edu3d.course import nbtools

from .test_grading import edu3d_grade
from .wrong_submissions import WRONG

ROOT = Path(__file__).resolve().parent.parent

def test_every_exercise_module_has_three_wrong_answers():
    """Three likely mistakes each, and more where a grader hole was found (a dtype, padding or
    group that the first cases did not expose) or a design part was added."""
    modules = {p.stem for p in (ROOT / "exercises").glob("*.py")}
    assert set(WRONG) == modules, set(WRONG) ^ modules
    assert all(len(w) >= 3 for w in WRONG.values())


def notebook_of(module: str) -> Path:
    found = [e.path for e in exercises() if module in e.modules]
    assert len(found) == 1, f"{module}: loaded by {found}"
    return found[0]


def declared_passes(path: Path) -> list[str]:
    """``PASS <title>`` for every check the notebook's cells declare, in order."""
    cells = nbformat.read(path, as_version=4).cells
    return [f"PASS {t}" for c in cells if nbtools.is_checked(c)
            for t in nbtools.declared(c) or []]


def run_cells(path: Path, failed: str | None = None) -> list[str]:
    """Run the notebook's code cells here, in one namespace as a kernel would; the verdict
    lines they printed. ``failed``: stop after the first checked cell that printed a
    ``FAIL`` line with this word."""
    namespace: dict = {"__name__": "__main__"}
    out, err = io.StringIO(), io.StringIO()
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(compile(cell.source, f"{path.name} cell {i}", "exec"), namespace)  # noqa: S102
        lines = [ln for ln in out.getvalue().splitlines() if ln.startswith(("PASS ", "FAIL "))]
        if failed and nbtools.is_checked(cell) and any(
                ln.startswith("FAIL ") and failed in ln for ln in lines):
            break
    return lines


def submission(tmp: Path, module: str, k: int) -> Path:
    folder = tmp / f"wrong{k}"
    folder.mkdir()
    _, code, _ = WRONG[module][k]
    source = (ROOT / "solutions" / f"{module}.py").read_text()
    (folder / f"{module}.py").write_text(f"{source}\n\n# a likely wrong answer\n{code}")
    return folder


@pytest.fixture
def kernel_like(tmp_path, monkeypatch):
    """What ``edu3d grade`` gives a notebook's kernel: its own folder and runs, no status."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EDU3D_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("EDU3D_PROGRESS", "0")
    monkeypatch.delenv("EDU3D_SUBMISSION", raising=False)
    for var in ("EDU3D_HINT_LEVEL", "EDU3D_HINT_PRIOR"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.timeout(600)
@pytest.mark.parametrize("module", sorted(WRONG))
def test_the_reference_passes_and_each_wrong_answer_fails(module, tmp_path, kernel_like):
    path = notebook_of(module)
    kernel_like.setenv("EDU3D_SOLUTIONS", "1")
    assert run_cells(path) == declared_passes(path), f"{path.name}: the reference"
    kernel_like.setenv("EDU3D_SOLUTIONS", "0")
    for k, (why, _, word) in enumerate(WRONG[module]):
        kernel_like.setenv("EDU3D_SUBMISSION", str(submission(tmp_path, module, k)))
        lines = run_cells(path, failed=word)
        assert any(ln.startswith("FAIL ") and word in ln for ln in lines), \
            f"{path.name}: the wrong answer '{why}' passed every check with '{word}':\n" \
            + "\n".join(lines)


@pytest.mark.timeout(300)
def test_edu3d_grade_fails_a_wrong_submission(tmp_path):
    """The instructor's command, end to end, on one small exercise (no launch): exit code 1
    and the wrong answer's check among the failures, each with its hint."""
    module = "cp_merge"
    why, _, word = WRONG[module][0]
    code, out, err = edu3d_grade(module, "--submission", str(submission(tmp_path, module, 0)),
                                 "--json", env={"EDU3D_RUNS": str(tmp_path / "runs")},
                                 timeout=280)
    assert code == 1, err[-2000:]
    (result,) = json.loads(out)["exercises"].values()
    assert result["from_submission"] == [module], result
    assert 0 < result["passed"] < result["total"], result
    failed = [f for f in result["failures"] if word in f["check"]]
    assert failed and all(len(f["hint"]) > 20 for f in failed), f"'{why}' passed: {result}"
