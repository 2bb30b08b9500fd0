"""Chapters 03-05's control panels without a browser: knobs redraw the predictions at once,
invalid settings say why, and one real tensor-parallel run lands on its prediction."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from edu3d.course import ch03_zero as ch03  # noqa: E402
from edu3d.course import ch04_tensor_parallel as ch04  # noqa: E402
from edu3d.course import ch05_pipeline_parallel as ch05  # noqa: E402
from edu3d.plan.formulas import zero_bytes  # noqa: E402
from edu3d.schedules.simulate import bubble_formula  # noqa: E402
from edu3d.widgets.panels.ch03_zero import hsdp_controls, zero_controls  # noqa: E402
from edu3d.widgets.panels.ch04_tensor_parallel import tp_controls  # noqa: E402
from edu3d.widgets.panels.ch05_pipeline_parallel import pipeline_controls  # noqa: E402
from edu3d.widgets.zero import zero_memory_figure, zero_traffic_figure  # noqa: E402


def _title(fig) -> str:
    return fig.layout.title.text


def _first_dropdown(ctl):
    import ipywidgets as w

    box = ctl.widget
    assert "edu3d-controls" in box._dom_classes
    first = next(iter(ctl._knobs.values()))
    assert isinstance(first, w.Dropdown)
    assert box is ctl.widget  # built once
    return first


def test_zero_panel_predicts_every_stage_and_redraws_at_once():
    ctl = zero_controls(stage=1, n=4)
    pred = ctl.prediction
    psi = pred["psi"]
    assert psi == sum(numel for _, numel, _ in pred["units"])
    for stage in range(4):
        assert pred["formula"][stage]["total"] == zero_bytes(psi, 4, stage)["total"]
        # the planner's exact count: padding and Adam's step counters, well within 1 %
        assert pred["estimate"][stage]["total"] == pytest.approx(
            pred["formula"][stage]["total"], rel=0.01)
    assert pred["traffic"] == {0: 8 * psi, 1: 8 * psi, 2: 8 * psi, 3: 12 * psi}
    assert "4Ψ + 4Ψ + 8Ψ/N" in _title(ctl.memory_fig)
    assert not ctl.sharding_fig.layout.updatemenus  # the panel's dropdown drives it
    rows = {y for t in ctl.sharding_fig.data for y in t.y}
    assert len(rows) == 4 * 3

    first = _first_dropdown(ctl)
    before = (_title(ctl.sharding_fig), _title(ctl.memory_fig), _title(ctl.traffic_fig))
    first.value = 3  # what a learner does in JupyterLab
    assert ctl.state["stage"] == 3
    assert "ZeRO-3 sharding map" in _title(ctl.sharding_fig)
    assert "(4+4+8)Ψ/N" in _title(ctl.memory_fig) and "3Ψ" in _title(ctl.traffic_fig)
    assert before != (_title(ctl.sharding_fig), _title(ctl.memory_fig),
                      _title(ctl.traffic_fig))
    ctl.redraw(n=8)
    assert len({y for t in ctl.sharding_fig.data for y in t.y}) == 8 * 3
    assert all(padded % 8 == 0 for _, _, padded in ctl.prediction["units"])
    assert ctl.prediction["formula"][3]["total"] == pytest.approx(16 * psi / 8)


def test_tp_panel_predictions_and_redraw():
    ctl = tp_controls(tp=2, kind="column", sp=False)
    for kind in ("column", "row"):
        part = ctl.split[0][kind]
        assert (part["result"] - ctl.split[0]["serial"]).abs().max() < 1e-5
    assert ctl.split[1]["column"]["w"].shape == (8, 4)  # d_out / t output features
    assert ctl.split[1]["row"]["x"].shape == (4, 4)  # d_in / t input features
    assert ctl.collectives["forward"] == {"all_reduce": {
        "count": 2, "bytes": 2 * 2 * 64 * 128 * 4, "ring_bytes": 2 * 2 * 64 * 128 * 4}}
    names = [t.name for t in ctl.comm_fig.data]
    assert names == ["all-reduce (predicted)"]

    first = _first_dropdown(ctl)
    first.value = 4
    assert ctl.state["tp"] == 4 and len(ctl.split) == 4
    assert "on 4 ranks" in _title(ctl.split_fig)
    assert "tp=4 ◀" in ctl.memory_fig.data[0].x[2]
    ctl.redraw(sp=True, kind="row")
    names = {t.name for t in ctl.comm_fig.data}
    assert names == {"all-gather (predicted)", "reduce-scatter (predicted)"}
    assert "Row split" in _title(ctl.split_fig) and "+ SP" in _title(ctl.comm_fig)
    # SP: same bytes as TP forward, two more all-gathers backward
    tp_only = ch04.tp_collectives_prediction(ctl.config, 2, 4, False)
    both = ctl.collectives
    fwd = sum(v["ring_bytes"] for v in both["forward"].values())
    assert fwd == sum(v["ring_bytes"] for v in tp_only["forward"].values())
    mem = ch04.tp_activation_prediction(ctl.config, 2, 4, True)["model_formula"]
    assert f"{mem / 1024:.1f} KiB" in _title(ctl.memory_fig)


def test_pipeline_panel_refuses_invalid_settings_with_a_reason():
    ctl = pipeline_controls(schedule="1f1b", pp=2, m=4)
    assert ctl.message == "" and len(ctl.figures) == 2
    assert f"formula {bubble_formula('1f1b', 2, 4):.1%}" in _title(ctl.gantt_fig)
    curve = ch05.pp_bubble_curve("1f1b", 4, 1, tuple(range(1, 9)))
    assert curve["simulated"] == pytest.approx(curve["formula"])

    first = _first_dropdown(ctl)
    title = _title(ctl.gantt_fig)
    first.value = "interleaved"  # brings its own chunk count: vpp 1 -> 2
    assert ctl.state["vpp"] == 2 and ctl._knobs["vpp"].value == 2
    assert ctl.message == "" and _title(ctl.gantt_fig) != title
    assert "v=2" in _title(ctl.gantt_fig)
    ctl.redraw(m=3)  # interleaving sends micro-batches in groups of pp: 3 moves up to 4
    assert ctl.state["m"] == 4 and len(ctl.figures) == 2 and "3 -> 4" in ctl.message
    ctl._knobs["vpp"].value = 1  # one chunk is plain 1F1B: the schedule follows the knob
    assert ctl.state["schedule"] == "1f1b" and len(ctl.figures) == 2
    ctl.redraw(m=4, schedule="gpipe", vpp=2)
    assert ctl.figures == () and "needs the interleaved schedule" in ctl.message
    assert ch05.pp_problem("interleaved", 2, 4, 1) and ch05.pp_run_problem("1f1b", 16, 16, 1)
    assert "cannot be built" in ch05.pp_problem("zb-h1", 4, 9, 1)  # the generator's own limit
    assert ctl.run() is None and "cannot run" in ctl.message  # nothing launched
    ctl.redraw(schedule="zb-h1", vpp=1, m=4)
    assert ctl.message == "" and "ZB-H1" in _title(ctl.gantt_fig)
    assert "m = 4" in _title(ctl.bubble_fig)


def test_tp_run_lands_on_the_prediction():
    """One real launch (2 ranks, TP+SP): shards, collectives and activation bytes measured on
    the ranks equal what the panel predicted in-process."""
    ctl = tp_controls(tp=2, kind="row", sp=True)
    got = ctl.run(timeout=120)
    assert got is not None, ctl.message
    assert ch04.split_difference(got["split"], ctl.split, "row") < 1e-6
    assert ch04.split_difference(got["split"], ctl.split, "column") < 1e-6
    assert got["collectives"] == ctl.collectives
    assert got["memory"]["measured"] == got["memory"]["model_formula"]
    assert "measured" in _title(ctl.split_fig)
    assert any("measured" in t.name for t in ctl.comm_fig.data)
    assert any("measured" in t.name for t in ctl.memory_fig.data)


def test_zero_measurement_is_read_from_the_run_and_drawn_over_the_prediction():
    """What "run it" reads from a compare_versions run (a run-shaped stand-in here: the real
    launch of this path is chapter 03's; this file's one launch is the TP run above)."""
    ctl = zero_controls(stage=2, n=2)
    pred = ctl.prediction
    psi = pred["psi"]
    est = pred["estimate"][2]

    class Run:
        results = [{"serial": [5.0, 4.0], "zero2": {
            "losses": [5.0, 4.0 * (1 + 1e-7)], "psi": psi, "memory": {**est},
            "units": pred["units"]}}, {"zero2": {"memory": {**est, "total": est["total"] - 8}}}]

        @staticmethod
        def events():  # step 2 of rank 0: reduce-scatter of the grads, all-gather of params
            return [{"rank": 0, "lane": "comm", "op": op, "case": "zero2", "step": 2,
                     "bytes": 4 * psi, "t0": 0.0, "t1": 1.0}
                    for op in ("reduce_scatter", "all_gather")] + [
                {"rank": 1, "lane": "comm", "op": "all_gather", "case": "zero2", "step": 2,
                 "bytes": 4 * psi, "t0": 0.0, "t1": 1.0}]

    got = ch03.zero_measured(Run, 2, steps=2)
    assert got["traffic"] == pred["traffic"][2]  # 2Ψ in the paper's count
    assert got["loss_rel_err"] < 1e-5 and set(got["memory"]) == {0, 1}
    fig = zero_memory_figure(pred, got)
    assert "the 2 ranks within 8 bytes" in _title(fig)
    assert [t.name for t in fig.data if "measured" in t.name] == [
        f"{c} (measured, rank 0)" for c in ("params", "grads", "optimizer")]
    assert "measured 2.000Ψ" in _title(zero_traffic_figure(pred, got))


def test_pipeline_panel_draws_the_v_schedules():
    """ZBV and DualPipeV in chapter 05's panel: their own formula (p-1)/(6m+p-1) printed,
    DualPipeV's m moved up to 2p, and a live run given one layer per stage of the V."""
    ctl = pipeline_controls(schedule="zbv", pp=2, m=4)
    assert ctl.message == "" and len(ctl.figures) == 2
    assert f"formula {bubble_formula('zbv', 2, 4):.1%}" in _title(ctl.gantt_fig)
    assert "(p-1)/(6m+p-1)" in ctl.bubble_fig.data[0].name
    assert ctl.widget is not None  # builds the knobs
    ctl._knobs["schedule"].value = "dualpipev"
    ctl._knobs["pp"].value = 4  # DualPipeV needs m >= 2p = 8
    assert ctl.state["m"] == 8 and "4 -> 8" in ctl.message and len(ctl.figures) == 2
    assert ch05.pp_run_kwargs("dualpipev", 4, 8, 1)["layers"] == 8
    ctl.redraw(vpp=2)  # chunks bring interleaving, as for the other schedules
    assert ctl.state["schedule"] == "interleaved" and len(ctl.figures) == 2


def test_hsdp_panel_predicts_bytes_per_group_and_draws_its_groups():
    """Chapter 03's HSDP panel on 4 ranks: R = 1 is ZeRO over all 4 (nothing across), R = 4
    plain data parallelism (nothing inside a one-rank group, the state whole), R = 2 in
    between: ZeRO over 2 and one all-reduce of the half shard across; the cube's groups are
    the layout's."""
    ctl = hsdp_controls(replicas=2, stage=3)
    one, two, four = ctl.rows
    assert one["replicate"] == 0 and four["shard"] == 0
    # ZeRO-3 sends 3Ψ(N-1)/N, an all-reduce 2Ψ(N-1)/N (4 bytes a value; padding apart)
    assert one["shard"] == pytest.approx(1.5 * four["replicate"], rel=1e-3)
    assert two["shard"] == 3 * two["replicate"]  # 3Ψ/2 inside; 2Ψ/2 of the Ψ/2 shard across
    assert two["replicate"] == pytest.approx(four["replicate"] / 3, rel=1e-3)
    assert one["params"] * 4 == pytest.approx(four["params"], rel=1e-3)
    names = [t.name for t in ctl.mesh_fig.data]
    assert "SHARD group 0: [0, 1]" in names and "REPLICATE group 1: [1, 3]" in names
    assert ctl.widget is not None  # builds the knobs
    ctl._knobs["replicas"].value = 4
    assert "SHARD group 3: [3]" in [t.name for t in ctl.mesh_fig.data]
    assert "<b>R = 4 ◀</b>" in ctl.bytes_fig.data[0].x[2]
