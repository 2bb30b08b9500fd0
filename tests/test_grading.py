"""The grader is honest both ways, for every exercise notebook in exercises/.

* with the reference solutions (``EDU3D_SOLUTIONS=1``) every checked cell prints only
  ``PASS`` lines, exactly the checks the cell declares (its metadata: the committed notebooks
  store no output, so a learner sees no green line before any work; every exercise is
  executed and compared with its declarations in tests/test_browser_exercises.py, and
  ``edu3d grade --solutions`` runs one here);
* with the untouched stubs (``EDU3D_SOLUTIONS=0``) every check line is ``FAIL``: a learner
  can never pass by leaving the exercise as it is; and every failure says why in one hint
  line (no traceback through the grader, no stray ``True``/``False`` value). That run is
  ``edu3d grade --json`` itself, once for all the notebooks (each in a fresh kernel), so the
  command a learner and an instructor use is the one proven here.

Plus unit tests of :func:`edu3d.course.grading.load` and :func:`edu3d.course.grading.check`, and
a reading of every notebook: each check runs a test written in its cells, the only kind
``edu3d grade``'s verdict channel accepts.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from edu3d.course import nbtools
from edu3d.course import grading

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "exercises").glob("*.ipynb"))


def checked(nb) -> list:
    return [c for c in nb.cells if nbtools.is_checked(c)]


def edu3d_grade(*args: str, env: dict | None = None, timeout: float = 900):
    """``edu3d grade ARGS`` as a learner types it; (exit code, stdout, stderr)."""
    run = subprocess.run([sys.executable, "-m", "edu3d.cli", "grade", *args],
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return run.returncode, run.stdout, run.stderr


@pytest.fixture(scope="module")
def stubs_graded(tmp_path_factory):
    """``edu3d grade --json`` on the untouched stubs: every notebook once, in its own kernel."""
    env = {"EDU3D_SOLUTIONS": "0", "EDU3D_RUNS": str(tmp_path_factory.mktemp("runs"))}
    code, out, err = edu3d_grade("--json", env=env)
    return code, json.loads(out), err


def test_there_are_exercise_notebooks():
    assert NOTEBOOKS, "no exercises/*.ipynb found"
    for path in NOTEBOOKS:
        assert checked(nbformat.read(path, as_version=4)), f"{path.name} has no checked cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_check_cell_declares_its_checks_and_shows_no_pass(path):
    """Every checked cell of a committed exercise declares the checks it runs (the titles
    ``edu3d grade`` counts against) and stores no output: no ``PASS`` line before the
    learner wrote anything. Running the solutions is the browser test's
    (tests/test_browser_exercises.py executes every exercise with ``EDU3D_SOLUTIONS=1`` and
    compares each checked cell's printed lines with its declaration: a FAIL line, a hint on
    stderr or a value would differ), so the notebooks are not executed a second time here."""
    for cell in checked(nbformat.read(path, as_version=4)):
        titles = nbtools.declared(cell)
        assert titles and all(isinstance(t, str) and t for t in titles), cell.source
        assert len(set(titles)) == len(titles), f"{path.name}: a title repeats: {titles}"
        assert not cell.outputs and cell.execution_count is None, cell.source


def test_edu3d_grade_passes_an_exercise_with_the_solutions(tmp_path):
    """``edu3d grade --solutions``, the instructor's check of the reference, passes every
    declared check of an exercise (the smallest one launching no rank: the scoring is the
    same for all, and every exercise's solutions run in the browser test)."""
    code, out, err = edu3d_grade("08", "--solutions", "--json",
                                 env={"EDU3D_RUNS": str(tmp_path / "runs")}, timeout=280)
    assert code == 0, err[-2000:]
    (result,) = json.loads(out)["exercises"].values()
    declared = sum(len(nbtools.declared(c)) for c in checked(nbformat.read(
        ROOT / "exercises" / "08_checkpoints.ipynb", as_version=4)))
    assert result["passed"] == result["total"] == declared > 0, result


# the first test to ask for ``stubs_graded`` waits for all the notebooks (about 30 s on an
# idle machine): give it the time nine tests of one notebook each had together
GRADE_ALL = pytest.mark.timeout(900)


@GRADE_ALL
def test_edu3d_grade_fails_the_untouched_stubs_with_exit_code_1(stubs_graded):
    code, report, err = stubs_graded
    assert code == 1, err
    assert report["graded"] == "exercises" and report["passed"] == 0 < report["total"]
    assert list(report["exercises"]) == [p.stem for p in NOTEBOOKS]
    progress = [ln for ln in err.splitlines() if ln.startswith("[")]
    assert len(progress) == len(NOTEBOOKS) and all(" 0/" in ln for ln in progress), err


@GRADE_ALL
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_untouched_stubs_fail_every_check(path, stubs_graded):
    """Every check a cell declares (the ones the solutions pass) fails on the stubs, each
    failure with its own one-line hint printed under it by the notebook, and no checked
    cell shows anything but verdicts."""
    graded = stubs_graded[1]["exercises"][path.stem]
    committed = checked(nbformat.read(path, as_version=4))
    assert graded["total"] == sum(len(nbtools.declared(c)) for c in committed) > 0
    assert graded["passed"] == 0 and len(graded["failures"]) == graded["total"], graded
    for cell in graded["cells"]:
        assert cell["error"] is None, cell  # the notebook ran; its checks said FAIL
        assert cell["hints"] == cell["checks"], f"one hint per failure: {cell}"
        assert cell["shown"] == 0, f"a checked cell displayed a value: {cell}"
    hints = [f["hint"] for f in graded["failures"]]
    assert all(len(h) > 20 for h in hints), hints
    assert not any("Traceback" in h or 'File "' in h for h in hints), hints


def test_every_check_runs_a_test_written_in_the_notebook():
    """``edu3d grade`` counts a check's record only when its test is code of the notebook's
    own cells (:mod:`edu3d.course.verdict_channel`): a lambda or a function a cell defines,
    passed to ``grading.check`` from a cell. A test imported from a module would fail there
    even with the solutions, so none is."""
    for path in NOTEBOOKS:
        cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        trees = [ast.parse(c.source) for c in cells]
        defined = {n.name for t in trees for n in ast.walk(t) if isinstance(n, ast.FunctionDef)}
        for tree in trees:
            for call in ast.walk(tree):
                if isinstance(call, ast.Call) and ast.unparse(call.func) == "grading.check":
                    test = call.args[1] if len(call.args) > 1 else None
                    assert isinstance(test, ast.Lambda) or (
                        isinstance(test, ast.Name) and test.id in defined), \
                        f"{path.name}: {ast.unparse(call)[:120]}"


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


def test_check_prints_one_verdict_and_one_hint(capsys):
    assert bool(grading.check("returns None", lambda: None)) is True
    assert bool(grading.check("returns False", lambda: False, hint="look at x")) is False

    def stub():
        raise NotImplementedError("hint: do it")

    def wrong():
        assert 1 == 2, "rank 0 sent 0 B, expected 5040"

    assert not grading.check("stub", stub, hint="never shown: the stub's hint wins")  # now shown
    assert not grading.check("broken", lambda: 1 / 0)
    assert not grading.check("wrong", wrong, hint="count the sends")
    assert not grading.check("false, no hint", lambda: False)
    out, err = capsys.readouterr()
    assert out.splitlines() == ["PASS returns None", "FAIL returns False", "FAIL stub",
                                "FAIL broken", "FAIL wrong", "FAIL false, no hint"]
    assert err.splitlines() == [
        "  hint: look at x",
        "  hint: not written yet: do it. Look at: never shown: the stub's hint wins",
        "  hint: ZeroDivisionError: division by zero",
        "  hint: rank 0 sent 0 B, expected 5040. Look at: count the sends",
        "  hint: the check found a wrong result"]


def test_check_names_the_learners_line_not_the_graders(capsys):
    ex = grading.load("ranks", solutions=False)
    assert not grading.check("stub", lambda: ex.coords_of(0, 1, 1, 1))
    _, err = capsys.readouterr()
    assert err.startswith("  hint: not written yet (exercises/ranks.py, line ")
    assert "in coords_of): turn the rank number back" in err and "Traceback" not in err


def test_a_failed_run_is_one_line():
    from edu3d.launch.api import RankError

    err = RankError(2, "NotImplementedError: hint: chunks = ...", "Traceback (most recent "
                    "call last):\n  File \"x.py\", line 3, in f\nNotImplementedError: hint: "
                    "chunks = ...")
    assert grading._reason(err) == "not written yet: chunks = ..."
    err = RankError(1, "RuntimeError: boom", "Traceback (most recent call last):\n  File "
                    "\"/work/edu3d/ring.py\", line 9, in g\nRuntimeError: boom")
    assert grading._reason(err) == "rank 1 failed: RuntimeError: boom"


def test_the_same_hint_is_printed_once_per_cell(capsys, monkeypatch):
    cells = iter([7, 7, 7, 8])
    monkeypatch.setattr(grading, "_cell", lambda: next(cells))

    def stub():
        raise NotImplementedError("hint: write coords_of")

    for _ in range(4):
        grading.check("stub", stub)
    _, err = capsys.readouterr()
    assert err.splitlines() == ["  hint: not written yet: write coords_of",
                                "  hint: the same as above", "  hint: the same as above",
                                "  hint: not written yet: write coords_of"]


def test_a_stub_is_found_without_running_it(monkeypatch):
    monkeypatch.delenv("EDU3D_SOLUTIONS", raising=False)
    assert "not written yet (exercises/ring_allreduce.py)" in grading.unfinished(
        "ring_allreduce", "ring_all_reduce")
    assert grading.unfinished("ring_allreduce", "exchange") is None  # given, not a stub
    assert "BucketedDDP" in grading.unfinished("bucketed_ddp", "BucketedDDP")
    monkeypatch.setenv("EDU3D_SOLUTIONS", "1")
    assert grading.unfinished("ring_allreduce", "ring_all_reduce") is None
    assert grading.unfinished("bucketed_ddp", "BucketedDDP") is None


def test_a_verdict_shows_no_value_in_a_notebook():
    v = grading.check("quiet", lambda: None)
    assert hasattr(v, "_ipython_display_") and v._ipython_display_() is None
    assert repr(v) == "PASS quiet"


def test_solution_matches_layout_everywhere():
    from edu3d.config.layout import Layout

    sol = grading.load("ranks", solutions=True)
    for dp, tp, pp in [(1, 1, 1), (2, 2, 2), (3, 2, 4), (1, 8, 1), (5, 1, 3)]:
        layout = Layout(dp=dp, tp=tp, pp=pp)
        for r in range(layout.world_size):
            assert sol.coords_of(r, dp, tp, pp) == tuple(layout.coords(r))
            for dim in ("tp", "dp", "pp"):
                assert sol.group_members(r, dim, dp, tp, pp) == layout.group_of(r, dim)


# ---- exercise 06: the 3D grader catches the classic wrong norm ---------------------------------
def test_grad_norm_3d_stubs_are_found_and_the_buggy_norm_is_given(monkeypatch):
    monkeypatch.delenv("EDU3D_SOLUTIONS", raising=False)
    assert "not written yet (exercises/grad_norm_3d.py)" in grading.unfinished(
        "grad_norm_3d", "global_grad_norm")
    assert grading.unfinished("grad_norm_3d", "sum_tied_embedding_grads")
    assert grading.unfinished("grad_norm_3d", "buggy_global_grad_norm") is None  # given
    monkeypatch.setenv("EDU3D_SOLUTIONS", "1")
    assert grading.unfinished("grad_norm_3d", "global_grad_norm") is None
    assert grading.unfinished("grad_norm_3d", "sum_tied_embedding_grads") is None


def test_grad_norm_3d_grader_rejects_the_replicated_layernorm_counted_tp_times(monkeypatch,
                                                                               tmp_path):
    from edu3d.course import ch06_3d_parallelism_grade

    monkeypatch.setenv("EDU3D_SOLUTIONS", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("EDU3D_RUNS", str(tmp_path))
    r = ch06_3d_parallelism_grade.run(use={"global_grad_norm": "buggy_global_grad_norm"})
    assert r["tied"] is True and r["norm"] is False, r
    assert r["buggy_norm"] > r["serial_norm"] * 1.01, r  # too large, not a rounding matter
    assert abs(r["library_norm"] - r["serial_norm"]) <= 1e-4 * r["serial_norm"], r


# ---- exercise 08: the resharding grader catches a piece written as if it began its box --------
def test_reshard_grader_catches_a_zero_piece_written_at_the_box_start(monkeypatch):
    import torch

    from edu3d.course import ch08_checkpoints_grade as g

    monkeypatch.delenv("EDU3D_SOLUTIONS", raising=False)
    assert "not written yet (exercises/reshard.py)" in grading.unfinished("reshard",
                                                                          "full_tensor")
    assert grading.unfinished("reshard", "piece_for")
    sol = grading.load("reshard", solutions=True)

    class Buggy:  # ignores "flat": every piece written from the first element of its box
        piece_for = staticmethod(sol.piece_for)

        @staticmethod
        def full_tensor(pieces):
            full = torch.zeros(pieces[0][0]["shape"])
            for place, data in pieces:
                block = full[tuple(slice(a, b) for a, b in place["box"])]
                flat = block.reshape(-1).clone()
                flat[: data.numel()] = data
                block.copy_(flat.view(block.shape))
            return full

    assert g.rebuilds(Buggy, g.QKV, tp=2)  # whole TP boxes: the bug does not show
    with pytest.raises(AssertionError, match="differ from the serial tensor"):
        g.rebuilds(Buggy, g.PROJ, tp=2, dp=2, zero=True)  # ZeRO runs start mid-box: it does
    assert g.rebuilds(sol, g.PROJ, tp=2, dp=2, zero=True)


# ---- exercise 07: the memory grader catches the classic mistakes --------------------------------
def test_rank_memory_grader_catches_the_classic_mistakes():
    """Dividing LayerNorms by tp too, leaving ZeRO-2's gradients whole, and 1F1B keeping pp
    micro-batches on every rank each fail their check, with a message naming the case."""
    from types import SimpleNamespace

    from edu3d.course import ch07_memory_grade as g

    sol = grading.load("rank_memory", solutions=True)
    for check in (g.check_counts, g.check_state,
                  g.check_in_flight):
        check(sol)

    def all_split(L, h, V, s, tp, pp, r, tied=False):
        return sol.rank_params(L, h, V, s, 1, pp, r, tied) // tp

    def grads_whole(n, dp, zero):
        return {**sol.state_bytes(n, dp, zero), "grads": 4 * n / (dp if zero >= 3 else 1)}

    wrong = SimpleNamespace(rank_params=all_split, state_bytes=grads_whole,
                            in_flight=lambda s, pp, m, r: m if s == "gpipe" else min(m, pp))
    with pytest.raises(AssertionError, match=r"tp=2, pp=1, tied=False: pp rank 0 holds"):
        g.check_counts(wrong)
    with pytest.raises(AssertionError, match=r"dp=2 ZeRO-2: grads should be about"):
        g.check_state(wrong)
    with pytest.raises(AssertionError, match=r"1f1b, pp=2, m=2: pp rank 1 keeps 1"):
        g.check_in_flight(wrong)
