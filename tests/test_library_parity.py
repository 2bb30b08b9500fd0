"""Issue 36: edu3d's ``DataParallel`` and ``Zero`` in the loop a PyTorch user writes behave
like torch's own classes, or refuse with a clear error; nothing is silently wrong.

One 2-rank gloo launch (tests/workers_library_parity_zero.py's ``all_cases``) runs every
case; each compares the final parameters (and buffers, where a case has them) with one
process on the same rows and with torch's own class behind the same loop: DDP for
``DataParallel``; DDP + ``ZeroRedundancyOptimizer`` (ZeRO-1, and optimizers sharded by whole
tensors), FSDP2's ``fully_shard`` (ZeRO-2/3) or DDP (buffers, unused parameters, mixed
dtypes) for ``Zero``. Every model is seeded per rank, so every case also checks the
broadcast at wrap time (the frozen projection included).
"""

import functools

import pytest

from edu3d.config.layout import Layout
from edu3d.launch import launch
from tests.workers_library_parity import DP_CASES
from tests.workers_library_parity_zero import MISUSES, ZERO_CASES, all_cases

TOL = 1e-5  # fp32, three steps (measured: 0 against torch, at most 3e-8 against one process)


@functools.lru_cache(maxsize=None)
def runs():
    return launch(all_cases, 2, layout=Layout(dp=2), timeout=400, echo=False,
                  name="library-parity").results


def error(rank: int, key: str) -> str:
    got = runs()[rank][key]
    assert "error" in got, f"{key} on rank {rank} raised nothing: {got}"
    return got["error"]


def no_error(key: str) -> dict:
    for rank in (0, 1):
        got = runs()[rank][key]
        assert "error" not in got, f"{key} on rank {rank}: {got['error']}\n{got.get('where')}"
    return runs()[0][key]


def test_dataparallel_in_ddps_loop_equals_ddp_and_one_process():
    for key in DP_CASES:
        got = no_error(key)
        for rank in (0, 1):
            mine = runs()[rank][key]
            assert mine["torch"] <= TOL and mine["serial"] <= TOL, (key, rank, mine)
        assert got["same_keys"], f"{key}: state_dict keys differ from DDP's (module.*)"
    clip = runs()[0]["dp/clip_every_step"]
    assert clip["clipped"] and clip["norm_vs_torch"] <= TOL, clip


def test_dataparallel_misuse_is_a_clear_error():
    for rank in (0, 1):
        msg = error(rank, "dp/misuse_last_backward_in_no_sync")
        assert "no_sync" in msg and "finish()" in msg, msg
        msg = error(rank, "dp/misuse_unused_without_flag")
        assert "extra.weight" in msg and "find_unused_parameters=True" in msg, msg
    got = no_error("dp/zero_grad_default_and_module")
    assert got == {"all_none": True, "is_module": True}, got


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_in_a_plain_loop_equals_torch_and_one_process(stage):
    for key in [f"zero{stage}/{name}" for name in [*ZERO_CASES, "adafactor_world1"]]:
        no_error(key)
        for rank in (0, 1):
            got = runs()[rank][key]
            assert got["serial"] <= TOL and got.get("torch", 0.0) <= TOL, (key, rank, got)
            assert got["numel_ok"], f"{key}: zero.numel() is not the model's parameter count"
    clip = runs()[0][f"zero{stage}/sgd_clip"]
    assert clip["clipped"] and clip["norm_vs_serial"] <= TOL, clip


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_gradients_after_finish_are_the_average_or_refuse(stage):
    key = f"zero{stage}/grad_after_finish"
    if stage == 1:  # DDP + ZeroRedundancyOptimizer: the full average on every rank
        no_error(key)
        assert all(runs()[r][key]["serial"] <= TOL for r in (0, 1)), runs()[0][key]
        return
    for rank in (0, 1):
        msg = error(rank, key)
        assert "zero.clip_grad_norm_" in msg and "sharded" in msg, msg


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_misuse_is_a_clear_error(stage):
    expect = {"no_finish": "zero.finish()", "own_optimizer": "optimizer_class=",
              "inner_step": "call zero.step()", "step_lr": "their own"}
    assert set(expect) == set(MISUSES)
    for what, phrase in expect.items():
        for rank in (0, 1):
            msg = error(rank, f"zero{stage}/misuse_{what}")
            assert phrase in msg, (what, msg)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_saved_at_world_2_resumes_at_world_1_with_a_0dim_parameter(stage):
    for opt in ("adamw", "adafactor"):
        key = f"zero{stage}/resume_at_world1_0dim_{opt}"
        no_error(key)
        for rank in (0, 1):
            got = runs()[rank][key]
            assert got["serial"] <= TOL and got["plain_torch_vs_serial"] <= TOL, (key, got)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_mixed_precision_equals_fsdp2_policy(stage):
    key = f"zero{stage}/mixed_precision_vs_fsdp2"
    got = no_error(key)
    assert got["fp32_dtypes"], "model.state_dict() must give the fp32 master values"
    assert got["fp32_serial_gap"] > 10 * TOL, f"bf16 was not used: {got}"
    if stage > 1:  # the same arithmetic as FSDP2's
        assert got["torch"] <= TOL, got
    else:  # ZeRO-1 keeps p.grad, the full average, in bf16 as DDP on a bf16 model does
        assert got["torch"] < got["fp32_serial_gap"] / 4, got


def test_zero3_state_dict_on_rank_0_alone_is_an_error_not_a_hang():
    msg = error(0, "zero3/state_dict_on_rank0_only")
    assert "collective" in msg and "every rank" in msg, msg
