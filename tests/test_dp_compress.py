"""Gradient compression hooks train, and their error against uncompressed training is what
their precision predicts: 16-bit casts and int8 stay close, top-k with error feedback
drifts but still learns (one 2-rank launch)."""

import pytest

from edu3d.launch import launch
from edu3d.course.ch02_data_parallel import compression_error
from edu3d.parallel.dp.compress import HOOKS, make_hook


@pytest.fixture(scope="module")
def errors():
    run = launch(compression_error, 2, kwargs={"steps": 8, "layers": 2}, timeout=240,
                 echo=False)
    return run.results[0]


def test_every_hook_trains_close_to_uncompressed(errors):
    print({k: (round(v["max_loss_rel_diff"], 6), round(v["param_rel_diff"], 6))
           for k, v in errors.items()})
    assert errors["none"]["param_rel_diff"] == 0.0
    assert errors["fp16"]["max_loss_rel_diff"] < 1e-3
    assert errors["bf16"]["max_loss_rel_diff"] < 1e-2
    assert errors["int8"]["max_loss_rel_diff"] < 1e-2
    for name in HOOKS:
        losses = errors[name]["losses"]
        assert losses[-1] < losses[0], f"{name} did not learn: {losses}"
    # fewer mantissa bits, more error
    assert errors["fp16"]["param_rel_diff"] < errors["bf16"]["param_rel_diff"]


def test_unknown_hook_names_the_choices():
    assert make_hook(None) is None and make_hook("none") is None
    with pytest.raises(ValueError, match="fp16, bf16, int8, topk"):
        make_hook("fp8")
