"""``edu3d bench 3d``'s reference side is proven before it is trusted: PyTorch's composed
dp2-tp2-pp2 stack (DTensor TP + loss_parallel, pipelining 1F1B, FSDP2 replicate or
fully_shard over dp) computes the serial GPT's gradients on the global batch. No timing is
tested: a verdict must not depend on how busy the machine is."""

import pytest

from edu3d.bench.bench_3d import torch_matches_serial
from edu3d.launch import launch
from edu3d.config.layout import Layout


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1])
def test_torch_composed_3d_gradients_equal_serial(zero):
    run = launch(torch_matches_serial, 8, kwargs={"zero": zero},
                 layout=Layout(dp=2, tp=2, pp=2), timeout=300, echo=False, name="bench-3d-check")
    for diffs in run.results:  # every rank's view: its own stage's gradients and the norm
        assert diffs["grad"] < 1e-5 and diffs["grad_norm"] < 1e-5, diffs


def test_bench_3d_is_registered():
    import importlib

    from edu3d.commands.bench import BENCHMARKS

    module, _, fn = BENCHMARKS["3d"].partition(":")
    assert callable(getattr(importlib.import_module(module), fn))


def test_bench_3d_refuses_another_world_size():
    from edu3d.bench.bench_3d import run_benchmark

    with pytest.raises(ValueError, match="-n 8"):
        run_benchmark(nprocs=4)
