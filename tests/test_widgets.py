"""The shared visualizers: style helpers, the timeline and the 3D mesh cube.

Figures are built from synthetic trace events with the schema of :mod:`edu3d.distributed.trace` (the
demos' tests draw real ones); the large case checks that 8 ranks x 2000 events build and
serialise quickly, because every bar lives in one trace per operation.
"""

from __future__ import annotations

import json

import pytest

from edu3d.config.layout import Layout
from edu3d.widgets import style
from edu3d.widgets.mesh3d import mesh_figure, predicted_report
from edu3d.widgets.timeline import idle_gaps, lanes, timeline_figure


def pipeline_events(ranks: int = 4, per_rank: int = 12, sim: bool = True) -> list[dict]:
    """A little GPipe-like trace: F then B per micro-batch, a DP all-reduce at the end, and
    (optionally) the same compute as a simulated ghost."""
    out = []
    for r in range(ranks):
        t = 100.0 * r  # later stages start later: a bubble at the start
        for i in range(per_rank):
            op = "F" if i < per_rank // 2 else "B"
            dur = 1000.0 if op == "F" else 2000.0
            ev = {"rank": r, "lane": "compute", "op": op, "t0": t, "t1": t + dur,
                  "mb": i % (per_rank // 2), "step": 0, "stage": r, "chunk": i % 2}
            out.append(ev)
            if sim:
                out.append({**ev, "t0": ev["t0"] * 0.9, "t1": ev["t1"] * 0.9, "sim": True})
            t += dur + 50.0
        out.append({"rank": r, "lane": "comm", "op": "all_reduce", "group": "dp", "n": 2,
                    "bytes": 4096, "t0": t, "t1": t + 300.0, "step": 0})
        out.append({"rank": r, "lane": "mem", "op": "mem", "t0": t, "t1": t,
                    "mem": {"params": 10}})
    return out


def test_palette_and_helpers():
    assert style.op_color("F") == style.BLUE and style.op_color("B") == style.ORANGE
    assert style.op_color("I") == style.TEAL and style.op_color("W") == style.GREEN
    assert style.op_color("all_reduce") == style.YELLOW
    unknown = style.op_color("mystery_op")
    assert unknown == style.op_color("mystery_op")  # stable
    assert style.tint(style.BLUE, 0, 2) == style.BLUE
    assert style.tint(style.BLUE, 1, 2) != style.BLUE and style.tint("#000000", 1, 2) == "#737373"
    assert style.rgba("#0072B2", 0.3) == "rgba(0,114,178,0.3)"
    assert "takeaway" in style.title_text("T", "takeaway")


def test_timeline_lanes_traces_and_ghosts():
    events = pipeline_events(ranks=4)
    fig = timeline_figure(events, title="GPipe", takeaway="the bubble is idle time")
    names = [t.name for t in fig.data]
    # one trace per (operation, ghost or measured), plus idle; mem events are not drawn
    assert sorted(names) == sorted(["idle", "F (theory)", "B (theory)", "F", "B", "all_reduce"])
    assert all(t.type == "bar" and t.orientation == "h" for t in fig.data)
    ghosts = [t for t in fig.data if t.name.endswith("(theory)")]
    assert ghosts and all(t.opacity == style.GHOST_OPACITY for t in ghosts)
    assert names.index("F (theory)") < names.index("F")  # ghosts drawn underneath
    # 4 ranks x (compute lane + comm sub-lane)
    assert len(fig.layout.yaxis.tickvals) == 8
    assert list(fig.layout.yaxis.ticktext[::2]) == [f"rank {r}" for r in range(4)]
    f = next(t for t in fig.data if t.name == "F")
    assert len(f.x) == 4 * 6 and f.base[0] == 0.0 and f.x[0] == pytest.approx(1.0)  # ms
    assert list(f.text[:3]) == ["0", "1", "2"]  # micro-batch labels
    assert len(f.marker.color) == len(f.x) and len(set(f.marker.color)) == 2  # chunk tints
    assert "GPipe" in fig.layout.title.text and "bubble" in fig.layout.title.text
    assert fig.layout.xaxis.title.text == "time since the first event shown (ms)"
    assert "group dp (n=2), bytes 4.00 KiB" in fig.data[names.index("all_reduce")].hovertext[0]


def test_comm_is_a_thinner_sub_lane_under_its_rank():
    where = lanes([1, 0], {"compute", "comm"})
    assert where.center[(0, "compute")] < where.center[(0, "comm")] < where.center[(1, "compute")]
    assert where.height["comm"] < where.height["compute"]
    only_comm = lanes([0, 1, 2], {"comm"})
    assert len(only_comm.tickvals) == 3


def test_idle_gaps_cover_the_bubbles():
    events = pipeline_events(ranks=2, sim=False)
    gaps = idle_gaps(events)
    r1 = [g for g in gaps if g["rank"] == 1]
    assert r1[0]["t0"] == 0.0 and r1[0]["t1"] == 100.0  # rank 1 starts 100 us late
    assert all(g["t1"] > g["t0"] for g in gaps)
    assert not idle_gaps([e for e in events if e["lane"] == "comm"])


def test_timeline_of_nothing_still_has_a_frame():
    fig = timeline_figure([], title="empty")
    assert len(fig.data) == 0 and "no compute" in fig.layout.title.text


def test_timeline_of_8_ranks_by_2000_events_draws_one_trace_per_op():
    """What keeps the chart fast, counted (its CPU seconds: ``edu3d bench goals``): plotly's
    cost grows with traces, so the events of one op are one trace (measured and simulated
    apart), whatever their number."""
    events = []
    ops = ["F", "B", "W", "all_reduce", "send", "recv"]
    for r in range(8):
        for i in range(2000):
            op = ops[i % len(ops)]
            lane = "compute" if op in "FBW" else "comm"
            events.append({"rank": r, "lane": lane, "op": op, "t0": i * 10.0, "t1": i * 10.0 + 8,
                           "mb": i % 16, "bytes": 1024, "group": "pp", "n": 2,
                           **({"sim": True} if i % 7 == 0 else {})})
    fig = timeline_figure(events, title="big", takeaway="fast")
    text = fig.to_json()
    assert len(fig.data) <= 2 * len(ops) + 1  # per op (measured/ghost) + idle, not per event
    fewer = [e for e in events if e["t0"] < 2000]  # 200 events a rank, every op in both kinds
    assert len(fig.data) == len(timeline_figure(fewer, title="a tenth").data)
    assert sum(len(t.x) for t in fig.data if t.name != "idle") == 16000
    assert len(json.loads(text)["data"]) == len(fig.data)


def test_mesh_cube_from_a_report():
    layout = Layout(dp=2, tp=2, pp=2)
    fig = mesh_figure(layout)  # no report: what the layout predicts
    ranks = fig.data[-1]
    assert list(ranks.text) == [str(r) for r in range(8)]
    labels = fig.layout.scene.annotations
    assert [(a.text, a.x, a.y, a.z) for a in labels][5] == ("<b>5</b>", 1, 0, 1)
    tp_colors = list(ranks.marker.color)  # each rank in its TP group's colour
    assert tp_colors[0] == tp_colors[1] != tp_colors[2]
    assert (ranks.x[5], ranks.y[5], ranks.z[5]) == (1, 0, 1)  # (tp, dp, pp) of rank 5
    assert "pp=1 dp=0 tp=1" in ranks.hovertext[5]
    groups = fig.data[:-1]
    assert len(groups) == 4 + 4 + 4 + 2  # tp, dp, pp groups and 2 model-parallel planes
    assert [g.name for g in groups if g.visible] == [f"TP group {i}: {g}" for i, g in
                                                      enumerate(layout.groups("tp"))]
    menu = fig.layout.updatemenus[0]
    assert [b.label.split()[0] for b in menu.buttons] == ["TP", "DP", "PP", "MP"]
    dp_visible = menu.buttons[1].args[0]["visible"]
    assert [g.name for g, v in zip(groups, dp_visible) if v] == [
        f"DP group {i}: {g}" for i, g in enumerate(layout.groups("dp"))]
    assert dp_visible[-1] is True  # rank markers always shown
    dp_colors = menu.buttons[1].args[0]["marker.color"][-1]
    assert dp_colors[0] == dp_colors[2] != dp_colors[1]
    scene = fig.layout.scene
    assert (scene.xaxis.title.text, scene.yaxis.title.text, scene.zaxis.title.text) == (
        "tp coordinate", "dp coordinate", "pp coordinate")
    # an MP plane joins grid neighbours only: 4 members of a 2x2 plane -> 4 edges
    mp0 = groups[12]
    assert sum(v is None for v in mp0.x) == 4
    assert "predicted" in fig.layout.title.text


def test_mesh_cube_draws_what_the_ranks_reported():
    layout = Layout(dp=2, pp=2)
    report = predicted_report(layout)
    report[0]["groups"]["dp"] = [0, 3]  # a rank that (wrongly) reports another partner
    fig = mesh_figure(layout, report, dim="dp")
    names = [t.name for t in fig.data if t.visible and t.name.startswith("DP")]
    assert "DP group 0: [0, 1]" in names and "DP group 1: [0, 3]" in names
    assert "live ranks" in fig.layout.title.text
    assert "only 9 of 10 as predicted" in fig.layout.title.text  # the wrong partner is counted
    with pytest.raises(ValueError, match="report has 4 ranks"):
        mesh_figure(Layout(dp=8), report)
    with pytest.raises(ValueError, match="dim"):
        mesh_figure(layout, report, dim="xy")


def test_the_panel_base_builds_knobs_redraws_and_reports_a_failed_run(monkeypatch):
    import ipywidgets as w

    from edu3d.launch.api import LaunchError
    from edu3d.widgets.panels import panel as panel_mod

    class Toy(panel_mod.Panel):
        title = "toy"
        knob_rows = (("a", "run"), ("b",))
        FIGURES = ("fig", "extra")

        def __init__(self):
            super().__init__({"a": 1, "b": "x"})
            self.extra = None
            self.redraw()

        def knobs(self):
            return {"a": w.Dropdown(options=[1, 2], value=self.state["a"]),
                    "b": w.Dropdown(options=["x", "y"], value=self.state["b"])}

        def redraw(self, **changes):
            self.state.update(changes)
            self.fig = f"figure {self.state['a']}{self.state['b']}"
            self.say("")

        def run(self):
            return self.launch(lambda mesh: None, 2)

    toy = Toy()
    assert toy.figures == ("figure 1x",)  # no frontend: the static figures, nothing drawn
    box = toy.widget
    assert box is toy.widget and "edu3d-controls" in box._dom_classes
    title, first, second, out = box.children
    assert isinstance(title, w.HTML) and isinstance(out, w.Output)
    assert isinstance(first.children[1], w.Button) and len(second.children) == 1
    first.children[0].value = 2  # a learner turns a knob: redrawn at once
    assert toy.figures == ("figure 2x",)
    toy.state["b"] = "y"
    toy.sync_knobs()  # the knobs show the state without a redraw per knob
    assert second.children[0].value == "y" and toy.figures == ("figure 2x",)

    def fails(*a, **k):
        raise LaunchError("rank 1 failed")

    monkeypatch.setattr(panel_mod, "launch", fails)
    assert toy.run() is None and "the run failed: rank 1 failed" in toy.message
    assert panel_mod.choices([1, 2], 4) == [1, 2, 4]


def test_one_step_of_a_trace_starts_at_zero():
    from edu3d.widgets.timeline import step_events

    ev = [{"rank": 0, "lane": "comm", "op": "recv", "t0": 90.0, "t1": 95.0, "step": 2},
          {"rank": 0, "lane": "compute", "op": "F", "t0": 100.0, "t1": 110.0, "step": 2,
           "case": "a"},
          {"rank": 0, "lane": "mem", "op": "mem", "t0": 105.0, "t1": 105.0, "step": 2},
          {"rank": 0, "lane": "compute", "op": "F", "t0": 10.0, "t1": 20.0, "step": 1}]
    got = step_events(ev)  # the last step, compute and comm lanes, its first event at 0
    assert [(e["op"], e["t0"]) for e in got] == [("recv", 0.0), ("F", 10.0)]
    assert [e["t0"] for e in step_events(ev, 2, lanes=None, zero_at="compute")] == [
        -10.0, 0.0, 5.0]  # a pipeline's receive is posted before its first compute
    assert [e["op"] for e in step_events(ev, 2, case="a")] == ["F"]
    assert [e["op"] for e in step_events(ev, 2, ops=("recv",))] == ["recv"]
    assert step_events(ev, 7) == []
