"""The grader is honest both ways, for every exercise notebook in exercises/.

* with the reference solutions (``EDU3D_SOLUTIONS=1``) every checked cell prints only
  ``PASS`` lines, and they are exactly the lines committed in the notebook (what nbval
  compares);
* with the untouched stubs (``EDU3D_SOLUTIONS=0``) every check line is ``FAIL``: a learner
  can never pass by leaving the exercise as it is.

Plus unit tests of :func:`edu3d.grading.load` and :func:`edu3d.grading.check`.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from edu3d import grading

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "exercises").glob("*.ipynb"))
MARK = "# NBVAL_CHECK_OUTPUT"


def checked(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(MARK)]


def stdout_lines(cell) -> list[str]:
    text = "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")
    return text.splitlines()


def execute(path: Path, solutions: bool, monkeypatch, runs: Path) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh kernel that sees EDU3D_SOLUTIONS (the kernel
    inherits this process's environment; runs it launches go to ``runs``)."""
    nb = nbformat.read(path, as_version=4)
    monkeypatch.setenv("EDU3D_SOLUTIONS", "1" if solutions else "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("EDU3D_RUNS", str(runs))
    NotebookClient(nb, timeout=240, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def test_there_are_exercise_notebooks():
    assert NOTEBOOKS, "no exercises/*.ipynb found"
    for path in NOTEBOOKS:
        assert checked(nbformat.read(path, as_version=4)), f"{path.name} has no checked cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_solutions_pass_every_check(path, monkeypatch, tmp_path):
    ran = execute(path, True, monkeypatch, tmp_path)
    committed = checked(nbformat.read(path, as_version=4))
    for cell, stored in zip(checked(ran), committed, strict=True):
        lines = stdout_lines(cell)
        assert lines, f"a checked cell printed nothing:\n{cell.source}"
        assert all(line.startswith("PASS ") for line in lines), "\n".join(lines)
        assert lines == stdout_lines(stored), (
            f"{path.name}: committed outputs differ from the solution's; re-run it with "
            f"EDU3D_SOLUTIONS=1 and commit the checked cells' outputs")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_untouched_stubs_fail_every_check(path, monkeypatch, tmp_path):
    ran = execute(path, False, monkeypatch, tmp_path)
    committed = checked(nbformat.read(path, as_version=4))
    for cell, stored in zip(checked(ran), committed, strict=True):
        lines = stdout_lines(cell)
        assert len(lines) == len(stdout_lines(stored)), "\n".join(lines)
        assert all(line.startswith("FAIL ") for line in lines), "\n".join(lines)


# ---- grading.load / grading.check ------------------------------------------------------------
def test_load_picks_stubs_or_solutions(monkeypatch):
    monkeypatch.delenv("EDU3D_SOLUTIONS", raising=False)
    stub = grading.load("ranks")
    assert Path(stub.__file__).parent.name == "exercises"
    with pytest.raises(NotImplementedError, match="hint"):
        stub.coords_of(0, 1, 1, 1)
    monkeypatch.setenv("EDU3D_SOLUTIONS", "1")
    sol = grading.load("ranks")
    assert Path(sol.__file__).parent.name == "solutions"
    assert sol.coords_of(5, 2, 2, 2) == (1, 0, 1)
    assert grading.load("ranks", solutions=False).__file__ == stub.__file__
    with pytest.raises(FileNotFoundError, match="no_such_exercise"):
        grading.load("no_such_exercise")


def test_check_prints_one_verdict_and_the_reason_on_stderr(capsys):
    assert grading.check("returns None", lambda: None) is True
    assert grading.check("returns False", lambda: False) is False

    def stub():
        raise NotImplementedError("hint: do it")

    assert grading.check("stub", stub) is False
    assert grading.check("broken", lambda: 1 / 0) is False
    out, err = capsys.readouterr()
    assert out.splitlines() == ["PASS returns None", "FAIL returns False", "FAIL stub",
                                "FAIL broken"]
    assert "hint: do it" in err and "ZeroDivisionError" in err


def test_solution_matches_layout_everywhere():
    from edu3d.mesh import Layout

    sol = grading.load("ranks", solutions=True)
    for dp, tp, pp in [(1, 1, 1), (2, 2, 2), (3, 2, 4), (1, 8, 1), (5, 1, 3)]:
        layout = Layout(dp=dp, tp=tp, pp=pp)
        for r in range(layout.world_size):
            assert sol.coords_of(r, dp, tp, pp) == tuple(layout.coords(r))
            for dim in ("tp", "dp", "pp"):
                assert sol.group_members(r, dim, dp, tp, pp) == layout.group_of(r, dim)
