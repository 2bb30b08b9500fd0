"""Chapter 11's review: a real quiz, every question graded by edu3d's own numbers, both ways.

* the notebook ships its answers blank (``...``): without solutions every check fails and
  says "not answered yet"; with ``EDU3D_SOLUTIONS=1`` every check grades the reference answer
  of ``solutions/review_answers.py`` and passes, revealing the question's reasoning, and the
  committed outputs are exactly those lines;
* each question's classic wrong answer fails with one hint naming the chapter, never the
  right value nor the reasoning (``review.why`` reveals that on request);
* the truths agree with the course's formulas where one exists (ring 2(N-1)/N, ZeRO's
  paper figures, (p-1)/(v·m+p-1));
* the quiz panel: its first knob is a Dropdown of the questions, changing it redraws the
  figure and sets the knobs to that question's case, and every question has a picture;
* the recipe: the planner's decisions are read from its code and cover the three steps.
No process is launched (``measure it`` is the notebook's, not the suite's).
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import nbformat
import pytest

from edu3d.course import nbtools
from edu3d.course import ch11_review as review

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "11_review.ipynb"


def shipped_answers() -> dict[str, object]:
    """The notebook's answer cells executed in one namespace: ``{question key: answer}``."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    ns: dict = {}
    keys = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if "review.check(" in cell.source:
            key, var = cell.source.split("review.check(")[1].rstrip(")").split(", ")
            keys[key.strip("'\"")] = var
        elif re.search(r"^q\d+ = ", cell.source, re.M):
            exec(cell.source, ns)  # noqa: S102 - the course's own answer cells
    return {k: ns[v] for k, v in keys.items()}


def test_the_bank_covers_every_topic_with_sixteen_questions():
    assert len(review.QUESTIONS) >= 12
    assert {q.topic for q in review.QUESTIONS} == {"DP", "ZeRO", "TP/SP", "PP", "memory",
                                                   "layout"}
    for n, q in enumerate(review.QUESTIONS, 1):
        assert q.title.startswith(f"Q{n} ") and (ROOT / "notebooks" / q.chapter).exists(), q


def test_the_shipped_answers_are_blank_and_fail_every_check(capsys, monkeypatch):
    monkeypatch.delenv("EDU3D_SOLUTIONS", raising=False)
    answers = shipped_answers()
    assert set(answers) == set(review.BANK)
    assert all(a is ... for a in answers.values())
    for key, answer in answers.items():
        assert not review.check(key, answer), key
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"FAIL {q.title}" for q in review.QUESTIONS]
    assert err.count("not answered yet") == len(review.QUESTIONS) and "Why:" not in err + out


def test_the_solutions_pass_every_check_and_the_committed_outputs_say_so(capsys, monkeypatch):
    monkeypatch.setenv("EDU3D_SOLUTIONS", "1")
    for key, answer in shipped_answers().items():
        assert review.check(key, answer), key
    out, err = capsys.readouterr()
    expected = [f"PASS {q.title}\n{review.explain(q.key)}\n" for q in review.QUESTIONS]
    assert not err and out == "".join(expected)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    committed = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells
                 if nbtools.is_checked(c) and "review.check(" in c.source]
    assert committed == expected
    for q in review.QUESTIONS:  # the reference itself, not the blank, is what passed
        assert review.reference(q.key) is not ...


def test_why_reveals_the_reasoning_on_request(capsys):
    review.why("ring")
    out = capsys.readouterr().out
    assert out.startswith("Why: A ring all-reduce") and "notebooks/01_collectives.ipynb" in out


@pytest.mark.parametrize("q", review.QUESTIONS, ids=lambda q: q.key)
def test_the_classic_wrong_answer_fails_with_a_hint_not_the_answer(q, capsys, monkeypatch):
    monkeypatch.delenv("EDU3D_SOLUTIONS", raising=False)
    assert q.wrong is not None
    assert not review.check(q.key, q.wrong)
    out, err = capsys.readouterr()
    assert out == f"FAIL {q.title}\n"
    assert err.startswith("  hint: ") and f"notebooks/{q.chapter}" in err
    assert q.why not in err and "Why:" not in err  # the reasoning only on a pass or request
    truth = q.truth()
    if isinstance(truth, float):
        assert f"{truth:.3g}" not in err.split("Look at:")[0]


def test_an_unanswered_question_says_so(capsys, monkeypatch):
    monkeypatch.delenv("EDU3D_SOLUTIONS", raising=False)
    assert not review.check("bubble_1f1b", ...)
    assert "not answered yet" in capsys.readouterr().err


def test_the_truths_are_the_course_formulas():
    from edu3d.schedules import bubble_formula

    assert review.ring_gb_sent(8, 1.0) == pytest.approx(2 * 7 / 8)
    assert review.zero_gb() == {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # the ZeRO paper's figure 1
    assert review.zero_sharded() == {1: {"optimizer"}, 2: {"optimizer", "grads"},
                                     3: {"optimizer", "grads", "params"}}
    assert review.zero3_traffic_ratio() == pytest.approx(1.5)
    for name, p, m, v in (("1f1b", 4, 8, 1), ("gpipe", 3, 5, 1), ("interleaved", 4, 8, 2)):
        assert review.bubble(name, p, m, v) == pytest.approx(bubble_formula(name, p, m, v))
    assert review.bubble("zb-h1", 4, 8) < review.bubble("1f1b", 4, 8) / 2
    assert review.micro_batches_for(0.1, 8) == 63 and bubble_formula("1f1b", 8, 62) > 0.1
    layer = review.gpt3_layer_mb()
    assert layer["none"] / layer["tp+sp"] == pytest.approx(8)
    assert math.isclose(review.tp_all_reduces(), 4)


def test_the_quiz_panel_redraws_each_question_at_once():
    import ipywidgets as w

    from edu3d.widgets.panels.ch11_review import controls

    ctl = controls()
    box = ctl.widget
    assert "edu3d-controls" in box._dom_classes
    first = box.children[0].children[0]
    assert isinstance(first, w.Dropdown) and first.value == "bubble_1f1b"
    titles = {}
    for q in review.QUESTIONS:
        first.value = q.key  # as a learner picks it
        assert ctl.state["picture"] == q.picture["picture"] and not ctl.problem()
        assert all(ctl._knobs[k].value == v for k, v in q.picture.items() if k in ctl._knobs)
        titles[q.key] = ctl.figure.layout.title.text
    assert titles["bubble_1f1b"] != titles["bubble_interleaved"] != titles["zero_gb"]
    first.value = "bubble_interleaved"
    ctl._knobs["m"].value = 6  # interleaved at p=4 cannot build m=6: drawn at the nearest m
    assert "cannot build m = 6" in ctl.message and ctl.state["m"] in (4, 8)
    assert ctl._knobs["m"].value == ctl.state["m"] and ctl.figure is not None
    ctl._knobs["m"].value = 12
    assert ctl.figure.layout.title.text.startswith("<b>interleaved, p = 4")
    ctl._knobs["pp"].value = 2
    assert ctl.figure.layout.title.text.startswith("<b>interleaved, p = 2")


def test_the_recipe_is_read_from_the_planners_code():
    from edu3d.course import ch11_review_recipe as recipe
    from edu3d.plan import search

    found = recipe.decisions()
    codes = [d["code"] for d in found]
    assert {d["step"] for d in found} == {0, 1, 2}
    assert "tp in divisors(cl.gpus)" in codes and "spec.n_heads % tp" in codes
    assert found[-2]["kind"] == "fit" and "cl.usable" in found[-2]["code"]
    assert found[-1]["kind"] == "rank" and found[-1]["step"] == 2
    lines = [line.strip() for line in inspect.getsource(search.candidates).splitlines()]
    guards = [a for a, b in zip(lines, lines[1:]) if b == "continue"]  # each guard, drawn
    assert sum(d["kind"] == "skip" for d in found) >= len(guards) > 0


def test_each_question_sits_under_its_own_picture():
    """Issue 42: Q2 (what DDP communicates, and when) sat under Q1's ring picture, titled with
    Q1's answer. Every question's picture, in the notebook (``question_picture``) and in the
    quiz panel when it is picked, says the question's subject in its title or takeaway, and
    no picture says another question's subject unless both questions share that picture."""
    from edu3d.widgets.panels.ch11_review import controls, question_picture

    ctl = controls()
    titles = {}
    for q in review.QUESTIONS:
        assert q.subject, f"{q.key} names no subject"
        ctl.redraw(question=q.key)
        titles[q.key] = ctl.figure.layout.title.text.lower()
        assert question_picture(q.key).layout.title.text.lower() == titles[q.key], q.key
        assert q.subject.lower() in titles[q.key], (q.key, titles[q.key])
    for q in review.QUESTIONS:
        for other in review.QUESTIONS:
            if other.picture.get("picture") != q.picture.get("picture"):
                assert other.subject.lower() not in titles[q.key], (q.key, other.key)
    assert "1.75" not in titles["dp_when"]  # Q1's answer stays under Q1
