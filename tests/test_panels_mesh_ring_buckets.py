"""Chapters 00-02's control panels without a browser: the simulations against the formulas
and the library's own code, the panels' redraws, and one real bucketed DP step."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from edu3d.course import ch01_collectives as ch01  # noqa: E402
from edu3d.course import ch02_data_parallel as ch02  # noqa: E402
from edu3d.widgets.panels import ch00_launching_ranks, ch01_collectives  # noqa: E402
from edu3d.widgets.panels import ch02_data_parallel  # noqa: E402
from edu3d.widgets.mesh3d import agreement, predicted_report  # noqa: E402


def timed(sends: list[dict], step_us: float, start: float = 0.0) -> list[dict]:
    """Give the plan's sends the times of a ring whose every step takes ``step_us``."""
    order = sorted({(e["phase"] != "reduce_scatter", e["ring_step"]) for e in sends})
    at = {key: start + i * step_us for i, key in enumerate(order)}
    return [{**e, "t0": at[(e["phase"] != "reduce_scatter", e["ring_step"])],
             "t1": at[(e["phase"] != "reduce_scatter", e["ring_step"])] + step_us}
            for e in sends]


@pytest.mark.parametrize("n,numel", [(4, 1 << 12), (3, 1001), (8, 4096)])
def test_ring_simulation_sends_what_the_formula_says(n, numel):
    sends = ch01.ring_sends(n, numel)
    assert len(sends) == 2 * (n - 1) * n  # every rank sends once per step
    assert sum(e["bytes"] for e in sends) == 2 * (n - 1) * numel * 4  # 2(N-1)/N·S per rank
    steps = ch01.ring_step_costs(n, numel, alpha=1e-4, beta=1e-9)
    assert [r["step"] for r in steps] == ([f"RS{i}" for i in range(n - 1)]
                                          + [f"AG{i}" for i in range(n - 1)])
    if numel % n == 0:
        assert sum(r["s"] for r in steps) == pytest.approx(
            ch01.ring_all_reduce_s(numel * 4, n, 1e-4, 1e-9))


def test_measured_ring_steps_read_bytes_and_times_back():
    n, numel = 4, 1000
    events = []
    for rep, step_us in enumerate((100.0, 300.0, 200.0)):
        events += [{**e, "case": f"rep{rep}", "sim": False}
                   for e in timed(ch01.ring_sends(n, numel), step_us, start=1e6 * rep)]
    steps = ch01.measured_ring_steps(events, n, repeats=3)
    assert [r["step"] for r in steps] == ["RS0", "RS1", "RS2", "AG0", "AG1", "AG2"]
    assert sum(r["bytes"] for r in steps) == 2 * (n - 1) * numel * 4
    assert all(r["s"] == pytest.approx(200e-6) for r in steps)  # the median repeat


def test_dp_simulation_cuts_the_real_buckets_and_overlaps_only_in_reverse():
    from edu3d.course import lesson_args
    from edu3d.model.gpt import GPT
    from edu3d.train.preflight import model_config
    from edu3d.parallel.dp.data_parallel import make_buckets

    config = model_config(lesson_args())
    params = ch02.backward_sizes(config)
    model = GPT(config, seed=0)
    psi = sum(p.numel() for p in model.parameters())
    costs = ch02.StepCosts(forward_s=3e-3, backward_s=9e-3)
    on = ch02.simulate_dp_step(params, 0.1, True, 2, costs)
    off = ch02.simulate_dp_step(params, 0.1, False, 2, costs)
    for sim, reverse in ((on, True), (off, False)):
        real = make_buckets(list(model.parameters()), 0.1, reverse=reverse)
        assert sim["buckets"] == [b.buffer.numel() * 4 for b in real]
        assert sum(sim["buckets"]) == 4 * psi
        ars = [e for e in sim["events"] if e["op"] == "all_reduce" and e["rank"] == 0]
        assert len(ars) == len(real)
        assert all(a["t1"] <= b["t0"] + 1e-6 for a, b in zip(ars, ars[1:]))  # one link
    total = len(params)
    assert on["launch_log"][0][1] < total  # the first bucket leaves during backward
    assert all(seen == total for _, seen in off["launch_log"])  # nothing before the end
    assert on["exposed_s"] < off["exposed_s"]
    one = ch01.ring_all_reduce_s(4 * psi, 2, costs.alpha, costs.beta)
    # forward order: every bucket after backward, one latency 2(N-1)α per bucket
    assert off["exposed_s"] == pytest.approx(one + 2 * costs.alpha * (len(off["buckets"]) - 1))


def test_mesh_panel_redraws_and_counts_agreement():
    ctl = ch00_launching_ranks.mesh_controls()
    first = ctl.mesh_fig
    assert "dp=2 tp=2 pp=2" in first.layout.title.text and "predicted" in first.layout.title.text
    ctl.redraw(dp=1, tp=4)
    assert ctl.mesh_fig is not first and "dp=1 tp=4 pp=2" in ctl.mesh_fig.layout.title.text
    assert {t.name for t in ctl.mesh_fig.data if t.visible} >= {"TP group 0: [0, 1, 2, 3]"}
    ctl.redraw(dim="pp")
    assert any(t.visible and t.name.startswith("PP group") for t in ctl.mesh_fig.data)
    ctl.redraw(dp=4, tp=4)
    assert "limited to 8" in ctl.message and ctl.run() is None  # drawn, not launched
    layout = ctl.layout
    report = predicted_report(layout)
    groups = 32 // 4 + 32 // 4 + 32 // 2 + 4  # tp, dp, pp groups, and one MP group per dp
    assert agreement(layout, report) == (groups, groups)
    wrong = copy.deepcopy(report)
    wrong[1]["groups"]["dp"] = [0, 1]
    assert agreement(layout, wrong)[0] < agreement(layout, report)[0]
    box = ctl.widget
    assert "edu3d-controls" in box._dom_classes and ctl.widget is box
    assert type(box.children[0].children[0]).__name__ == "Dropdown"


def test_ring_panel_redraws_replay_steps_and_model():
    ctl = ch01_collectives.ring_controls()
    assert len(ctl.replay_fig.data[0].z) == 4 and len(ctl.replay_fig.frames) == 1 + 2 * 3
    steps = ctl.steps_fig
    ctl.redraw(n=6, size=64 << 10)
    assert len(ctl.replay_fig.data[0].z) == 6 and len(ctl.replay_fig.frames) == 1 + 2 * 5
    assert ctl.steps_fig is not steps and "N = 6" in ctl.steps_fig.layout.title.text
    assert list(ctl.steps_fig.data[0].x) == [f"RS{i}" for i in range(5)] + [
        f"AG{i}" for i in range(5)]
    assert "N = 6" in [t.name for t in ctl.cost_fig.data]
    rep = {"results": [{"edu3d_alpha_s": -1e-5, "edu3d_beta_s_per_byte": 2e-9}]}
    fitted = ch01_collectives.ring_controls(rep=rep)
    assert fitted.alpha > 0 and fitted.beta == 2e-9  # a negative fit is kept causal
    box = ctl.widget
    assert "edu3d-controls" in box._dom_classes
    assert type(box.children[0].children[0]).__name__ == "Dropdown"


def test_bucket_panel_runs_the_real_step_over_the_simulation():
    ctl = ch02_data_parallel.bucket_controls()
    assert "simulated" in ctl.timeline_fig.layout.title.text
    assert {t.name for t in ctl.timeline_fig.data} == {"F", "B", "all_reduce"}
    ctl.redraw(bucket_mb=0.05)
    assert "0.05 MB" in ctl.timeline_fig.layout.title.text and len(ctl.sim["buckets"]) > 7
    ctl.redraw(bucket_mb=0.1)
    box = ctl.widget
    assert "edu3d-controls" in box._dom_classes
    assert type(box.children[0].children[0]).__name__ == "Dropdown"

    run = ctl.run(timeout=120)
    assert run is not None and "same sizes as simulated" in ctl.message
    measured = ctl.measured[(0.1, True)]
    assert {e["rank"] for e in measured} == {0, 1}
    assert sum(e["op"] == "all_reduce" for e in measured) == 2 * len(ctl.sim["buckets"])
    names = {t.name for t in ctl.timeline_fig.data}
    assert {"all_reduce", "all_reduce (theory)", "B", "B (theory)"} <= names
    assert "measured over the simulation" in ctl.timeline_fig.layout.title.text
    b = next(e for e in measured if e["op"] == "B" and e["rank"] == 0)
    ghost = next(e for e in ctl.sim["events"] if e["op"] == "B" and e["rank"] == 0)
    assert ghost["t1"] - ghost["t0"] > 0 and b["t1"] > b["t0"]
