"""The performance model piece by piece (edu3d/plan: kernels, roofline, links, stage_costs,
step, recipes, cluster) on hand-checkable cases, and ``edu3d plan``'s new options. Torch-free,
no launches, a few seconds in all; no timing is asserted."""

from __future__ import annotations

import dataclasses
import json

import pytest

from edu3d import cli
from edu3d.config.layout import Layout
from edu3d.config.sections import Run
from edu3d.model.shapes import spec_from
from edu3d.plan import kernels, links, recipes, roofline, search, stage_costs, step
from edu3d.plan.estimate import estimate, setup, spec_of
from edu3d.plan.hardware import HARDWARE_DIR, load_profile
from edu3d.plan.formulas import MoESpec
from edu3d.plan.kernels import Op
from edu3d.plan.stage_costs import cut_of

H100 = load_profile("h100-sxm")
LLAMA = spec_from("llama2-7b")
BF16 = dict(precision="bf16")


def cut(spec=LLAMA, **flags):
    run = setup(**{**BF16, **flags})
    return cut_of(spec, run, recipes.recipe_of("megatron")), run


def flops(ops, phase=None, kind="matmul"):
    return sum(o.flops for o in ops if o.kind == kind and (phase is None or o.phase == phase))


# ---- kernels: what a layer computes ---------------------------------------------------------
def test_a_layers_matmuls_are_6_flops_per_parameter_and_token_split_by_tp():
    params = sum(k for n, k, _ in LLAMA.layer_tensors() if n.endswith(".w") and "ln" not in n)
    for tp in (1, 2, 4):
        c, _ = cut(tp=tp, micro_batch=2)
        ops, _ = kernels.layer(c, "none")
        assert flops(ops) == pytest.approx(6 * params * c.tokens / tp)
        # forward, input gradient and weight gradient each a third
        assert flops(ops, "F") == flops(ops, "I") == flops(ops, "W")


def test_attention_is_causal_with_flash_and_a_full_square_without():
    c, _ = cut()
    s, h = LLAMA.seq_len, LLAMA.d_model
    flash = kernels.attention_core(c)
    assert flops(flash, "F", "attention") == 2 * s * s * h  # 4·s²·h halved by the mask
    assert flops(flash, "I", "attention") == 2.5 * 2 * s * s * h
    scores = kernels.attention_core(dataclasses.replace(c, flash=False))
    assert flops(scores, "F") == 4 * s * s * h  # QK^T and PV over the whole square
    assert any(o.name == "softmax" for o in scores)


def test_recomputation_reruns_what_it_recomputes():
    c, _ = cut()
    base, _ = kernels.layer(c, "none")
    fwd = flops(base, "F")
    for mode, share in (("full", 1.0), ("selective", 0.0)):
        ops, _ = kernels.layer(c, mode)
        assert flops(ops, "R") == pytest.approx(share * fwd)
    sel, _ = kernels.layer(c, "selective")
    assert flops(sel, "R", "attention") == flops(base, "F", "attention")
    op, _ = kernels.layer(c, "op")  # torchtitan: every memory-bound op, every second matmul
    assert {o.kind for o in op if o.phase == "R"} == {"matmul", "memory"}
    assert 0 < flops(op, "R") < fwd


def test_a_moe_layer_computes_its_k_experts_and_a_frozen_layer_no_weight_gradients():
    moe = MoESpec(**dataclasses.asdict(LLAMA), experts=8, topk=2)
    c, run = cut(moe, dp=8, ep=8)
    dense, _ = kernels.layer(c, "none")
    ops, comms = kernels.layer(c, "none", stage_costs.moe_args(moe, run))
    mlp = 3 * 2 * c.tokens * LLAMA.d_model * LLAMA.ff  # one dense MLP's forward
    assert flops(ops, "F") - flops(dense, "F") == pytest.approx(mlp, rel=0.02)  # k=2 of 8, x2
    assert [m.kind for m in comms if m.axis == "ep"] == ["all_to_all"] * 4
    frozen, _ = kernels.layer(c, "none", None, 1.0)
    assert flops(frozen, "W") == 0 and flops(frozen, "F") == flops(dense, "F")


def test_tensor_parallel_collectives_per_layer():
    c, _ = cut(tp=4)
    _, comms = kernels.layer(c, "none")
    assert [m.kind for m in comms] == ["all_reduce"] * 4  # f and g, forward and backward
    c, _ = cut(tp=4, sp=True)
    _, comms = kernels.layer(c, "full")
    kinds = [m.kind for m in comms if m.phase != "R"]
    assert sorted(kinds) == ["all_gather"] * 4 + ["reduce_scatter"] * 4
    assert len([m for m in comms if m.phase == "R"]) == 4  # the forward's, again


# ---- roofline: how long an op takes -----------------------------------------------------------
def test_roofline_memory_bound_and_compute_bound():
    mem = Op("norm", "memory", "F", 0.0, 1e9)
    assert roofline.op_time(mem, H100, "bf16") == pytest.approx(
        1e9 / (H100.mem_bandwidth * H100.mem_efficiency))
    big = Op("mm", "matmul", "F", 1e14, 1e8)
    rate = H100.peak_flops["bf16"] * roofline.matmul_efficiency(H100, 1e14) * H100.sustained
    assert roofline.op_time(big, H100, "bf16") == pytest.approx(1e14 / rate)
    half = roofline.matmul_efficiency(H100, H100.matmul_half_flops)
    assert half == pytest.approx(H100.matmul_efficiency / 2)
    assert roofline.peak(H100, "fp8") == 2 * roofline.peak(H100, "bf16")
    assert roofline.peak(H100, "fp32") == H100.peak_flops["tf32"]  # a GPU's fp32 matmuls


def test_launches_hide_behind_big_kernels_and_add_on_a_cpu():
    tiny = [Op("add", "memory", "F", 0.0, 1e3)] * 100
    device = sum(roofline.op_time(o, H100, "bf16") for o in tiny)
    gpu = roofline.stretch_time(tiny, H100, "bf16")
    assert gpu == pytest.approx(max(device, 0) + 100 * H100.kernel_overhead, rel=0.01)
    big = [Op("mm", "matmul", "F", 1e13, 1e8)] * 10
    assert roofline.stretch_time(big, H100, "bf16") == pytest.approx(
        sum(roofline.op_time(o, H100, "bf16") for o in big))
    # the host's lead carries over: tiny kernels before big ones cost only where the launches
    # outlast the whole stretch's device time (a layer repeated: the slower of the two rates)
    mixed = tiny + big
    assert roofline.stretch_time(mixed, H100, "bf16") == pytest.approx(
        sum(roofline.op_time(o, H100, "bf16") for o in mixed))
    cpu = dataclasses.replace(H100, cores=2)
    one = roofline.stretch_time(big, cpu, "bf16")
    assert one == pytest.approx(sum(roofline.op_time(o, cpu, "bf16") for o in big)
                                + 10 * H100.kernel_overhead)
    assert roofline.stretch_time(big, cpu, "bf16", ranks_per_core=2) == pytest.approx(2 * one)


# ---- links: collectives on the links a group spans ------------------------------------------
def test_alpha_beta_and_where_a_group_sits():
    link = links.Link("x", 1e-6, 100e9, 50e9)
    assert links.collective_time("all_reduce", 1e9, 8, link) == pytest.approx(
        14e-6 + 2 * 7 / 8 * 1e9 / 100e9)
    assert links.collective_time("all_gather", 1e9, 8, link) == pytest.approx(
        7e-6 + 7 / 8 * 1e9 / 50e9)
    assert links.collective_time("send", 1e6, 2, link) == pytest.approx(1e-6 + 1e6 / 50e9)
    assert links.collective_time("all_reduce", 1e9, 1, link) == 0
    lay = Layout(dp=16, tp=8, pp=2)
    tp_link, n = links.group_link(H100, lay, "tp")
    assert n == 8 and tp_link.name == "intra-node"
    dp_link, n = links.group_link(H100, lay, "dp")  # one GPU per node: one NIC's share
    assert n == 16 and dp_link.name.startswith("inter-node (16")
    assert dp_link.gather == pytest.approx(H100.inter_bandwidth_at(16, gather=True) / 8)
    assert links.placement(2, 4, 8) == (1, 4) and links.placement(8, 4, 8) == (4, 1)
    # a measured falloff is the ring's length, not the node count: 32 ranks one per node
    # are charged what 32 ranks on 4 whole nodes measured, at one NIC's share
    hf = load_profile("h100-sxm-hf")
    ring = links.link_for(hf, 32, 1)
    assert ring.gather == pytest.approx(hf.inter_bandwidth_at(4, gather=True) / 8)
    assert links.link_for(hf, 32, 8).gather == pytest.approx(
        hf.inter_bandwidth_at(32, gather=True))
    with pytest.raises(ValueError, match="collective 'scatter'"):
        links.collective_time("scatter", 1, 2, link)


# ---- the step ---------------------------------------------------------------------------------
def test_the_parts_add_up_and_the_bubble_comes_out_of_the_replay():
    for flags in (dict(dp=8), dict(tp=4, dp=2, sp=True), dict(pp=4, microbatches=8),
                  dict(pp=4, microbatches=8, schedule="interleaved", vpp=2),
                  dict(pp=2, microbatches=4, schedule="zb-h1"), dict(dp=4, zero=3),
                  dict(pp=2, microbatches=8, schedule="zbv"),
                  dict(pp=2, microbatches=8, schedule="dualpipev")):
        pred = step.predict(LLAMA, setup(**BF16, **flags), H100, "megatron")
        assert sum(pred.parts.values()) == pytest.approx(pred.step_time)
        assert pred.tokens_per_s_per_gpu * pred.step_time * setup(**BF16, **flags).world_size \
            == pytest.approx(setup(**BF16, **flags).batch.global_batch * LLAMA.seq_len)
        assert 0 < pred.mfu < 1
    one = step.predict(LLAMA, setup(pp=4, microbatches=4, **BF16), H100, "megatron")
    many = step.predict(LLAMA, setup(pp=4, microbatches=16, **BF16), H100, "megatron")
    share = lambda p: p.parts["bubble"] / p.step_time  # noqa: E731
    assert share(one) > 2 * share(many) > 0  # (p-1)/(m+p-1) shrinks with m


def test_what_overlaps_costs_less():
    tp = setup(tp=8, sp=True, **BF16)
    assert (step.predict(LLAMA, tp.replace(tp_overlap=True), H100, "megatron").parts["tp"]
            < step.predict(LLAMA, tp, H100, "megatron").parts["tp"])
    fsdp = setup(dp=8, zero=3, microbatches=4, **BF16)
    eager = dataclasses.replace(recipes.recipe_of("torchtitan"), prefetch=False)
    assert (step.predict(LLAMA, fsdp, H100, "torchtitan").parts["dp"]
            < step.predict(LLAMA, fsdp, H100, eager).parts["dp"])
    # edu3d's own DDP: buckets (and per-tensor "overlap") reduce while backward runs, a flat
    # buffer after it, one all-reduce per tensor ("naive") pays a latency each
    course = Run.of(model="tiny", dp=2, global_batch=8)
    dp = {impl: step.predict(spec_of(course), course.replace(dp_impl=impl, bucket_mb=0.01),
                             "cpu-reference", memory=False).parts["dp"]
          for impl in ("bucketed", "overlap", "flat", "naive")}
    assert dp["bucketed"] < dp["flat"] < dp["naive"] and dp["overlap"] < dp["flat"]


def test_a_bigger_micro_batch_runs_bigger_matmuls_and_crossing_nodes_costs_latency():
    small = step.predict(LLAMA, setup(dp=8, microbatches=8, **BF16), H100, "megatron")
    big = step.predict(LLAMA, setup(dp=8, microbatches=1, micro_batch=8, **BF16), H100,
                       "megatron")
    assert big.matmul_efficiency > small.matmul_efficiency and big.step_time < small.step_time
    within = step.predict(LLAMA, setup(pp=2, microbatches=8, **BF16), H100, "megatron")
    across = step.predict(LLAMA, setup(pp=2, dp=8, microbatches=8, **BF16), H100, "megatron")
    assert across.parts["pp"] > within.parts["pp"] > 0


def test_the_timeline_is_edu3ds_event_schema_marked_simulated():
    run = setup(pp=2, microbatches=4, **BF16)
    pred = step.predict(LLAMA, run, H100, "megatron", timeline=True)
    compute = [e for e in pred.events if e["lane"] == "compute"]
    assert compute and all(e["sim"] is True for e in pred.events)
    assert {e["op"] for e in compute} == {"F", "B"} and {e["mb"] for e in compute} == set(range(4))
    assert max(e["t1"] for e in pred.events) == pytest.approx(
        (pred.step_time - pred.parts["dp"] - pred.parts["optimizer"]) * 1e6, rel=1e-6)


def test_what_the_model_refuses():
    with pytest.raises(ValueError, match="tp=3 must divide n_heads"):
        step.predict(LLAMA, setup(tp=3, **BF16), H100)
    with pytest.raises(ValueError, match="not something edu3d runs; weigh it with a framework"):
        step.predict(LLAMA, setup(**BF16).replace(recompute="op"), H100)
    with pytest.raises(ValueError, match="unknown recipe 'mosaic'"):
        step.predict(LLAMA, setup(**BF16), H100, "mosaic")


def test_edu3d_fp8_runs_its_linears_at_the_fp8_peak():
    """edu3d trains --precision fp8 (its blocks' linear layers): the model weighs it on the
    edu3d recipe too, faster than bf16 on an H100 (the fp8 peak, less the casts) but not
    twice (attention and the head stay bf16)."""
    bf16 = step.predict(LLAMA, setup(**BF16), H100)
    fp8 = step.predict(LLAMA, setup(**BF16).replace(precision="fp8"), H100)
    assert 1.0 < bf16.step_time / fp8.step_time < 2.0


# ---- memory recipes ---------------------------------------------------------------------------
def test_bytes_per_parameter_of_each_recipe():
    run = setup(dp=8, zero=1, **BF16)
    psi = recipes.held(LLAMA, run, 0)
    per = {name: recipes.state(LLAMA, run, recipes.recipe_of(name), 0) for name in
           ("megatron", "nanotron", "deepspeed")}
    assert per["megatron"]["grads"] == 4 * psi and per["megatron"]["optimizer"] == 12 * psi / 8
    assert per["nanotron"]["grads"] == 6 * psi  # bf16 gradients and an fp32 accumulator
    z2 = setup(dp=8, zero=2, **BF16)
    assert recipes.state(LLAMA, z2, recipes.recipe_of("deepspeed"), 0)["grads"] == 6 * psi
    fsdp = recipes.state(LLAMA, setup(dp=8, zero=3, **BF16), recipes.recipe_of("torchtitan"), 0)
    assert sum(fsdp.values()) == pytest.approx(16 * psi / 8)


def test_a_v_schedule_is_placed_by_its_v_and_replayed_or_closed_alike():
    """ZBV/DualPipeV put stages 0 and 2p-1 on rank 0: the step reads each rank's stages off
    the schedule's placement, and its closed form stays near the replay."""
    run = setup(pp=2, microbatches=8, schedule="zbv", **BF16)
    replayed = step.predict(LLAMA, run, H100, "megatron", memory=False)
    closed = step.predict(LLAMA, run, H100, "megatron", memory=False, replay_limit=1)
    assert closed.step_time == pytest.approx(replayed.step_time, rel=0.05)
    loop = step.predict(LLAMA, setup(pp=2, microbatches=8, **BF16), H100, "megatron")
    assert replayed.parts["bubble"] < loop.parts["bubble"]


def test_fsdp2s_root_unit_and_a_compiled_loss():
    """torchtitan's root unit (embedding, head) is whole through the backward: 16-bit weights
    and the head's gradient, 6·V·h bytes untied; compiled (2025 recipe), the loss keeps
    16-bit logits and one 16-bit gradient instead of fp32 ones."""
    run = setup(dp=8, zero=3, **BF16)
    titan = recipes.recipe_of("torchtitan")
    rows = LLAMA.vocab_rows(1) * LLAMA.d_model
    assert recipes.root_held(LLAMA, run, titan, 0) == 6 * rows
    assert recipes.root_held(LLAMA, setup(dp=4, pp=2, zero=3, microbatches=2, **BF16), titan,
                             0) == 0  # under a pipeline no unit reshards: held already
    assert recipes.root_held(LLAMA, run, recipes.recipe_of("megatron"), 0) == 0
    assert (recipes.memory(LLAMA, run, titan)["comm"]
            - recipes.memory(LLAMA, run, dataclasses.replace(titan, root_unit=False))["comm"]
            == 6 * rows)
    compiled = setup(dp=8, zero=3, compile=True, **BF16)
    new = recipes.recipe_of("torchtitan-2025")
    assert recipes.loss_bytes(compiled, new, 10) == (20, 20)
    assert recipes.loss_bytes(run, new, 10) == recipes.loss_bytes(compiled, titan, 10) == (40, 80)


def test_edu3ds_recipe_is_the_exact_estimate_and_the_others_add_allocator_and_runtime():
    run = Run.of(model="tiny", dp=2, global_batch=8)
    pred = step.predict(spec_of(run), run, H100)
    assert pred.memory["allocated"] == estimate(spec_of(run), run)["total_bytes"]
    assert pred.memory["device"] == pytest.approx(
        pred.memory["allocated"] * H100.allocator_factor + H100.runtime_memory)
    flash = recipes.layer_activations(LLAMA, setup(**BF16), "none")
    op = recipes.layer_activations(LLAMA, setup(**BF16), "op")
    full = recipes.layer_activations(LLAMA, setup(**BF16), "full")
    assert flash > op > full == 2 * LLAMA.seq_len * LLAMA.d_model


# ---- the cluster and edu3d plan ---------------------------------------------------------------
def test_the_clusters_old_knobs_override_the_profile():
    cl = search.Cluster(8, peak_tflops=500.0, intra_gbps=100.0, mfu=0.5)
    prof = search.profile_of(cl)
    assert prof.peak_flops["bf16"] == 500e12 and prof.matmul_efficiency == 0.5
    assert prof.intra_bandwidth == 100e9 and prof.intra_gather_bandwidth <= 100e9
    assert search.Cluster(8).peak_tflops == H100.peak_flops["bf16"] / 1e12
    cpu = search.Cluster(4, hardware=str(HARDWARE_DIR / "a100-80gb.json"))
    assert search.profile_of(cpu).name == "a100-80gb"


def test_the_search_prefers_bigger_micro_batches_where_they_fit():
    """Issue 35: the old planner chose micro-batch 1 for every model; published runs of these
    shapes use 2 to 14 sequences, and the search (with the framework's recipe) now agrees
    that more than one is faster."""
    from edu3d.plan import validate

    by_id = {r.id: r for r in validate.load_runs()}
    for rid in ("llm-foundry-mpt-7b-h100-sxm-8gpu-seq2048",
                "llm-foundry-mpt-1b-h100-sxm-8gpu-seq2048",
                "llm-foundry-mpt-13b-a100-80gb-8gpu-seq2048"):
        row = by_id[rid]
        cl = search.Cluster(row.gpus, hardware=row.hardware, recipe=row.recipe)
        rows = search.search(validate.spec_of(row), cl, row.global_batch)
        assert rows[0]["fits"] and rows[0]["setup"].micro_batch > 1, rid
        assert any("micro-batch" in r and "of peak" in r
                   for r in search.reasons(validate.spec_of(row), cl, rows))


def plan(capsys, *argv):
    code = cli.main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_edu3d_plan_predicts_and_validates(capsys):
    code, out, _ = plan(capsys, "--model", "llama2-7b", "--dp", "8", "--zero", "1",
                        "--hardware", "a100-80gb", "--recipe", "megatron", "--json")
    got = json.loads(out)
    assert code in (0, 1) and got["prediction"]["hardware"] == "a100-80gb"
    assert got["prediction"]["recipe"] == "megatron" and "total_bytes" in got
    code, out, _ = plan(capsys, "--validate", "--hardware", "a100-40gb", "--json")
    got = json.loads(out)
    assert code == 0 and {r["hardware"] for r in got["rows"]} == {"a100-40gb"}
    assert got["summary"]["overall"]["throughput"]["rows"] == len(got["rows"]) >= 3


@pytest.mark.parametrize("argv,message", [
    (["--model", "tiny", "--mfu", "0.4"], "--mfu: MFU is now what the model predicts"),
    (["--model", "tiny", "--hardware", "tpu9"], "unknown hardware profile 'tpu9'"),
    (["--validate", "--hardware", "h900"], "unknown hardware profile 'h900'"),
    (["--dp", "2"], "give --model NAME or --params N (or --validate)"),
])
def test_edu3d_plan_refuses_in_one_line(capsys, argv, message):
    code, _, err = plan(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_profile_file_missing_a_constant_or_with_nonsense_is_refused(capsys, tmp_path):
    data = json.loads((HARDWARE_DIR / "h100-sxm.json").read_text())
    del data["sustained"]
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps(data))
    code, _, err = plan(capsys, "--model", "tiny", "--hardware", str(missing))
    assert code == 2 and "missing constant sustained" in err and "Traceback" not in err
    data = json.loads((HARDWARE_DIR / "h100-sxm.json").read_text())
    data["link"]["intra"]["gather_bandwidth"]["value"] = -5
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    code, _, err = plan(capsys, "--validate", "--hardware", str(bad))
    assert code == 2 and "gather_bandwidth = -5 is outside" in err
