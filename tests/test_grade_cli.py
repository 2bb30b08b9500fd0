"""``edu3d grade``: an instructor's folder is graded, bad input stops before any kernel.

* ``--submission DIR`` with a copy of one solution module: that exercise passes every check,
  another (whose module the folder lacks: the untouched stub) fails every check, and the
  folder is left exactly as it was (no ``__pycache__``, no run folder);
* an unknown exercise, a missing folder, a folder without exercise modules, ``--solutions``
  with ``--submission``: exit code 2 and one line saying what to fix, and no kernel started;
* the scoring of executed cells from the verdict channel's records (a cell that stops on an
  error, an earlier cell's error, a printed verdict without a record, a channel that never
  opened) and :func:`edu3d.course.grading.load` with a submission.

The stub side of every notebook is in tests/test_grading.py (one ``edu3d grade --json``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from edu3d import cli
from edu3d.course import grading
from edu3d.course.autograde import scoring as grade

from .test_grading import edu3d_grade

ROOT = Path(__file__).resolve().parent.parent


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(folder.rglob("*"))}


@pytest.fixture
def no_kernel(monkeypatch):
    """Any attempt to run a notebook fails the test: bad input must stop before."""
    def refuse(*a, **k):
        raise AssertionError("a kernel was started")

    monkeypatch.setattr(grade, "execute", refuse)


# ---- a learner's folder --------------------------------------------------------------------------
def test_submission_with_one_solution_passes_that_exercise_only(tmp_path):
    sub = tmp_path / "alice"
    sub.mkdir()
    shutil.copy(ROOT / "solutions" / "ranks.py", sub / "ranks.py")
    before = snapshot(sub)
    code, out, err = edu3d_grade("00", "rank_memory", "--submission", str(sub), "--json",
                                 env={"EDU3D_RUNS": str(tmp_path / "runs")})
    assert code == 1, err
    report = json.loads(out)
    assert report["graded"] == str(sub.resolve())
    ranks, memory = report["exercises"]["00_ranks"], report["exercises"]["07_memory"]
    assert ranks["passed"] == ranks["total"] > 10 and not ranks["failures"], ranks
    assert ranks["from_submission"] == ["ranks"] and ranks["stubs"] == []
    assert memory["passed"] == 0 < memory["total"], memory
    assert memory["from_submission"] == [] and memory["stubs"] == ["rank_memory"]
    assert all("not written yet (exercises/rank_memory.py)" in f["hint"]
               for f in memory["failures"]), memory["failures"]
    assert snapshot(sub) == before  # nothing written into the learner's folder


def test_load_reads_the_submission_and_falls_back_to_the_stub(tmp_path, monkeypatch, capsys):
    sub = tmp_path / "bob"
    sub.mkdir()
    (sub / "ranks.py").write_text(
        "def coords_of(rank, dp, tp, pp):\n    return (0, 0, rank // 0)\n")
    (sub / "evil.py").write_text("raise SystemExit('never imported')\n")
    monkeypatch.delenv("EDU3D_SOLUTIONS", raising=False)
    monkeypatch.setenv("EDU3D_SUBMISSION", str(sub))
    mine = grading.load("ranks")
    assert Path(mine.__file__) == sub / "ranks.py"
    assert not grading.check("bob's coords_of", lambda: mine.coords_of(1, 1, 1, 1))
    assert capsys.readouterr().err.startswith(
        "  hint: ZeroDivisionError: integer division or modulo by zero (bob/ranks.py, line 2")
    stub = grading.load("zero1")  # not in bob's folder: the untouched stub
    assert Path(stub.__file__) == ROOT / "exercises" / "zero1.py"
    assert "(exercises/zero1.py)" in grading.unfinished("zero1", "shard_range")
    monkeypatch.setenv("EDU3D_SOLUTIONS", "1")  # the solutions win over a submission
    assert Path(grading.load("ranks").__file__) == ROOT / "solutions" / "ranks.py"
    with pytest.raises(ValueError, match="not an exercise module name"):
        grading.source("../bob/ranks")
    assert sorted(p.name for p in sub.iterdir()) == ["evil.py", "ranks.py"]  # no __pycache__


def test_a_learners_checkout_is_accepted_and_an_empty_folder_is_not(tmp_path):
    (tmp_path / "carol" / "exercises").mkdir(parents=True)
    (tmp_path / "carol" / "exercises" / "zero1.py").write_text("")
    mods = {"ranks", "zero1"}
    assert grade.submission_folder(tmp_path / "carol", mods) == tmp_path / "carol" / "exercises"
    with pytest.raises(grade.GradeError, match="holds none of the exercise modules"):
        grade.submission_folder(tmp_path, mods)


# ---- bad input: exit 2, no kernel ------------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["grade", "99"], "unknown exercise '99'"),
    (["grade", "00", "no_such"], "unknown exercise 'no_such'"),
    (["grade", "--submission", "/no/such/folder"], "no such folder"),
    (["grade", "--submission", "."], "holds none of the exercise modules"),
])
def test_bad_input_exits_2_before_any_kernel(argv, says, no_kernel, capsys, tmp_path,
                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("edu3d grade: ") and says in err and len(err.splitlines()) == 1


def test_solutions_and_submission_together_are_refused(no_kernel, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["grade", "--solutions", "--submission", "x"])
    assert exit_.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


def test_exercises_are_chosen_by_number_name_or_module():
    names = lambda *w: [e.name for e in grade.select(list(w))]  # noqa: E731
    assert names("03") == names("3") == names("zero1") == names("03_zero1") == ["03_zero1"]
    assert names("tp_layers", "00_ranks.ipynb", "00") == ["00_ranks", "04_tensor_parallel"]
    assert names() == [p.stem for p in sorted((ROOT / "exercises").glob("*.ipynb"))]
    assert all(e.modules for e in grade.exercises())  # every notebook grades some module


def test_exit_code_0_only_when_every_check_passes(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("EDU3D_RUNS", str(tmp_path))  # where edu3d grade keeps its hint counts
    def fake(chosen, **kw):
        passed = {"00_ranks": 3, "07_memory": 2}
        ex = {e.name: {"passed": passed[e.name], "total": 3, "failures": [] if
                       passed[e.name] == 3 else [{"check": "c", "hint": "h " * 60},
                                                 {"check": "d", "hint": "second hint"}]}
              for e in chosen}
        return {"graded": "exercises", "exercises": ex, "total": 3 * len(ex),
                "passed": sum(r["passed"] for r in ex.values())}

    monkeypatch.setattr(grade, "grade", fake)
    assert cli.main(["grade", "00"]) == 0
    assert cli.main(["grade", "00", "07"]) == 1
    out = capsys.readouterr().out
    assert "00_ranks        3      3  all passed" in out
    assert "07_memory       2      3  2 failed\n  FAIL c\n    hint: h h" in out
    assert "  FAIL d\n    hint: second hint" in out  # every failure with its own hint
    assert max(len(ln) for ln in out.splitlines()) <= 100  # long hints are wrapped


# ---- scoring executed cells ------------------------------------------------------------------------
def _cell(source, *outputs):
    return nbformat.v4.new_code_cell(source, outputs=[nbformat.from_dict(o) for o in outputs])


def _declaring(source, *titles):
    """A check cell of the checkout's notebook: it declares its checks, stores no output."""
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["edu3d"] = {"checks": list(titles)}
    return cell


def _out(name, text):
    return {"output_type": "stream", "name": name, "text": text}


def _rec(title, passed, hint=None):
    """A record of the verdict channel, as :mod:`edu3d.course.autograde.channel` returns it."""
    return {"n": 0, "title": title, "passed": passed, "hint": hint}


def test_a_cell_that_stops_fails_its_remaining_checks_with_the_reason():
    """... and a record out of order counts for nothing."""
    mark = grade.MARK + "\n"
    committed = nbformat.v4.new_notebook(cells=[
        _cell("setup"),
        _declaring(mark + "a", "one", "two", "three"),
        _declaring(mark + "b", "four")])
    ran = nbformat.v4.new_notebook(cells=[
        _cell("setup"),
        _cell(mark + "a", _out("stdout", "PASS one\nPASS three\n"), _out("stdout", "FAIL two\n"),
              _out("stderr", "  hint: look at x\n"),
              {"output_type": "error", "ename": "KeyError", "evalue": "'k'\nmore",
               "traceback": []}),
        _cell(mark + "b", _out("stdout", "FAIL four\n"), _out("stderr", "  hint: look at y\n"))])
    records = {1: [_rec("one", True), _rec("three", True), _rec("two", False, "look at x")],
               2: [_rec("four", False, "look at y")]}
    s = grade.score(ran, committed, records)
    assert (s["passed"], s["total"]) == (1, 4)
    assert s["failures"] == [{"check": "two", "hint": "look at x"},
                             {"check": "three", "hint": "KeyError: 'k'"},
                             {"check": "four", "hint": "look at y"}]
    assert [c["error"] for c in s["cells"]] == ["KeyError: 'k'", None]


def test_an_earlier_error_and_a_repeated_hint_are_reported():
    mark = grade.MARK + "\n"
    committed = nbformat.v4.new_notebook(cells=[
        _cell("ex = grading.load('x')"),
        _declaring(mark + "a", "one", "two")])
    ran = nbformat.v4.new_notebook(cells=[
        _cell("ex = ...", {"output_type": "error", "ename": "SyntaxError",
                           "evalue": "invalid syntax (x.py, line 3)", "traceback": []}),
        _cell(mark + "a", {"output_type": "error", "ename": "NameError",
                           "evalue": "name 'ex' is not defined", "traceback": []})])
    s = grade.score(ran, committed, {})
    assert s["passed"] == 0 and {f["hint"] for f in s["failures"]} == {
        "NameError: name 'ex' is not defined (after an earlier cell failed: SyntaxError: "
        "invalid syntax (x.py, line 3))"}
    ran.cells[1].outputs = [nbformat.from_dict(o) for o in (
        _out("stdout", "FAIL one\nFAIL two\n"), _out("stderr", "  hint: write f\n"),
        _out("stderr", "  hint: the same as above\n"))]
    s = grade.score(ran, committed, {1: [_rec("one", False, "write f"),
                                         _rec("two", False, "write f")]})
    assert [f["hint"] for f in s["failures"]] == ["write f", "write f"]


def test_printed_verdicts_count_for_nothing_without_a_record():
    """A cell that prints ``PASS`` lines the checker never reported (a forged line, a checker
    replaced outright) fails those checks and says so; the lines are counted as unreported."""
    mark = grade.MARK + "\n"
    committed = nbformat.v4.new_notebook(cells=[
        _declaring(mark + "a", "one", "two", "three")])
    ran = nbformat.v4.new_notebook(cells=[
        _cell(mark + "a", _out("stdout", "PASS one\nPASS two\nPASS three\n"))])
    s = grade.score(ran, committed, {0: [_rec("one", False, "write one")]})
    assert (s["passed"], s["unreported_passes"]) == (0, 3)
    assert s["failures"][0] == {"check": "one", "hint": "write one"}
    assert all("the checker reported none to the grader" in f["hint"]
               for f in s["failures"][1:]), s["failures"]
    silent = grade.score(ran, committed, {}, silent="no verdict reached the grader")
    assert {f["hint"] for f in silent["failures"]} == {"no verdict reached the grader"}
