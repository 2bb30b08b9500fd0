"""Chapter 10's measures, cost model, pictures and control panel (edu3d.course.ch10_performance,
edu3d.widgets.perf): formulas and figures on made-up events, and one real 2-rank run (a
profiled step, dp1 and dp2 timed, overlap off). The three hangs run live in the chapter's
notebook, whose checked cell nbval compares."""

from __future__ import annotations

from types import SimpleNamespace

import re

import pytest

from edu3d.course import ch10_performance as perf
from edu3d.course import ch10_performance_predict as pm
from edu3d.course import ch10_performance_verdicts as verdicts
from edu3d.course.ch10_performance_hangs import stack_lines
from edu3d.widgets import perf as wp
from edu3d.course.ch10_performance_live import predict as predict_straggler
from edu3d.widgets.panels.ch10_performance import controls


# ---- interval arithmetic and the step budget ----------------------------------------------------
def test_union_minus_length():
    assert perf.union([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert perf.length([(0, 2), (1, 3), (10, 11)]) == 4
    assert perf.minus([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert perf.minus([(0, 4)], [(0, 10)]) == []
    assert perf.minus([(0, 4), (6, 8)], [(3, 7)]) == [(0, 3), (7, 8)]


def _ev(rank, lane, op, t0, t1, step=1, **kw):
    return {"rank": rank, "lane": lane, "op": op, "t0": t0, "t1": t1, "step": step, **kw}


def test_breakdown_cuts_compute_exposed_idle():
    # one rank, times in us: F 0-2000, B 2000-6000, an all-reduce 5000-8000 (1 ms under
    # B, 2 ms exposed), optimizer 9000-10000; idle 8000-9000
    evs = [_ev(0, "compute", "F", 0, 2000), _ev(0, "compute", "B", 2000, 6000),
           _ev(0, "comm", "all_reduce", 5000, 8000), _ev(0, "compute", "optimizer", 9000, 10000)]
    b = perf.breakdown(evs)["steps"][1]
    assert b["step_ms"] == pytest.approx(10.0)
    assert b["comm_ms"] == pytest.approx(3.0)
    assert b["exposed_ms"] == pytest.approx(2.0)
    assert b["compute_ms"] == pytest.approx(7.0)
    assert b["idle_ms"] == pytest.approx(1.0)


def test_breakdown_counts_a_pipeline_receive_as_waiting():
    evs = [_ev(1, "comm", "recv", 0, 4000), _ev(1, "compute", "F", 4000, 5000),
           _ev(1, "comm", "send", 5000, 5500)]
    b = perf.breakdown(evs)["steps"][1]
    assert b["comm_ms"] == pytest.approx(0.5) and b["exposed_ms"] == pytest.approx(0.5)
    assert b["idle_ms"] == pytest.approx(4.0)


def test_breakdown_median_skips_the_warmup_step_and_filters_cases():
    evs = [_ev(0, "compute", "F", 0, 9000, step=1, case="a"),
           _ev(0, "compute", "F", 0, 1000, step=2, case="a"),
           _ev(0, "compute", "F", 0, 3000, step=3, case="a"),
           _ev(0, "compute", "F", 0, 50000, step=2, case="b")]
    brk = perf.breakdown(evs, "a")
    assert brk["median_step"] == 2 and brk["median"]["step_ms"] == pytest.approx(1.0)


def _overlap_events() -> list[dict]:
    """dp2 traced with overlap off and on, 2 ranks, 6 steps each (us): per step a forward of
    ``c`` with ``h`` of all-reduce under it, then ``i`` idle and ``e`` of exposed all-reduce.
    The parts vary so that each part's own median (12 + 1 + 0 = 13 ms off) is no step's:
    the median step (20 + 1 + 0) is 21 ms."""
    parts = {"off": [(50, 9, 9, 0), (10, 1, 5, 0), (20, 1, 0, 0), (12, 8, 0, 0), (11, 2, 9, 0),
                     (30, 0, 0, 0)],
             "on": [(50, 9, 9, 4), (9, 1, 0, 6), (11, 0, 3, 5), (14, 2, 0, 7), (8, 3, 9, 3),
                    (10, 4, 4, 2)]}
    evs = []
    for mode, steps in parts.items():
        for step, (c, e, i, h) in enumerate(steps, start=1):
            for rank in (0, 1):
                kw = {"step": step, "case": f"overlap {mode}"}
                evs.append(_ev(rank, "compute", "F", 0, c * 1000, **kw))
                if h:
                    evs.append(_ev(rank, "comm", "all_reduce", 0, h * 1000, **kw))
                if e:
                    evs.append(_ev(rank, "comm", "all_reduce", (c + i) * 1000,
                                   (c + i + e) * 1000, **kw))
                elif i:
                    evs.append(_ev(rank, "compute", "optimizer", (c + i) * 1000,
                                   (c + i) * 1000 + 1, **kw))
    return evs


def test_overlap_caption_and_printed_lines_are_the_bars_drawn():
    """Chapter 10 section 2 (issue 42: it printed 36.6 / 72.5 ms beside bars of 35.0 /
    73.9 ms): the takeaway's steps and hidden all-reduce, and the lines the notebook prints,
    are the drawn bars' lengths and labels."""
    verdict = verdicts.overlap_verdict(_overlap_events())
    rows = {f"overlap {m}": verdict[m]["budget"] for m in ("off", "on")}
    fig = wp.budget_figure(rows, title="t", takeaway=verdict["text"])
    bars = [t for t in fig.data if t.type == "bar"]
    drawn = {n: sum(t.x[i] for t in bars) for i, n in enumerate(bars[0].y)}
    ends = fig.data[-1]
    assert dict(zip(ends.y, ends.x)) == pytest.approx(drawn)
    assert drawn["overlap off"] == pytest.approx(21.0)  # the median step, not 12 + 1 + 0
    said = re.search(r"overlap hid ([\d.]+) of ([\d.]+) ms .*step ([\d.]+) ms \(.*\) off, "
                     r"([\d.]+) ms \(.*\) on", fig.layout.title.text)
    assert said, fig.layout.title.text
    hidden, comm, off, on = said.groups()
    assert (off, on) == (f"{drawn['overlap off']:.1f}", f"{drawn['overlap on']:.1f}")
    label = dict(zip(ends.y, ends.text))["overlap on"]
    assert f"comm {comm} ms in all, {hidden} hidden" in label
    for name, row in rows.items():
        line = verdicts.budget_line(name, row)
        step, compute, all_comm, exposed, idle = re.findall(r"\d+\.\d", line)
        assert step == f"{drawn[name]:.1f}" and f"  {step} ms<br>" in dict(zip(ends.y, ends.text))[name]
        assert [compute, exposed, idle] == [f"{t.x[list(t.y).index(name)]:.1f}" for t in bars]
        assert f"comm {all_comm} ms" in dict(zip(ends.y, ends.text))[name]


# ---- the profiler's events on the course's lanes ------------------------------------------------
def _fe(name, t0, t1, parent=None):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=t0, end=t1),
                           cpu_parent=parent)


def test_profiler_events_get_phases_by_position():
    events = [_fe("edu3d:step_start", 100, 101), _fe("aten::linear", 110, 150),
              _fe("aten::mm", 120, 140, parent="x"),  # not top level: left out
              _fe("autograd::engine::evaluate_function: MmBackward0", 200, 260),
              _fe("aten::add_", 270, 275),  # between backward functions: backward
              _fe("autograd::engine::evaluate_function: AddBackward0", 280, 300),
              _fe("gloo:all_reduce", 290, 400), _fe("aten::mul_", 410, 420),
              _fe("Optimizer.step#AdamW.step", 430, 500)]
    out = perf.profiler_events(events, rank=3)
    assert [(e["op"], e["lane"]) for e in out] == [
        ("F", "compute"), ("B", "compute"), ("B", "compute"), ("B", "compute"),
        ("all_reduce", "comm"), ("optimizer", "compute"), ("optimizer", "compute")]
    assert out[0]["t0"] == 10 and out[0]["rank"] == 3  # since the step's marker


def test_collective_names():
    assert perf.collective_of("c10d::allreduce_") == "all_reduce"
    assert perf.collective_of("gloo:all_gather") == "all_gather"
    assert perf.collective_of("c10d::_reduce_scatter_base_") == "reduce_scatter"


# ---- the cost model -----------------------------------------------------------------------------
COSTS = {"serial_ms": 20.0, "alpha_us": 100.0, "gb_per_s": 1.0}


def test_predict_is_the_performance_model_calibrated_to_the_serial_step():
    """Chapter 10's prediction is edu3d.plan.step.predict on the reference CPU profile,
    calibrated: the serial step is the measured one, alpha-beta the fitted ones."""
    for name in perf.LAYOUTS:
        p = pm.predict(name, costs=COSTS, cores=2)
        assert p["step"] == pytest.approx(p["compute"] + p["exposed"] + p["bubble"])
        assert p["step"] == pytest.approx(sum(p["parts"].values()))
        assert p["exposed"] == pytest.approx(sum(p["by_axis"].values()))
    assert pm.predict("dp1", costs=COSTS, cores=2)["step"] == pytest.approx(20.0)
    assert pm.predict("dp1", costs={**COSTS, "serial_ms": 40.0}, cores=2)["step"] == \
        pytest.approx(40.0)
    dp2, dp4 = (pm.predict(n, costs=COSTS, cores=2) for n in ("dp2", "dp4"))
    assert dp4["compute"] > dp2["compute"]  # 4 ranks take turns on 2 cores
    assert dp4["by_axis"]["dp"] > dp2["by_axis"]["dp"]
    slow = pm.predict("dp2", costs={**COSTS, "alpha_us": 1000.0}, cores=2)
    assert slow["by_axis"]["dp"] > dp2["by_axis"]["dp"]


def test_predict_overlap_and_bubble():
    on, off = (pm.predict("dp2", mode, costs=COSTS, cores=2) for mode in ("on", "off"))
    assert on["exposed"] < off["exposed"]  # buckets reduce while backward runs
    m2, m8 = (pm.predict("pp2", microbatches=m, costs=COSTS, cores=2) for m in (2, 8))
    assert m2["bubble"] / m2["step"] > m8["bubble"] / m8["step"] > 0  # (p-1)/(m+p-1)
    assert pm.predict("tp2", costs=COSTS, cores=2)["by_axis"]["tp"] > 0
    rows = pm.against_measured([{"name": "dp1", "median_s": 0.025},
                                {"name": "not a layout", "median_s": 1.0}], COSTS, 2)
    assert [r["name"] for r in rows] == ["dp1"] and rows[0]["error"] == pytest.approx(-0.2)


def test_calibrate_fits_alpha_beta_and_the_serial_step():
    alpha, beta = 50e-6, 1e-9  # 50 us, 1 GB/s
    evs = []
    for i, size in enumerate((1000, 100_000, 1_000_000)):
        t = 2 * alpha + size * beta  # ring of 2: 2(n-1)·alpha + 2(n-1)/n·S·beta
        evs.append({"rank": 0, "lane": "comm", "op": "all_reduce", "n": 2, "bytes": size,
                    "case": "tp2", "t0": 0.0, "t1": t * 1e6, "step": 1})
    costs = perf.calibrate(evs, [{"name": "dp1", "median_s": 0.012}])
    assert costs["serial_ms"] == pytest.approx(12.0)
    assert costs["alpha_us"] == pytest.approx(50.0, rel=1e-3)
    assert costs["gb_per_s"] == pytest.approx(1.0, rel=1e-3)


def test_stack_lines_leave_the_launchers_frames_out():
    v = {"traceback": "Python stack:\n  File \"/x/edu3d/launch/worker.py\", line 1 in _call\n"
                      "  File \"/x/edu3d/course/ch10_performance_hangs.py\", line 9 in skipped_collective\n"
                      "  File \"<frozen runpy>\", line 88 in _run_code\n"}
    assert stack_lines(v) == [
        "Python stack:", "  File \"/x/edu3d/course/ch10_performance_hangs.py\", line 9 in skipped_collective"]


# ---- the pictures -------------------------------------------------------------------------------
def test_figures_have_titles_units_and_data():
    table = [{"name": "aten::mm", "calls": 3, "self_ms": 2.0, "total_ms": 2.0},
             {"name": "c10d::allreduce_", "calls": 1, "self_ms": 1.0, "total_ms": 1.0},
             {"name": "edu3d:step_start", "calls": 1, "self_ms": 9.0, "total_ms": 9.0}]
    fig = wp.op_table_figure(table)
    names = [y for t in fig.data for y in t.y]
    assert "edu3d:step_start" not in names and set(names) == {"aten::mm", "c10d::allreduce_"}
    assert "aten::mm" in fig.layout.title.text and "ms" in fig.layout.xaxis.title.text

    evs = [_ev(0, "compute", "F", 0, 10), _ev(1, "compute", "B", 5, 20),
           _ev(1, "comm", "all_reduce", 8, 30)]
    fig = wp.profile_timeline(evs)
    assert {t.name for t in fig.data} == {"F", "B", "all_reduce"}

    rows = [{"name": "dp1", "world_size": 1, "median_s": 0.01, "tokens_per_s": 25600},
            {"name": "dp4", "world_size": 4, "median_s": 0.05, "tokens_per_s": 5120}]
    fig = wp.scaling_figure(rows, cores=2)
    assert any("more than the cores" in t.name for t in fig.data)
    assert "dp1 is fastest" in fig.layout.title.text

    budget = {"off": {"compute": 5, "exposed": 3, "idle": 1, "comm": 3},
              "on": {"compute": 5, "exposed": 1, "idle": 1, "comm": 3}}
    fig = wp.budget_figure(budget, title="t", takeaway="k", ghosts=("off",))
    bars = [t for t in fig.data if t.type == "bar"]
    assert [list(t.x) for t in bars] == [[5, 5], [3, 1], [1, 1]]
    assert list(bars[0].marker.opacity) == [pytest.approx(0.3), 1.0]
    assert "2.0 hidden" in fig.data[-1].text[1]

    rep = {"benchmark": "dp", "world_size": 2, "results": [
        {"name": "step", "edu3d_s": 0.02, "reference": "DDP", "reference_s": 0.01,
         "ratio": 2.0}]}
    fig = wp.bench_figure(rep)
    assert fig.data[0].text[0] == "ratio 2.00" and "ms" in fig.layout.yaxis.title.text


def test_controls_redraw_at_once_and_build_the_widget():
    ctl = controls(COSTS, {"dp2": 30.0})
    title, step = ctl.budget_fig.layout.title.text, ctl.predicted["step"]
    ctl.redraw(layout="pp2")
    assert "pp2" in ctl.budget_fig.layout.title.text and ctl.budget_fig.layout.title.text != title
    assert ctl.predicted["step"] != step and ctl.predicted["bubble"] > 0
    share4 = ctl.predicted["bubble"] / ctl.predicted["step"]
    ctl.redraw(microbatches=8)  # (p-1)/(m+p-1) of the step: a smaller share
    assert 0 < ctl.predicted["bubble"] / ctl.predicted["step"] < share4
    ctl.redraw(layout="dp2", microbatches=0, overlap="off")
    assert ctl.predicted["exposed"] == pytest.approx(ctl.predicted["comm"])
    assert "dp2 highlighted" in ctl.layouts_fig.layout.title.text
    assert any(t.name == "measured step" for t in ctl.layouts_fig.data)

    import ipywidgets as w

    box = ctl.widget
    assert "edu3d-controls" in box._dom_classes
    first = box.children[0].children[0]
    assert isinstance(first, w.Dropdown)
    first.value = "tp2"
    assert ctl.state["layout"] == "tp2" and "tp2" in ctl.budget_fig.layout.title.text


def test_straggler_panel_predicts_every_knob_position_from_the_recorded_run():
    from edu3d.widgets.panels.ch10_performance import Straggler

    # a recorded dp2 run, rank 1 sleeping 0.2 s: 20 ms of own work each, a 3 ms transfer
    records = [{"rank": 0, "step_ms": 223.0, "comm_ms": {"dp": 203.0}},
               {"rank": 1, "step_ms": 223.0, "comm_ms": {"dp": 3.0}}]
    ctl = Straggler(records, slow_rank=1, seconds=0.2)
    titles = set()
    for rank in (None, 0, 1):
        for seconds in Straggler.SECONDS:
            ctl.redraw(slow_rank=rank, seconds=seconds)
            titles.add(ctl.straggler_fig.layout.title.text)
            steps = {b["step"] for b in predict_straggler(records, 1, 0.2, rank,
                                                            seconds).values()}
            assert len(steps) == 1  # every rank's step is the same: they wait for each other
            want = 23.0 + (1e3 * seconds if rank is not None else 0.0)
            assert steps.pop() == pytest.approx(want)
    assert len(titles) == 1 + 2 * len(Straggler.SECONDS)  # every position drew its own figure
    box = ctl.widget
    assert "edu3d-controls" in box._dom_classes
    box.children[0].children[0].value = 0
    assert ctl.state["slow_rank"] == 0 and "rank 0 sleeping" in ctl.straggler_fig.layout.title.text


# ---- real runs: a profiled and timed 2-rank launch beside a hang -------------------------------
def small_session(mesh) -> dict:
    """A profiled dp2 step, dp1 and dp2 timed, overlap off (launched by the test)."""
    return {"profile": perf.profile_step(mesh, {"dp": 2}, warmup=1),
            "rows": perf.measure_layouts(mesh, ["dp1", "dp2"], steps=2,
                                         cases={"overlap off": {"dp": 2, **perf.OVERLAP["off"]}})}


@pytest.fixture(scope="module")
def live():
    from edu3d.launch import launch
    from edu3d.config.layout import Layout

    return launch(small_session, 2, layout=Layout(dp=2), echo=False, timeout=240,
                  progress=False)


def test_live_profile_and_timings(live):
    import json
    import os

    run = live
    prof = [r["profile"] for r in run.results]
    for r, p in enumerate(prof):
        assert p["rank"] == r and os.path.exists(p["path"])
        assert "traceEvents" in json.loads(open(p["path"]).read())
        ops = {e["op"] for e in p["events"]}
        assert {"F", "B", "optimizer"} <= ops and any(e["lane"] == "comm" for e in p["events"])
        assert any(row["name"] == "aten::mm" for row in p["table"])
    rows = {r["name"]: r for r in run.results[0]["rows"]}
    assert set(rows) == {"dp1", "dp2", "overlap off"}
    assert rows["dp1"]["world_size"] == 1 and rows["dp2"]["world_size"] == 2
    assert all(len(r["step_s"]) == 2 and r["tokens_per_s"] > 0 for r in rows.values())
    assert run.results[1]["rows"] == []
    events = run.events()
    for case in ("dp1", "dp2", "overlap off"):
        med = perf.breakdown(events, case)["median"]
        assert med["compute_ms"] > 0 and med["step_ms"] >= med["compute_ms"]
    assert perf.breakdown(events, "dp1")["median"]["comm_ms"] == 0
    assert perf.breakdown(events, "overlap off")["median"]["exposed_ms"] > 0


def test_panel_captions_are_its_bars_at_every_knob_position():
    """Chapter 10's panel: at each layout, overlap and micro-batch count, the budget's
    takeaway is its bar's length and the layouts chart's takeaway the chosen layout's bars."""
    ctl = controls(COSTS, {"dp2": 30.0})
    turns = [{"layout": n, "overlap": o} for n in ctl.KNOB_LAYOUTS for o in ("on", "off")]
    turns += [{"layout": "pp2", "microbatches": m} for m in range(1, 9)]
    for turn in turns:
        ctl.redraw(**turn)
        ends = ctl.budget_fig.data[-1]
        said = re.search(r"predicted ([\d.]+) ms per step", ctl.budget_fig.layout.title.text)
        assert said and said.group(1) == f"{dict(zip(ends.y, ends.x))['predicted']:.1f}", turn
        layouts = ctl.layouts_fig
        at = list(layouts.data[0].x).index(ctl.state["layout"])
        parts = [t.y[at] for t in layouts.data if t.type == "bar"]
        said = re.search(r": ([\d.]+) ms = compute ([\d.]+) \+ exposed comm ([\d.]+) \+ bubble "
                         r"([\d.]+)", layouts.layout.title.text)
        assert said, layouts.layout.title.text
        assert list(said.groups()) == [f"{v:.1f}" for v in [sum(parts)] + parts], turn
