"""Chapters 08-11's panels never refuse a knob: every position of every control redraws.

Issue 27's rule for a panel: a knob's every position redraws something; only launching a
real run may be refused, and then the message names a knob that is on the panel. Each panel
of chapters 08 (checkpoints), 09 (in production), 10 (performance: the step budget and the
straggler) and 11 (the review's quiz) is built here without a frontend, and every control is
turned through its whole range (dropdowns: every option; sliders: every value), one at a
time from the panel's default state; after each turn the panel must show at least one
figure and must not say it cannot draw. No process is launched, except through the refusal
path, which returns before any launch.
"""

from __future__ import annotations

import json
from pathlib import Path

import ipywidgets as w
import pytest

from edu3d.course.ch10_performance import LAYOUTS, runnable_microbatches
from edu3d.widgets.panels import ch08_checkpoints, ch09_in_production, ch10_performance
from edu3d.widgets.panels import ch11_review

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = json.loads((ROOT / "notebooks" / "data" / "ckpt-dp2-tp2-pp2-zero1.json").read_text())
# the final status records of a dp2 run with rank 1 sleeping 0.2 s (the live monitor's shape)
RECORDS = [{"rank": 0, "step": 3, "step_ms": 212.0, "comm_ms": {"dp": 205.0}},
           {"rank": 1, "step": 3, "step_ms": 210.0, "comm_ms": {"dp": 5.0}}]


def positions(knob) -> list:
    """Every value a control can take."""
    if isinstance(knob, w.IntSlider):
        return list(range(knob.min, knob.max + 1, knob.step))
    return [o[1] if isinstance(o, tuple) else o for o in knob.options]


def turn_every_control(make) -> int:
    """Turn each control of a fresh panel through its range; return the positions seen."""
    seen, first = 0, make()
    first.widget
    for key in list(first._knobs):
        panel = make()
        panel.widget
        knob = panel._knobs[key]
        for value in positions(knob):
            knob.value = value
            figures = [f for f in panel.figures if f is not None]
            assert figures, f"{type(panel).__name__} {key}={value!r} drew nothing"
            assert "cannot be drawn" not in panel.message and "refuse" not in panel.message
            seen += 1
    return seen


def quiet(monkeypatch):
    """Without a frontend a panel's output area prints figures: keep the log short."""
    monkeypatch.setattr("edu3d.widgets.panels.panel.display", lambda *a, **k: None)


def test_chapter_08_every_control_redraws(monkeypatch):
    quiet(monkeypatch)
    other = json.loads(json.dumps(MANIFEST))
    make = lambda: ch08_checkpoints.controls({"8 ranks": MANIFEST, "a copy": other})  # noqa: E731
    assert turn_every_control(make) > 10
    ctl = make()
    ctl.widget
    ctl._knobs["kind"].value = "exp_avg"  # the tensor list follows the kind it shows
    assert list(ctl._knobs["name"].options) == ctl.names()
    assert ctl._knobs["name"].value == ctl.state["name"]


def test_chapter_09_every_control_redraws(monkeypatch):
    quiet(monkeypatch)
    assert turn_every_control(lambda: ch09_in_production.controls({})) >= 6


def test_chapter_10_every_control_redraws_and_only_the_run_refuses(monkeypatch):
    quiet(monkeypatch)
    make = lambda: ch10_performance.controls()  # noqa: E731
    assert turn_every_control(make) >= len(LAYOUTS) + 2 + 8
    ctl = make()
    ctl.widget
    for layout in LAYOUTS:  # choosing a layout shows its real micro-batch count, never 0
        ctl._knobs["layout"].value = layout
        assert ctl._knobs["microbatches"].value == ctl.state["microbatches"] >= 1
    ctl._knobs["layout"].value = "dp4"
    ctl._knobs["microbatches"].value = 8  # predicted, but dp4's 2 sequences per rank cannot
    assert ctl.figures and 8 not in runnable_microbatches("dp4")
    monkeypatch.setattr(ch10_performance, "run_layout", lambda *a, **k: pytest.fail("launched"))
    assert ctl.run() is None
    assert "set micro-batches to one of those" in ctl.message and "1, 2" in ctl.message
    assert turn_every_control(lambda: ch10_performance.straggler_controls(RECORDS)) >= 7


def test_chapter_11_every_control_redraws(monkeypatch):
    quiet(monkeypatch)
    seen = turn_every_control(lambda: ch11_review.controls())
    assert seen > 100
    ctl = ch11_review.controls({"question": "bubble_interleaved"})
    ctl.widget
    for m in range(1, 65):  # every slider position draws, at a count the schedule can build
        ctl._knobs["m"].value = m
        assert ctl.figure is not None and ctl._knobs["m"].value == ctl.state["m"]
        assert ctl.problem() is None
