"""The optimizer rule, the learning-rate schedule and clipping by a given norm."""

import math

import pytest
import torch

from edu3d.train.optim import MIN_LR_RATIO, clip_coef, lr_at, make_optimizer, param_groups
from edu3d.config.sections import Run


def test_warmup_then_constant():
    args = Run.of(lr=1e-3, warmup=4, steps=10)
    assert [lr_at(s, args) for s in (1, 2, 4, 10)] == pytest.approx([2.5e-4, 5e-4, 1e-3, 1e-3])


def test_warmup_then_cosine_to_a_tenth():
    args = Run.of(lr=1e-3, warmup=2, steps=12, lr_schedule="cosine")
    assert lr_at(1, args) == pytest.approx(5e-4)
    assert lr_at(2, args) == pytest.approx(1e-3)  # the peak, where the decay starts
    mid = 2 + (12 - 2) / 2
    assert lr_at(int(mid), args) == pytest.approx(1e-3 * (1 + MIN_LR_RATIO) / 2)
    assert lr_at(12, args) == pytest.approx(1e-3 * MIN_LR_RATIO)
    lrs = [lr_at(s, args) for s in range(2, 13)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # never rises after warmup


def test_clip_coef_is_clip_grad_norm_s_arithmetic():
    grads = [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
    coef = clip_coef(norm, 0.5)
    for p, g in zip(params, grads):
        assert torch.allclose(p.grad, g * coef)
    assert clip_coef(norm, 0) == 1.0  # clipping off
    assert clip_coef(torch.tensor(0.1), 1.0) == 1.0  # never scales up


def test_decay_on_matrices_only_and_sgd():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    groups = param_groups(model.parameters(), 0.1)
    assert [len(g["params"]) for g in groups] == [1, 3]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    opt = make_optimizer(model, Run.of(optimizer="sgd", lr=0.5))
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == 0.5
    assert make_optimizer([], Run.of()) is None
    assert not math.isnan(lr_at(1, Run.of()))
