"""``--compile``: torch.compile per block (inductor, C++ on a CPU) gives eager's losses, for
the serial model and a TP, a PP and a ZeRO-3 layout (one launch for the three).

Slow on a cold machine: inductor compiles each graph's C++ once (about 2 minutes on 2 busy
cores), then reuses it from its cache (/tmp/torchinductor_$USER)."""

import io

import pytest

from edu3d.config.layout import Layout
from edu3d.launch import launch
from edu3d.train.loop import run
from edu3d.config.sections import Run
from edu3d.train.preflight import compiler
from tests import workers_fast

pytestmark = pytest.mark.skipif(compiler() is None, reason="inductor needs a C++ compiler")

TINIEST = dict(layers=2, heads=2, d_model=32, seq=16, vocab=64, global_batch=4)


def test_compiled_serial_model_gives_eager_losses():
    eager = run(Run.of(**TINIEST, steps=2, json=True), out=io.StringIO())
    compiled = run(Run.of(**TINIEST, steps=2, json=True, compile=True), out=io.StringIO())
    for a, b in zip(eager, compiled):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], abs=1e-5)


def test_compiled_tp_pp_zero3_layouts_give_eager_losses():
    """ZeRO-3's gather/free hooks sit on the block modules, outside the compiled forward."""
    layouts = [{"tp": 2}, {"pp": 2}, {"dp": 2, "zero": 3}]
    res = launch(workers_fast.compile_layouts, 2, args=(layouts, TINIEST, 2),
                 layout=Layout(dp=2), timeout=600, name="compile").results[0]
    serial = workers_fast.variants(None, TINIEST, [{}], 2, grads=False)[0]["losses"]
    for layout, (eager, compiled) in zip(layouts, res):
        assert eager == pytest.approx(serial, abs=1e-5), layout
        assert compiled == pytest.approx(eager, abs=1e-5), layout
