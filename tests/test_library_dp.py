"""edu3d's DataParallel as a library (issue 29, items 1, 3, 4 and 5 for data parallelism):
in an ordinary PyTorch loop, on models that are not edu3d's GPT, every impl gives what torch's
own DistributedDataParallel gives on the same model, rank by rank: any placement of
``zero_grad`` (either ``set_to_none``), mixed dtypes, unused parameters (torch's
``find_unused_parameters``, or a clear error naming them) and buffers broadcast from the
group's first rank (``broadcast_buffers``). One 2-rank gloo launch runs every case
(tests/workers_library_dp.py); the tensors come back and are compared here."""

import pytest
import torch

from edu3d.config.layout import Layout
from edu3d.launch import launch
from edu3d.parallel.dp.data_parallel import IMPLS, make_buckets
from tests.workers_library_dp import PLACEMENTS, STEPS, all_cases

# measured: every impl equals torch DDP bit for bit (bf16 and fp64 included), and the serial
# run within 7e-8; the bounds leave room for a torch that orders its sums differently
TOL, SERIAL_TOL = 1e-6, 1e-5


@pytest.fixture(scope="module")
def runs():
    run = launch(all_cases, 2, layout=Layout(dp=2), timeout=240, echo=False,
                 name="library-dp")
    return run.results


def _diff(a, b) -> float:
    """Largest difference of two nested results, relative to b's size; None must match None."""
    if isinstance(b, dict):
        assert set(a) == set(b), f"{sorted(a)} != {sorted(b)}"
        return max([_diff(a[k], b[k]) for k in b] + [0.0])
    if isinstance(b, list):
        assert len(a) == len(b)
        return max([_diff(x, y) for x, y in zip(a, b)] + [0.0])
    if b is None or a is None:
        assert a is None and b is None, f"one side has no gradient: {a} vs {b}"
        return 0.0
    if isinstance(b, torch.Tensor):
        a, b = a.double(), b.double()
        return ((a - b).abs().max() / (1 + b.abs().max())).item()
    assert a == b, f"{a} != {b}"
    return 0.0


def _check(runs, part: str, key: str, ref_key: str, tol: float, what=("grads", "params")):
    for rank, res in enumerate(runs):
        got, ref = res[part][key], res[part][ref_key]
        assert "error" not in got, f"{key} on rank {rank}: {got['error']}\n{got['where']}"
        for field in what:
            err = _diff(got[field], ref[field])
            assert err <= tol, f"{key} {field} on rank {rank}: {err:.1e} from {ref_key}"
    if "params" in what:  # and the ranks agree with each other
        assert _diff(runs[1][part][key]["params"], runs[0][part][key]["params"]) <= tol


@pytest.mark.parametrize("impl", IMPLS)
def test_any_zero_grad_placement_averages_like_torch_ddp(runs, impl):
    for placement in PLACEMENTS:
        for micro in (1, 2):
            key = f"{placement}/k{micro}"
            if f"torch/{key}" not in runs[0]["zero_grad"]:
                continue
            _check(runs, "zero_grad", f"{impl}/{key}", f"torch/{key}", TOL)
            _check(runs, "zero_grad", f"{impl}/{key}", f"serial/{key}", SERIAL_TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_dtypes_wrap_and_average_like_torch_ddp(runs, impl):
    _check(runs, "mixed", impl, "torch", TOL)


def test_buckets_hold_one_dtype_each_in_first_parameter_order():
    params = [torch.empty(n, dtype=d, device="meta") for n, d in
              [(4, torch.float32), (3, torch.float64), (5, torch.float32), (2, torch.bfloat16),
               (6, torch.float64)]]
    buckets = make_buckets(params, 16 / 2**20)  # 16 bytes
    assert all(len({p.dtype for p in b.params}) == 1 for b in buckets)
    assert sorted(id(p) for b in buckets for p in b.params) == sorted(map(id, params))
    order = [id(p) for p in reversed(params)]
    firsts = [order.index(id(b.params[0])) for b in buckets]
    assert firsts == sorted(firsts)
    assert [b.buffer.dtype for b in buckets] == [p.dtype for b in buckets for p in b.params[:1]]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("where", ["global", "one_rank"])
def test_unused_parameters_match_torch_find_unused(runs, impl, where):
    for placement in ("before", "before_keep"):
        key = f"{where}/{placement}"
        _check(runs, "unused", f"{impl}/{key}", f"torch/{key}", TOL,
               what=("grads", "params", "state"))
    if where == "global":  # what torch does, spelled out: no gradient, no decay, no moments
        for res in runs:
            got = res["unused"][f"{impl}/global/before"]
            assert all(g["branch.b.weight"] is None for g in got["grads"])
            assert "branch.b.weight" not in got["state"]


@pytest.mark.parametrize("impl", IMPLS)
def test_an_unused_parameter_without_the_flag_is_an_error_naming_it(runs, impl):
    for res in runs:
        got = res["unused"][f"{impl}/strict"]
        assert "error" in got, f"{impl} trained with a parameter that got no gradient"
        assert got["error"].startswith("RuntimeError"), got["error"] + got["where"]
        assert "branch.b.weight" in got["error"] and "branch.b.bias" in got["error"]
        assert "find_unused_parameters=True" in got["error"]


@pytest.mark.parametrize("impl", IMPLS)
def test_buffers_are_broadcast_like_torch_ddp(runs, impl):
    for flag in (True, False):
        _check(runs, "buffers", f"{impl}/{flag}", f"torch/{flag}", TOL,
               what=("grads", "params", "buffers"))
    noise = [res["buffers"][f"{impl}/True"]["buffers"][-1]["noise"] for res in runs]
    assert torch.equal(noise[0], noise[1])  # the random buffer is rank 0's everywhere
    kept = [res["buffers"][f"{impl}/False"]["buffers"][-1]["noise"] for res in runs]
    assert not torch.equal(kept[0], kept[1])  # broadcast_buffers=False leaves them alone


def test_buffer_broadcasts_go_through_the_traced_layer(runs):
    # Net's buffers: fp32 running_mean, running_var and noise (24 floats, 96 bytes) and the
    # int64 num_batches_tracked (8 bytes): one broadcast per dtype, after the parameters'
    # own at wrap time, then before each forward that follows a synchronising one, as torch
    # does: step 1's first micro-batch, and the no-grad forward after every step
    casts = runs[0]["buffers"]["broadcasts"]
    n = runs[0]["buffers"]["n_params"]
    assert all(c[:2] == ("broadcast", "dp") for c in casts)
    assert casts[n:] == [("broadcast", "dp", 96), ("broadcast", "dp", 8)] * (2 + STEPS)
