"""The planner's ZeRO-2/3 under micro-batches: ``grad_reduce`` per-microbatch or per-step.

The ZeRO paper's figure 1 (7.5B parameters, N_d = 64, mixed-precision Adam, K = 12: 120 /
31.4 / 16.6 / 1.9 GB for DDP / ZeRO-1 / ZeRO-2 / ZeRO-3) must come out of the planner and of
``edu3d plan`` at any micro-batch count when gradients are reduce-scattered every
micro-batch; reducing once per step holds the full gradients (ZeRO-1's memory). The bytes on
the wire follow the ring formulas of :mod:`edu3d.plan.zero_modes`.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from edu3d.commands.plan import plan_main
from edu3d.model.shapes import spec_for_params
from edu3d.plan import estimate as plan_memory
from edu3d.plan import search as plan_search
from edu3d.plan import zero_modes
from edu3d.plan.formulas import zero_bytes

PAPER = [120.0, 31.4, 16.6, 1.9]
# --params 7.5e9 is GPT-3-shaped with 7.468B parameters; 3,858 more vocabulary rows (tied
# off: embedding and head) bring it to 7,500,001,280, the paper's Ψ to 7 digits
VOCAB = 54115
MIXED = dict(param_bytes=2, grad_bytes=2, optimizer_bytes=12)


def _paper_spec():
    spec = dataclasses.replace(spec_for_params(7.5e9), vocab_size=VOCAB)
    assert abs(spec.num_params() - 7.5e9) < 1e4
    return spec


def _state_gb(spec, zero: int, m: int, grad_reduce: str = "per-microbatch") -> float:
    st = plan_memory.setup(dp=64, zero=zero, microbatches=m, precision="bf16",
                           grad_reduce=grad_reduce)
    return plan_memory.estimate(spec, st)["state_bytes"] / 1e9


def _printed_state_gb(argv: list[str], capsys) -> float:
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    found = re.search(r"weights, gradients and optimizer state .*?: ([0-9.]+) GB", out)
    assert found, out
    return float(found.group(1))


@pytest.mark.parametrize("m", [1, 4, 16])
def test_the_planner_reproduces_the_paper_per_microbatch_at_any_micro_batch_count(m):
    spec = _paper_spec()
    assert [round(_state_gb(spec, z, m), 1) for z in range(4)] == PAPER
    # the default mode is per-microbatch
    st = plan_memory.setup(dp=64, zero=2, microbatches=m, precision="bf16")
    assert st.parallel.grad_reduce == "per-microbatch"


@pytest.mark.parametrize("m", [1, 4, 16])
def test_edu3d_plan_prints_the_paper_per_microbatch(m, capsys):
    got = [round(_printed_state_gb(["--params", "7.5e9", "--vocab", str(VOCAB), "--dp", "64",
                                    "--zero", str(z), "--microbatches", str(m)], capsys), 1)
           for z in range(4)]
    assert got == PAPER


def test_the_issue_command_prints_16_6_gb(capsys):
    """``edu3d plan --params 7.5e9 --dp 64 --zero 2`` (16 micro-batches by default) printed
    31.5 GB; per-microbatch it is the paper's 16.6 (7.468B parameters: 16.57 GB)."""
    assert round(_printed_state_gb(["--params", "7.5e9", "--dp", "64", "--zero", "2"],
                                   capsys), 1) == 16.6
    per_step = _printed_state_gb(["--params", "7.5e9", "--dp", "64", "--zero", "2",
                                  "--grad-reduce", "per-step"], capsys)
    assert round(per_step, 1) == 31.5


@pytest.mark.parametrize("m", [4, 16])
def test_per_step_holds_zero1s_full_gradients(m):
    """Per-step ZeRO-2/3 keep the full gradients (ZeRO-3 also the gathered weights) for the
    step: ZeRO-1's 4Ψ + KΨ/N plus the 2Ψ/N shard the reduce-scatter lands in (ZeRO-3: plus
    its 2Ψ/N weight shard), i.e. ZeRO-1's 31.4 GB becomes 31.6 and 31.9; one micro-batch
    is the same step in both modes."""
    spec = _paper_spec()
    psi, n = spec.num_params(), 64
    z1 = _state_gb(spec, 1, m, "per-step")
    z2, z3 = (_state_gb(spec, z, m, "per-step") for z in (2, 3))
    assert round(z1, 1) == 31.4
    assert z2 == pytest.approx(z1 + 2 * psi / n / 1e9, abs=1e-3)
    assert z3 == pytest.approx(z1 + 4 * psi / n / 1e9, abs=1e-3)
    assert (round(z2, 1), round(z3, 1)) == (31.6, 31.9)
    for z in (2, 3):
        closed = zero_modes.state_bytes_per_rank(psi, n, z, "per-step", m, **MIXED)["total"]
        assert _state_gb(spec, z, m, "per-step") == pytest.approx(closed / 1e9, abs=1e-3)
        assert _state_gb(spec, z, 1, "per-step") == _state_gb(spec, z, 1, "per-microbatch")


def test_a_unit_in_flight_is_a_buffer_not_state():
    """The peak total keeps everything a rank holds: per-microbatch adds the biggest unit's
    gradients and flat copy (ZeRO-3: two gathered units) as communication buffers."""
    spec = _paper_spec()
    for zero in (2, 3):
        mb, ps = (plan_memory.estimate(spec, plan_memory.setup(
            dp=64, zero=zero, microbatches=8, precision="bf16", grad_reduce=g))
            for g in zero_modes.GRAD_REDUCE)
        unit = max(sum(k for k, _ in u) for _, u in plan_memory.units(spec, mb_setup(zero), 0))
        assert mb["comm_bytes"] - ps["comm_bytes"] == pytest.approx(
            2 * unit + (4 * unit if zero == 3 else 0))
        assert ps["state_bytes"] - mb["state_bytes"] == pytest.approx(
            2 * spec.num_params() * (1 + (zero == 3)), rel=1e-6)


def mb_setup(zero):
    return plan_memory.setup(dp=64, zero=zero, precision="bf16")


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_bytes_on_the_wire_per_step(m):
    """The ring formulas: all-reduce 2(N-1)/N·S, reduce-scatter and all-gather (N-1)/N·S."""
    psi, n = 1e9, 64
    ring = (n - 1) / n * psi * 2  # one reduce-scatter or all-gather of 16-bit values
    want = {(0, "per-step"): 2 * ring, (0, "per-microbatch"): 2 * ring,
            (1, "per-step"): 2 * ring, (1, "per-microbatch"): 2 * ring,
            (2, "per-step"): 2 * ring, (2, "per-microbatch"): (m + 1) * ring,
            (3, "per-step"): 3 * ring, (3, "per-microbatch"): 3 * m * ring}
    for (zero, mode), bytes_ in want.items():
        assert zero_modes.dp_wire_bytes(psi, n, zero, mode, m) == pytest.approx(bytes_)
    # the paper's section 7 counts, in elements, at one micro-batch: 2Ψ and 3Ψ
    if m == 1:
        for zero, k in ((0, 2), (1, 2), (2, 2), (3, 3)):
            assert zero_modes.dp_wire_bytes(psi, 10**9, zero) / 2 == pytest.approx(k * psi)


@pytest.mark.parametrize("mode", zero_modes.GRAD_REDUCE)
def test_the_cost_models_dp_traffic_uses_the_mode(mode):
    spec = spec_for_params(7.5e9)
    for zero in range(4):
        for m in (1, 4, 16):
            st = plan_memory.setup(dp=64, zero=zero, microbatches=m, precision="bf16",
                                   grad_reduce=mode)
            psi = plan_memory.held(spec, st, 0)
            assert plan_search.traffic(spec, st)["dp"] == pytest.approx(
                zero_modes.dp_wire_bytes(psi, 64, zero, mode, m))
    st = plan_memory.setup(dp=64, zero=2, microbatches=16, precision="bf16", grad_reduce=mode)
    one = plan_memory.setup(dp=64, zero=2, microbatches=1, precision="bf16", grad_reduce=mode)
    ratio = plan_search.traffic(spec, st)["dp"] / plan_search.traffic(spec, one)["dp"]
    assert ratio == pytest.approx(17 / 2 if mode == "per-microbatch" else 1)


def test_the_search_weighs_both_modes_of_zero2_and_3():
    """ZeRO-2/3 with several micro-batches: per-step holds the full gradients (more memory)
    and reduces once (fewer bytes); which is faster is the performance model's call (it
    overlaps the reductions), so the search weighs both."""
    spec = spec_for_params(7.5e9)
    rows = plan_search.search(spec, plan_search.Cluster(64), 1024)
    zeros = [r["setup"] for r in rows if r["setup"].parallel.zero >= 2 and
             r["setup"].microbatches > 1]
    assert zeros and {st.parallel.grad_reduce for st in zeros} == {"per-microbatch", "per-step"}
    for st in [z for z in zeros if z.parallel.grad_reduce == "per-microbatch"][:20]:
        per_step = st.replace(grad_reduce="per-step")
        assert (plan_search.traffic(spec, per_step)["dp"]
                < plan_search.traffic(spec, st)["dp"])
        assert (plan_memory.estimate(spec, per_step)["state_bytes"]
                > plan_memory.estimate(spec, st)["state_bytes"])


def test_a_wrong_mode_is_refused(capsys):
    with pytest.raises(ValueError, match="grad_reduce"):
        plan_memory.validate(spec_for_params(7.5e9), plan_memory.setup(dp=2, zero=2,
                                                                       grad_reduce="never"))
    with pytest.raises(SystemExit) as err:
        plan_main(["--params", "7.5e9", "--dp", "2", "--zero", "2", "--grad-reduce", "never"])
    assert err.value.code == 2
    assert "per-microbatch" in capsys.readouterr().err


def test_closed_form_is_the_paper_per_microbatch():
    for zero, want in enumerate(PAPER):
        for m in (1, 16):
            got = zero_modes.state_bytes_per_rank(7.5e9, 64, zero, "per-microbatch", m, **MIXED)
            assert round(got["total"] / 1e9, 1) == want
            assert got["total"] == zero_bytes(7.5e9, 64, zero, **MIXED)["total"]


def test_hsdp_holds_a_replica_groups_shards_and_splits_the_bytes(capsys):
    """``--hsdp 8`` over the paper's 64 ranks: a rank holds ZeRO's state over the 8 ranks of
    its replica group (what dp=8 without HSDP holds, to the byte: 15 GB at ZeRO-3, (4+K)Ψ/8),
    and sends ZeRO's bytes over 8 plus one all-reduce of its gradient shard across the 8
    groups, ``2(R-1)/R·2Ψ/8`` whatever the micro-batches; ``edu3d plan`` prints both."""
    spec = _paper_spec()
    for zero in (1, 2, 3):
        for m in (1, 4):
            hsdp = plan_memory.setup(dp=64, zero=zero, hsdp=8, microbatches=m, precision="bf16")
            eight = plan_memory.setup(dp=8, zero=zero, microbatches=m, precision="bf16")
            assert (plan_memory.estimate(spec, hsdp)["state_bytes"] ==
                    plan_memory.estimate(spec, eight)["state_bytes"])
            psi = plan_memory.held(spec, hsdp, 0)
            got = zero_modes.hsdp_traffic(spec, hsdp)
            assert got["shard"] == zero_modes.dp_wire_bytes(psi, 8, zero, "per-microbatch", m)
            assert got["replicate"] == pytest.approx(2 * 7 / 8 * 2 * psi / 8)
            sent = plan_search.traffic(spec, hsdp)  # edu3d plan's bytes by axis
            assert (sent["dp"], sent["dp_replicate"]) == (got["shard"], got["replicate"])
    assert round(_printed_state_gb(["--params", "7.5e9", "--vocab", str(VOCAB), "--dp", "64",
                                    "--zero", "3", "--hsdp", "8"], capsys), 1) == 15.0
    assert plan_main(["--params", "7.5e9", "--dp", "64", "--zero", "3", "--hsdp", "8"]) == 0
    assert re.search(r"dp \S+ GB, dp_replicate \S+ GB", capsys.readouterr().out)
    assert plan_main(["--params", "7.5e9", "--dp", "64", "--hsdp", "8"]) == 2
    assert "hsdp=8 shards ZeRO's state in replica groups" in capsys.readouterr().err


def test_hsdp_keeps_zero3_on_the_node_and_sends_less_across_nodes():
    """64 GPUs in nodes of 8, ZeRO-3: plain, every gather and reduce-scatter spans 8 nodes;
    with ``--hsdp 8`` they stay inside a node (NVLink) and only the all-reduce of the 1/8
    gradient shard crosses the network, so the performance model's dp time falls, and the
    optimizer steps a shard of 1/8 (not 1/64)."""
    spec, cl = _paper_spec(), plan_search.Cluster(64)
    flat = plan_memory.setup(dp=64, zero=3, microbatches=4, precision="bf16")
    hsdp = flat.replace(hsdp=8)
    t_flat, t_hsdp = (plan_search.step_time(spec, r, cl) for r in (flat, hsdp))
    sent = plan_search.traffic(spec, hsdp)
    assert sent["dp"] < plan_search.traffic(spec, flat)["dp"] and sent["dp_replicate"] > 0
    print(f"\nZeRO-3 dp64 m4 on nodes of 8: dp {t_flat['dp']:.3f} s, optimizer "
          f"{t_flat['optimizer']:.3f} s; HSDP x8: dp {t_hsdp['dp']:.3f} s, optimizer "
          f"{t_hsdp['optimizer']:.3f} s; step {t_flat['total']:.2f} -> {t_hsdp['total']:.2f} s")
    assert t_hsdp["dp"] < t_flat["dp"]
    assert t_hsdp["optimizer"] > 4 * t_flat["optimizer"]  # a shard 8x larger (plus fixed costs)
