"""The planner's fourth and fifth axes: experts (EP) and the sequence (CP), in numbers.

* a dense model counts, fits and costs exactly as before (a MoESpec with no experts too);
* the routed experts' parameters divide by ep exactly; ZeRO shards them over the
  expert-data-parallel group (dp·cp/ep), the dense state over dp·cp;
* Mixtral-8x7B and DeepSeek-V3 have their published total and active parameters (2%);
* the EP and CP byte formulas on hand-worked examples, and the rows of ``traffic``;
* ``edu3d plan`` refuses what cannot work, saying what would; the real systems' layouts fit
  80 GB where a naive one does not. No launches.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from edu3d.commands import plan as planner
from edu3d.model import shapes
from edu3d.plan import formulas
from edu3d.plan import estimate as est
from edu3d.plan import search
from edu3d.plan.formulas import MoESpec, as_moe
from edu3d.plan.moe_presets import MOE_PRESETS, MOE_PUBLISHED
from edu3d.config.sections import Run

MIXTRAL = MOE_PRESETS["mixtral-8x7b"]
DEEPSEEK = MOE_PRESETS["deepseek-v3"]
BF16 = dict(precision="bf16", microbatches=4)


def test_a_dense_model_is_unchanged():
    cl = search.Cluster(64)
    for name in ("llama2-7b", "llama2-70b", "gpt3-175b", "tiny"):
        spec = shapes.spec_from(name)
        assert as_moe(spec).num_params() == spec.num_params()
        assert as_moe(spec).active_params() == spec.num_params()
        for st in (est.setup(dp=4, zero=1, **BF16), est.setup(dp=2, tp=2, pp=2, sp=True, **BF16),
                   est.setup(dp=4, zero=3, recompute="full", **BF16)):
            assert est.estimate(as_moe(spec), st) == est.estimate(spec, st)
            assert search.step_time(as_moe(spec), st, cl) == search.step_time(spec, st, cl)
            t = search.traffic(spec, st)
            assert t["ep"] == t["cp"] == t["edp"] == 0
    # the dense cost model's rows, as before this change: 2(N-1)/N of the 16-bit gradients
    spec = shapes.spec_from("llama2-7b")
    st = est.setup(dp=8, **BF16)
    assert search.traffic(spec, st)["dp"] == 2 * 7 / 8 * 2 * est.held(spec, st, 0)
    # the search's recommendation is the performance model's prediction of that layout, and
    # never below the floor its branch and bound prunes with
    best = search.search(shapes.spec_from("llama2-70b"), cl)[0]
    assert best["time"]["total"] == search.step_time(shapes.spec_from("llama2-70b"),
                                                     best["setup"], cl)["total"]
    assert best["time"]["total"] >= search.floor(shapes.spec_from("llama2-70b"), best["setup"], cl)


def test_published_totals_and_active_parameters():
    for name, (total, active) in MOE_PUBLISHED.items():
        spec = MOE_PRESETS[name]
        assert abs(spec.num_params() / total - 1) < 0.02, (name, spec.num_params())
        assert abs(spec.active_params() / active - 1) < 0.02, (name, spec.active_params())
    assert round(MIXTRAL.num_params() / 1e9, 1) == 46.7
    assert round(MIXTRAL.active_params() / 1e9, 1) == 12.9
    assert DEEPSEEK.moe_layers == 58 and not DEEPSEEK.is_moe(2) and DEEPSEEK.is_moe(3)
    # the routed experts are most of the model, and the dense MoE (k = E) is all of it
    assert MIXTRAL.expert_params() == 32 * 8 * 3 * 4096 * 14336
    every = dataclasses.replace(MIXTRAL, topk=8)
    assert every.active_params() == every.num_params()
    # moe_every: every other block is MoE
    half = dataclasses.replace(MIXTRAL, moe_every=2)
    assert half.moe_layers == 16


def test_expert_parameters_divide_by_ep_exactly():
    for ep in (1, 2, 4, 8):
        st = est.setup(dp=8, ep=ep, **BF16)
        assert est.held(MIXTRAL, st, 0, experts=True) * ep == MIXTRAL.expert_params()
        dense = est.held(MIXTRAL, st, 0)
        assert dense + MIXTRAL.expert_params() == MIXTRAL.num_params()  # tp=1 pp=1: all of it
        got = est.state_per_rank(MIXTRAL, st, 0, at="rest")
        assert got["params"] == 2 * (dense + MIXTRAL.expert_params() // ep)
    # tp splits the attention, not the experts (whole on every tp rank)
    st = est.setup(dp=4, tp=2, ep=4, **BF16)
    assert est.held(MIXTRAL, st, 0, experts=True) == MIXTRAL.expert_params() // 4


def test_zero_shards_experts_over_the_expert_data_parallel_group():
    for zero in (1, 2, 3):
        st = est.setup(dp=8, ep=4, zero=zero, **BF16)  # expert-DP of 2, dense DP of 8
        d, x = est.held(MIXTRAL, st, 0), est.held(MIXTRAL, st, 0, experts=True)
        got = est.state_per_rank(MIXTRAL, st, 0, at="rest")
        want = {"params": 2 * (d / 8 + x / 2) if zero == 3 else 2 * (d + x),
                "grads": 2 * (d / 8 + x / 2) if zero >= 2 else 2 * (d + x),
                "optimizer": 12 * (d / 8 + x / 2)}
        for c in want:  # flat buffers padded to a multiple of n; AdamW's step counters
            assert abs(got[c] / want[c] - 1) < 1e-4, (zero, c, got[c], want[c])
    # cp ranks are data-parallel for the weights: ZeRO over dp*cp, experts over dp*cp/ep
    st = est.setup(dp=4, cp=2, ep=4, zero=1, **BF16)
    assert st.layout.edp == 2 and st.world_size == 8
    assert est.state_per_rank(MIXTRAL, st, 0, at="rest") == est.state_per_rank(
        MIXTRAL, est.setup(dp=8, ep=4, zero=1, **BF16), 0, at="rest")
    with pytest.raises(ValueError, match="shards over dp\\*cp"):
        est.validate(MIXTRAL, est.setup(zero=1))


def test_ep_and_cp_bytes_on_hand_examples():
    # EP: dispatch + combine, forward and backward: 4 x (EP-1)/EP x T·k·h values
    assert formulas.ep_bytes(4096, 2, 4096, 8) == 4 * 7 / 8 * 4096 * 2 * 4096 * 2
    assert formulas.ep_bytes(4096, 2, 4096, 1) == 0
    # CP, s=8 tokens, h=4, cp=4: a rank's K and V chunk is 2 x 2 x 4 = 16 values; the ring
    # sends it cp-1 times forward, cp-1 again and dK,dV cp times backward: 3cp-2 (issue 40)
    assert formulas.cp_bytes("ring", 8, 1, 4, 4, value_bytes=1) == 10 * 16
    assert formulas.cp_bytes("allgather", 8, 1, 4, 4, value_bytes=1) == 2 * 3 * 16
    # Ulysses: 4 all-to-alls of (s/cp)·h = 8 values, 3/4 of each leaves, forward and backward
    assert formulas.cp_bytes("ulysses", 8, 1, 4, 4, value_bytes=1) == 2 * 4 * 8 * 3 / 4
    assert formulas.cp_bytes("ring", 8, 1, 4, 4, kv_h=1, value_bytes=1) == 10 * 4  # GQA
    # traffic's rows: per MoE block and micro-batch of the pipeline rank
    st = est.setup(dp=8, pp=4, ep=8, microbatches=16, precision="bf16")
    t = search.traffic(MIXTRAL, st)
    assert t["ep"] == formulas.ep_bytes(4096, 2, 4096, 8) * 32 / 4 * 16
    st = est.setup(dp=4, cp=2, pp=4, ep=8, microbatches=16, precision="bf16")
    assert search.traffic(MIXTRAL, st)["cp"] == formulas.cp_bytes(
        "ring", 4096, 1, 4096, 2, kv_h=1024) * 32 / 4 * 16


def test_activations_divide_by_cp_and_grow_with_topk():
    st = est.setup(dp=2, pp=2, recompute="selective", **BF16)
    one = est.stage_activation_bytes(MIXTRAL, st)
    two = est.stage_activation_bytes(MIXTRAL, st.replace(cp=2))
    assert [a / 2 for a in one] == two
    # a MoE block with one expert, top-1, no router: the dense MLP plus the dispatched copy
    # of its input and the expert's output (2 sbh in 16 bits) and the router's fp32 2 sbE
    s, b, h = 4096, 1, 4096
    moe = dataclasses.replace(MIXTRAL, experts=1, topk=1)
    dense = formulas.mlp_activation_bytes(s, b, h, 14336, mlp="swiglu")
    assert formulas.moe_mlp_activation_bytes(moe, s, b) == dense + 2 * 2 * s * b * h + 8 * s * b
    k4 = dataclasses.replace(MIXTRAL, topk=4)
    assert (est.stage_activation_bytes(k4, st)[1] > est.stage_activation_bytes(MIXTRAL, st)[1])
    # compute follows the active parameters: twice the routed experts per token, more time
    cl, st = search.Cluster(8), est.setup(dp=8, ep=8, **BF16)
    assert (search.step_time(k4, st, cl)["compute"] > search.step_time(MIXTRAL, st, cl)["compute"]
            > search.step_time(dataclasses.replace(MIXTRAL, topk=1), st, cl)["compute"])


def test_search_enumerates_ep_and_cp_cheaply():
    cl = search.Cluster(16)
    mix = list(search.candidates(MIXTRAL, cl, 64))
    assert {st.layout.ep for st in mix} == {1, 2, 4, 8} and {st.layout.cp for st in mix} == {1}
    long = dataclasses.replace(MIXTRAL, seq_len=32768)
    # cp while a rank keeps >= 4096 tokens: 32768 / 16 = 2048 is too few
    assert {st.layout.cp for st in search.candidates(long, cl, 64)} == {1, 2, 4, 8}
    dense = list(search.candidates(shapes.spec_from("llama2-7b"), cl, 64))
    assert {(st.layout.ep, st.layout.cp) for st in dense} == {(1, 1)}
    uly = search.candidates(long, cl, 64, cp_impl="ulysses")
    assert all(32 % (st.layout.cp * st.layout.tp) == 0 for st in uly)


def _plan(capsys, *argv):
    code = planner.plan_main([*argv, "--json"])
    cap = capsys.readouterr()
    return code, (json.loads(cap.out) if cap.out else None), cap.err


def test_cli_refuses_what_cannot_work(capsys):
    code, _, err = _plan(capsys, "--model", "mixtral-8x7b", "--dp", "8", "--ep", "3")
    assert code == 2 and "ep=3 must divide experts=8 and dp*cp=8; choose ep in [1, 2, 4, 8]" in err
    code, _, err = _plan(capsys, "--model", "llama2-7b", "--dp", "2", "--ep", "2")
    assert code == 2 and "--ep need(s) a mixture of experts: add --experts E" in err
    code, _, err = _plan(capsys, "--model", "llama2-7b", "--topk", "2")
    assert code == 2 and "--topk need(s) a mixture of experts" in err
    code, _, err = _plan(capsys, "--model", "mixtral-8x7b", "--topk", "9")
    assert code == 2 and "--topk 9 is more than the 8 experts" in err
    code, _, err = _plan(capsys, "--model", "mixtral-8x7b", "--cp", "64", "--cp-impl", "ulysses")
    assert code == 2 and "ulysses: cp*tp = 64 must divide n_heads=32" in err
    code, _, err = _plan(capsys, "--model", "mixtral-8x7b", "--cp", "3")
    assert code == 2 and "cp=3 must divide seq=4096" in err
    code, _, err = _plan(capsys, "--model", "mixtral-8x7b", "--gpus", "64", "--ep", "8")
    assert code == 2 and "the search tries every ep and cp itself" in err
    code, _, err = _plan(capsys, "--model", "mixtral-8x7b", "--gpus", "64", "--dp", "8")
    assert code == 2 and "dp*cp*tp*pp = 8 but --gpus 64" in err


def test_moe_presets_fit_where_the_real_systems_did(capsys):
    # Mixtral on 64 H100s: the search's layout fits; every expert on every GPU does not
    code, out, _ = _plan(capsys, "--model", "mixtral-8x7b", "--gpus", "64")
    rec = out["recommended"]
    assert code == 0 and out["fits"] and rec["dp"] * rec["cp"] * rec["tp"] * rec["pp"] == 64
    assert any("ep=" in r for r in rec["reasons"])
    code, out, _ = _plan(capsys, "--model", "mixtral-8x7b", "--dp", "64", "--zero", "1",
                         "--recompute", "selective", "--gpu-mem", "80")
    assert code == 1 and out["params_bytes"] > 80e9  # 46.7 B bf16 weights on every GPU
    # DeepSeek-V3 on 2048 GPUs as trained: PP 16, EP 64, ZeRO-1 data parallelism
    real = ["--model", "deepseek-v3", "--dp", "128", "--pp", "16", "--zero", "1",
            "--recompute", "full", "--gpu-mem", "80"]
    code, out, _ = _plan(capsys, *real, "--ep", "64")
    assert code == 0 and out["total_bytes"] < 0.9 * 80e9
    assert out["traffic_bytes"]["ep"] > 0 and out["active_params"] < out["num_params"] / 15
    code, out, _ = _plan(capsys, *real)  # ep=1: 256 experts a block on every GPU
    assert code == 1 and out["total_bytes"] > 80e9


def test_estimate_for_train_options():
    dense = Run.of(dp=2, zero=1, global_batch=8)
    assert est.estimate_for(dense) == est.estimate(est.spec_of(dense), dense)
    moe = dense.replace(dp=4, experts=4, topk=2, ep=2, cp=1)
    spec, st = est.spec_of(moe), moe
    assert isinstance(spec, MoESpec) and spec.experts == 4 and st.layout.ep == 2 and st.layout.edp == 2
    got = est.estimate_for(moe, at="rest")
    assert got["num_params"] > got["active_params"] == spec.active_params()
    assert got["params_bytes"] == 4 * (est.held(spec, st, 0) + est.held(spec, st, 0, True))


def test_the_reasons_name_the_stages_as_they_are_cut(capsys):
    """DeepSeek-V3's 61 layers over 32 stages are 29 stages of 2 and 3 of 1; the reasons once
    said "1 layers per stage" (61 // 32)."""
    code, out, _ = _plan(capsys, "--model", "deepseek-v3", "--gpus", "2048")
    pp = out["recommended"]["pp"]
    q, r = divmod(61, pp)
    want = f"{r} stages of {q + 1} layers and {pp - r} of {q}" if r else f"{q} layers per stage"
    assert code == 0 and any(f"pp={pp}: {want}" in x for x in out["recommended"]["reasons"]), \
        out["recommended"]["reasons"]
