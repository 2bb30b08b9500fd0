"""``edu3d grade`` on a submission that loops forever or kills its kernel.

Each is graded (exit 1, the other checks scored) and its hints say what happened and where:

* ``coords_of`` loops: exercise 00's first checked cell is interrupted at ``--timeout``; its
  running check says "timed out", the limit in seconds and the learner's line, the checks
  after it in that cell say they did not run, and the next cells still run and pass;
* ``group_members`` calls ``os._exit(3)``: the first cell's 11 checks pass, the running check
  says "exited with code 3" and the line, every check after it says it could not run;
* ``coords_of`` swallows the interrupt: its kernel is stopped at twice the limit and named;
* the scoring of a setup cell that timed out (no kernel): every later failure says so.

Exercise 00 is the cheapest notebook (its setup imports no torch); the live check of its last
cell is refused by the submission before any rank starts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat

from edu3d.course.autograde import scoring as grade

from .test_grading import edu3d_grade

EXERCISE = nbformat.read(Path(__file__).resolve().parent.parent / "exercises" / "00_ranks.ipynb",
                         as_version=4)
TOTAL = sum(len(grade.declared_titles(c)) for _, c in grade.checked_cells(EXERCISE))  # 21

LIMIT = 8  # seconds per cell: above the setup cell's time under load, and each loop costs one

GROUPS = '''
def group_members(rank, dim, dp, tp, pp):
    if (dp, tp, pp) == (2, 1, 2):
        raise ValueError("not this layout")  # the live check stops here, before any rank
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    coords = {"pp": rank // (tp * dp), "dp": (rank // tp) % dp, "tp": rank % tp}
    return [c["tp"] + tp * (c["dp"] + dp * c["pp"])
            for c in ({**coords, dim: i} for i in range(sizes[dim]))]
'''
LOOPS = '''def coords_of(rank, dp, tp, pp):
    while True:
        pass
''' + GROUPS
SWALLOWS = '''def coords_of(rank, dp, tp, pp):
    while True:
        try:
            while True:
                pass
        except KeyboardInterrupt:
            pass
''' + GROUPS
EXITS = '''import os


def coords_of(rank, dp, tp, pp):
    return rank // (tp * dp), (rank // tp) % dp, rank % tp


def group_members(rank, dim, dp, tp, pp):
    os._exit(3)
'''


def graded(tmp_path, name: str, code: str, limit: int = LIMIT) -> dict:
    sub = tmp_path / name
    sub.mkdir()
    (sub / "ranks.py").write_text(code)
    code, out, err = edu3d_grade("00", "--submission", str(sub), "--json", "--timeout",
                                 str(limit), env={"EDU3D_RUNS": str(tmp_path / "runs")},
                                 timeout=300)
    assert code == 1, err
    return json.loads(out)["exercises"]["00_ranks"]


def test_a_submission_that_loops_is_named_with_the_limit_and_its_line(tmp_path):
    r = graded(tmp_path, "loops", LOOPS)
    first, *rest = r["failures"]
    assert first["check"] == "coords_of(5, dp=2, tp=2, pp=2) == (1, 0, 1)"
    assert re.fullmatch(  # the interrupt lands on the `while` or the `pass`
        rf"the submission timed out: still running after {LIMIT} s \(the limit per cell, "
        r"--timeout\), at loops/ranks.py:[23] in coords_of \(this check was running\)",
        first["hint"]), first
    in_cell = [f for f in rest if f["check"].startswith("coords_of matches")]
    assert len(in_cell) == 10 and all(f["hint"].startswith(
        "did not run: the cell stopped in check 'coords_of(5, dp=2, tp=2, pp=2) == (1, 0, 1)' "
        f"(the submission timed out: still running after {LIMIT} s") for f in in_cell), in_cell
    # the next cells ran: group_members passes its 4 + 3 checks, the live one is refused
    assert r["passed"] == 7 and r["total"] == TOTAL, r
    assert any(f["hint"].startswith("ValueError: not this layout (loops/ranks.py")
               for f in r["failures"]), r["failures"]


def test_a_submission_that_exits_is_named_with_its_code_and_line(tmp_path):
    r = graded(tmp_path, "exits", EXITS)
    assert r["passed"] == 11 and r["total"] == TOTAL, r  # the first cell ran before the exit
    first, *rest = r["failures"]
    assert first["check"] == "group_members(5, 'dp', dp=2, tp=2, pp=2) == [5, 7]"
    assert first["hint"] == ("the submission's kernel exited with code 3, at exits/ranks.py:9 "
                             "in group_members (this check was running)"), first
    assert len(rest) == TOTAL - 11 - 1 and all(f["hint"] in (  # every later check
        "could not run: the submission's kernel exited with code 3 in cell 5, check "
        "'group_members(5, 'dp', dp=2, tp=2, pp=2) == [5, 7]'",
        "did not run: the cell stopped in check 'group_members(5, 'dp', dp=2, tp=2, pp=2) == "
        "[5, 7]' (the submission's kernel exited with code 3, at exits/ranks.py:9 in "
        "group_members)") for f in rest), rest


def test_a_submission_that_ignores_the_interrupt_is_stopped_and_named(tmp_path):
    # LIMIT, not less: the setup cell (torch's import) must finish within it under load
    r = graded(tmp_path, "deaf", SWALLOWS)
    assert r["passed"] == 0 and r["total"] == TOTAL, r
    first, *rest = r["failures"]
    assert re.fullmatch(rf"the submission timed out and ignored the interrupt at {LIMIT} s "
                        rf"\(the limit per cell, --timeout\): its kernel was stopped at "
                        rf"{2 * LIMIT + 5} s, at deaf/ranks.py:[345] in coords_of \(this "
                        r"check was running\)", first["hint"]), first
    assert rest[-1]["hint"].startswith("could not run: the submission timed out and ignored "
                                       f"the interrupt at {LIMIT} s"), rest[-1]


def test_a_setup_cell_that_timed_out_is_named_by_every_later_failure():
    def cell(source, *outputs):
        return nbformat.v4.new_code_cell(source, outputs=[nbformat.from_dict(o)
                                                          for o in outputs])

    mark = grade.MARK + "\n"
    committed = nbformat.v4.new_notebook(cells=[
        cell("ex = grading.load('x')"),
        cell(mark + "a")])
    committed.cells[1].metadata["edu3d"] = {"checks": ["one"]}  # what the cell declares
    ran = nbformat.v4.new_notebook(cells=[
        cell("ex = grading.load('x')", {
            "output_type": "error", "ename": grade.TIMED_OUT, "traceback": [],
            "evalue": "the submission timed out: still running after 5 s (the limit per "
                      "cell, --timeout), at alice/x.py:1 in <module>"}),
        cell(mark + "a", {"output_type": "stream", "name": "stdout", "text": "FAIL one\n"},
             {"output_type": "stream", "name": "stderr",
              "text": "  hint: NameError: name 'ex' is not defined\n"})])
    s = grade.score(ran, committed, {1: [{"n": 1, "title": "one", "passed": False,
                                          "hint": "NameError: name 'ex' is not defined"}]})
    assert s["failures"] == [{"check": "one", "hint": (
        "NameError: name 'ex' is not defined (after an earlier cell (cell 0: ex = "
        "grading.load('x')) the submission timed out: still running after 5 s (the limit "
        "per cell, --timeout), at alice/x.py:1 in <module>)")}]
