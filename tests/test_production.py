"""Chapter 09: Accelerate's run against edu3d's dp2 (one real 2-rank run each), the strategy
map, the FSDP and traffic formulas, the figures and the control panel (no browser)."""

from __future__ import annotations

import pytest

from edu3d.course import ch09_in_production as P
from edu3d.widgets import production as W
from edu3d.widgets.panels.ch09_in_production import controls

# measured: the worst relative loss difference over 3-5 steps was 8.7e-8 (one float32 ulp
# of a loss near 5.5, from DDP's average of two halves against edu3d's bucketed all-reduce)
LOSS_RTOL = 1e-6


@pytest.fixture(scope="module")
def runs():
    from edu3d.production.accelerate_train import notebook_launch

    # edu3d's dp2 run uses the warm pool: conftest sets the default at module scope (54c7cd3)
    return notebook_launch(steps=3), P.edu3d_dp2(steps=3)


def test_accelerate_matches_edu3d_dp2(runs):
    acc, edu = runs
    table, worst = P.loss_table(acc["records"], edu)
    assert len(acc["records"]) == len(edu) == 3
    assert worst < LOSS_RTOL, table
    for a, e in zip(acc["records"], edu):
        assert a["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-5)
        assert a["lr"] == e["lr"]


def test_accelerate_prepare_wrapped_ddp_and_ran_one_all_reduce_per_bucket(runs):
    acc, _ = runs
    w = acc["wrapped"]
    assert (w["model"], w["optimizer"], w["inner_optimizer"]) == (
        "DistributedDataParallel", "AcceleratedOptimizer", "AdamW")
    assert w["backend"] == "gloo" and w["world_size"] == 2
    assert w["distributed_type"].endswith("MULTI_CPU")
    assert w["bucket_cap_mb"] == acc["args"]["bucket_mb"]
    psi_bytes = acc["memory"]["params"]  # DDP replicates: every rank holds 4 bytes x Ψ
    assert sum(w["buckets"]) == psi_bytes  # the buckets cover every gradient once
    steps = {c["step"] for c in acc["collectives"]}
    assert steps == {1, 2, 3}
    assert all(c["op"] == "all_reduce" for c in acc["collectives"])
    tensors = sum(c["params"] for c in acc["collectives"] if c["step"] == 1)
    # AdamW's two moments, unsharded, and one 4-byte step counter per tensor
    assert acc["memory"]["optimizer"] == 2 * psi_bytes + 4 * tensors
    fig = W.accelerate_figure(acc)
    assert "DistributedDataParallel" in {a.text for a in fig.layout.annotations}


def test_strategy_map_names_both_sides_and_the_edu3d_flag():
    from edu3d.commands.train import parse

    for name, s in P.STRATEGIES.items():
        rows = P.strategy_rows(name)
        assert all(len(r) == 3 and all(r) for r in rows)
        parse(s["argv"].split())  # a real layout
    assert "reshard_after_forward=True" in P.STRATEGIES["ZeRO-3"]["torch"]
    assert "reshard_after_forward=False" in P.STRATEGIES["ZeRO-2"]["torch"]
    assert any("bucket_cap_mb" in r[1] for r in P.strategy_rows("DP"))


def test_fsdp_formulas():
    psi, unit, n = 1000, 100, 4
    full = W.fsdp_held("FULL_SHARD", psi, unit, n)
    assert sum(full["at rest"].values()) == pytest.approx(12 * psi / n)  # params + Adam
    assert full["forward"]["gathered"] == 4 * unit  # one unit gathered at a time
    grad_op = W.fsdp_held("SHARD_GRAD_OP", psi, unit, n)
    fwd = grad_op["forward"]
    assert fwd["params"] + fwd["gathered"] == pytest.approx(4 * psi)  # kept until backward
    none = W.fsdp_held("NO_SHARD", psi, unit, n)
    assert sum(none["optimizer step"].values()) == pytest.approx(16 * psi)
    hybrid = W.fsdp_held("HYBRID_SHARD", psi, unit, n, node=2)
    assert hybrid["at rest"]["optimizer"] == pytest.approx(8 * psi / 2)
    assert W.traffic_formula("ZeRO-3", psi, 2) == pytest.approx(1.5 * W.traffic_formula("DP", psi, 2))
    assert W.traffic_formula("PP", psi, 2) is None


def _result(name, scale):
    mem = {"params": 4000 * scale, "grads": 4000 * scale, "optimizer": 8000 * scale}
    return {"name": name, "edu3d_losses": [5.5, 5.4], "torch_losses": [5.5, 5.4],
            "edu3d_step_s": 0.01, "torch_step_s": 0.02, "edu3d_mem": mem, "torch_mem": mem,
            "edu3d_wire_bytes": 1024.0, "worst_rel": 0.0}


def test_controls_dropdown_redraws_mapping_and_comparison():
    results = {"DP": _result("DP", 2), "ZeRO-3": _result("ZeRO-3", 1)}
    ctl = controls(results, strategy="DP", psi=1000)
    title = ctl.mapping_fig.layout.title.text
    cells = ctl.mapping_fig.data[0].cells.values
    ctl.redraw(strategy="ZeRO-3")
    assert ctl.mapping_fig.layout.title.text != title
    assert ctl.mapping_fig.data[0].cells.values != cells
    assert "ZeRO-3" in ctl.comparison_fig.layout.title.text
    held = [t for t in ctl.comparison_fig.data if t.name == "optimizer" and t.offsetgroup == "edu3d"]
    assert list(held[0].y[:1]) == [8000 * 2 / 1024]  # DP's measured bytes, in KiB
    assert ctl.loss_fig is not None
    box = ctl.widget
    assert "edu3d-controls" in box._dom_classes
    assert box.children[0].children[0].description == "strategy"


def test_static_figures_build():
    W.need_figure()
    W.fsdp_figure(1000, 100, highlight="FULL_SHARD")
    off = {k: {"losses": [1.0], "step_s": 0.01, "mem": {"params": 1, "grads": 1, "optimizer": o},
               "host_bytes": h, "moved_bytes": m}
           for k, o, h, m in (("device", 8, 0, 0), ("offload", 0, 16, 8))}
    assert "identical" in W.offload_figure(off).layout.title.text


def test_deepspeed_config_maps_edu3d_options_and_its_recorded_run_matches(runs):
    from edu3d.config.sections import Run
    from edu3d.production import deepspeed_map as D

    args = Run.of(dp=2, microbatches=2, bucket_mb=25.0)
    cfg = D.ds_config(args, stage=3, offload=True)
    assert cfg["train_batch_size"] == args.batch.global_batch
    assert cfg["train_micro_batch_size_per_gpu"] * 2 * cfg["gradient_accumulation_steps"] == 8
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 25 * 2**20 // 4  # elements
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert cfg["gradient_clipping"] == args.training.clip
    assert "offload_optimizer" not in D.ds_config(args, stage=1)["zero_optimization"]
    fields = {f[0].split(" ")[0] for f in D.FIELDS}
    assert {"train_batch_size", "gradient_clipping", "zero_optimization.stage"} <= fields
    # the committed DeepSpeed run (2 CPU ranks) against this session's edu3d dp2
    _, edu = runs
    record = D.measured()
    assert [r["spec"] for r in record] == list(D.SPECS)
    for r in record:
        for mine, theirs in zip(edu, r["losses"]):
            assert theirs == pytest.approx(mine["loss"], rel=LOSS_RTOL)
    stage3 = next(r for r in record if r["spec"] == "3")
    assert stage3["param_bytes"] * 2 == record[0]["param_bytes"]  # ZeRO-3 halves them at dp=2
