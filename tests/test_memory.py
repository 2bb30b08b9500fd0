"""The memory estimator is DESIGN.md's formulas, and the measurement counts storages."""

import pytest
import torch

from edu3d.distributed import meter
from edu3d.plan import formulas as memory
from edu3d.model.gpt import GPT, config_from


def test_zero_bytes_are_the_paper_formulas_in_mixed_precision():
    psi, n, k = 1_000_000, 8, 12
    mp = dict(param_bytes=2, grad_bytes=2, optimizer_bytes=k)
    assert memory.zero_bytes(psi, n, 0, **mp)["total"] == 16 * psi
    assert memory.zero_bytes(psi, n, 1, **mp)["total"] == 4 * psi + k * psi / n
    assert memory.zero_bytes(psi, n, 2, **mp)["total"] == 2 * psi + (2 + k) * psi / n
    assert memory.zero_bytes(psi, n, 3, **mp)["total"] == (4 + k) * psi / n
    # fp32 Adam: 4 + 4 + 8 = 16 bytes per parameter too
    assert memory.zero_bytes(psi, 1, 0)["total"] == 16 * psi
    with pytest.raises(ValueError, match="stage 4"):
        memory.zero_bytes(psi, n, 4)


def test_storages_are_counted_once_and_freed_ones_not_at_all():
    flat = torch.zeros(100)
    views = [flat[:40], flat[40:]]
    assert meter.storage_bytes(views) == 400
    freed = torch.zeros(50)
    freed.untyped_storage().resize_(0)
    m = meter.measure({"params": views + [freed], "grads": [flat[10:20], torch.zeros(5)]})
    assert m == {"params": 400, "grads": 20, "optimizer": 0, "total": 420}


def test_activation_formula_and_measurement():
    s, b, h, a = 32, 2, 64, 4
    full = memory.activation_bytes_per_layer(s, b, h, a)
    assert full == s * b * h * (34 + 5 * a * s / h)
    assert memory.activation_bytes_per_layer(s, b, h, a, t=2, sp=True) == full / 2
    assert memory.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    model = GPT(config_from("tiny", layers=2), seed=0)
    x = torch.randint(0, 256, (4, 32))
    one = meter.measure_activations(lambda: model(x[:2], x[:2]), exclude=model.parameters())
    two = meter.measure_activations(lambda: model(x, x), exclude=model.parameters())
    assert one > 0 and abs(two / one - 2) < 0.05  # activations grow with the batch
