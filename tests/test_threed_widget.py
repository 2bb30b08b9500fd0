"""Chapter 06's visualizer and formulas, without a browser: figures from run-shaped events."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from edu3d.course import lesson_args  # noqa: E402
from edu3d.course.ch06_3d_parallelism import (axis_bytes, axis_formulas,  # noqa: E402
                                              memory_estimate)
from edu3d.config.layout import Layout  # noqa: E402
from edu3d.train.preflight import model_config  # noqa: E402
from edu3d.widgets import threed  # noqa: E402
from edu3d.widgets.panels.ch06_3d_parallelism import controls  # noqa: E402
from edu3d.widgets.pipeline import simulated_pipeline  # noqa: E402

LAYOUT = Layout(dp=2, tp=2, pp=2)
ACT = 1 * 32 * 64 * 4  # b·s·h·4 bytes of the tiny model, 4 micro-batches of 1 row


def run_events(step_offset_us: float = 5e6) -> list[dict]:
    """A dp2-tp2-pp2 run's shape: two steps, F/B per micro-batch with TP all-reduces inside,
    PP sends between them, ZeRO's reduce-scatter and all-gather at the end."""
    out = []
    for step in (1, 2):
        base = step_offset_us * step
        for rank in range(8):
            c = LAYOUT.coords(rank)
            t = base + 100.0 * c.pp
            for mb in range(4):
                for kind in ("F", "B"):
                    out.append({"rank": rank, "lane": "compute", "op": kind, "step": step,
                                "mb": mb, "stage": c.pp, "t0": t, "t1": t + 50})
                    for k in range(2):
                        out.append({"rank": rank, "lane": "comm", "op": "all_reduce",
                                    "group": "tp", "n": 2, "bytes": ACT, "step": step,
                                    "t0": t + 10 + 15 * k, "t1": t + 20 + 15 * k})
                    t += 60
                out.append({"rank": rank, "lane": "comm", "op": "send", "group": "pp", "n": 2,
                            "bytes": ACT, "step": step, "mb": mb, "t0": t, "t1": t})
            for op in ("reduce_scatter", "all_gather"):
                out.append({"rank": rank, "lane": "comm", "op": op, "group": "dp", "n": 2,
                            "bytes": 1000, "step": step, "t0": t, "t1": t + 30})
                t += 30
    return out


def test_timeline_starts_at_the_step_and_names_every_trace():
    fig = threed.timeline_3d(run_events(), step=2)
    names = [t.name for t in fig.data]
    assert all(names)
    for expected in ("forward (F)", "backward (B)", threed.AXIS_NAMES["tp"],
                     threed.AXIS_NAMES["pp"], threed.AXIS_NAMES["dp"]):
        assert expected in names
    assert min(min(t.base) for t in fig.data if len(t.base)) == 0.0
    assert fig.layout.xaxis.range[0] == 0
    assert "ms" in fig.layout.xaxis.title.text and fig.layout.title.text
    ranks = {tick for tick in fig.layout.yaxis.ticktext if tick.startswith("rank")}
    assert len(ranks) == 8


def test_memory_bars_sum_to_the_totals():
    measured = {r: {"params": 100 * (r + 1), "grads": 50, "optimizer": 200,
                    "activations": 30 * r} for r in range(8)}
    fig = threed.memory_per_rank(measured, estimate=measured)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == list(threed.CATEGORIES)
    for i, r in enumerate(sorted(measured)):
        total = sum(t.y[i] for t in bars) * 1024
        assert total == pytest.approx(sum(measured[r].values()))
    assert fig.layout.barmode == "stack" and "KiB" in fig.layout.yaxis.title.text


def test_axis_bytes_match_the_formulas_on_run_shaped_events():
    config = model_config(lesson_args())
    got = axis_bytes(run_events(), 2)
    assert set(got) == set(range(8))
    assert got[0]["pp"] == 4 * ACT
    assert got[0]["dp"] == 1000  # two ring ops of (n-1)/n · 1000
    f = axis_formulas(config, LAYOUT, 4, stage=0, rank_params=1000 // 4)
    assert f["pp"] == got[0]["pp"] and f["dp"] == got[0]["dp"]
    # the synthetic events carry the layers' 4 all-reduces per micro-batch only
    assert got[0]["tp"] == 4 * 4 * ACT


def test_memory_estimate_matches_the_measured_parameter_bytes():
    config = model_config(lesson_args())
    est = memory_estimate(config, dp=2, tp=2, pp=2, zero=1, m=4)
    # measured on a dp2-tp2-pp2 ZeRO-1 run: 60608 and 58688 fp32 parameters per rank
    assert est[0]["params"] == 60608 * 4 and est[4]["params"] == 58688 * 4
    # Adam's two moments of this dp rank's half, plus one 4-byte step counter per piece
    counters = est[0]["optimizer"] - 8 * 60608 / 2
    assert counters > 0 and counters % 4 == 0 and counters / 4 <= 60
    # the planner's count, which tests/test_planner.py holds to every layout's measurement
    from edu3d.plan import estimate as plan_memory
    from edu3d.model.shapes import spec_from_config

    spec = spec_from_config(config)
    st = plan_memory.setup(dp=2, tp=2, pp=2, zero=1, microbatches=4, micro_batch=1)
    assert est[4]["activations"] == plan_memory.activations_per_rank(spec, st)[1]
    z3 = memory_estimate(config, dp=2, tp=2, pp=2, zero=3, m=4)
    assert z3[0]["params"] == est[0]["params"] / 2


def test_controls_redraw_with_another_layout():
    ctl = controls()
    assert ctl.state["dp"] == 2 and ctl.message == ""
    first = ctl.pipeline_fig
    assert len(ctl.estimate) == 8
    ctl.redraw(dp=1, tp=2, pp=4, schedule="gpipe", microbatches=8)
    assert ctl.pipeline_fig is not first and len(ctl.estimate) == 8
    assert "pp=4" in ctl.pipeline_fig.layout.title.text
    assert all(t.name for t in ctl.pipeline_fig.data if t.showlegend is not False)
    ctl.redraw(schedule="interleaved", pp=4)  # 4 x 2 chunks > 4 layers
    # the pipeline is still simulated; the memory and the run name the panel's own knobs
    assert ctl.pipeline_fig is not None and ctl.memory_fig is None
    assert "8 stages" in ctl.message and "choose a smaller pp" in ctl.message
    assert ctl.run() is None  # refused before any launch
    box = ctl.widget
    assert box is not None and ctl.widget is box


def test_pipeline_view_renumbers_one_pipeline():
    view = threed.pipeline_view(run_events(), LAYOUT)
    assert {e["rank"] for e in view} == {0, 1}
    fig = simulated_pipeline(2, 4, "1f1b", measured=[e for e in view if e["step"] == 2])
    assert fig.data and all(t.name for t in fig.data)
