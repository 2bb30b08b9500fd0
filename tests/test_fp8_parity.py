"""FP8 on every layout it composes with equals its own emulated serial FP8 run.

The reference is the serial GPT with its blocks in FP8 (:func:`~edu3d.parallel.fp8.apply_fp8`),
run as one micro-batch per micro-batch of every data-parallel rank (a current scale is a
micro-batch's amax, so the serial run casts what the ranks cast). Three kinds of check:

* **data parallelism, ZeRO 1/2/3 and pipelines** (and their compositions) cast exactly the
  serial run's numbers: the first step's gradients and the weights after one SGD step
  equal the reference within fp32 rounding (``TIGHT``). ZeRO-3 gathers the weights in FP8
  (tensorwise), so this also proves that the gathered bytes and scales are the serial casts;
* **tensor parallelism**: each FP8 TP layer (column and row, with and without sequence
  parallelism, every recipe) equals the serial FP8 layer on the same input within fp32
  rounding (``TIGHT``): its scales are the whole tensors' (the amaxes reduced over tp);
* **whole runs**: after one update, or under TP from the first forward, the layout sums in
  another order than the serial run, and FP8 amplifies that rounding: an element within
  ~1e-7 of a midpoint between two FP8 numbers casts to the other one (one E4M3 step is
  6-12%), and a flip in a gradient's amax element rescales the whole tensor. So each
  run's errors are bounded by the **noise floor**: the same serial FP8 run with its weights
  multiplied by ``1 + 2^-24·N(0,1)`` (fp32's rounding), the worst of two draws, times
  ``MARGIN`` (:func:`~tests.workers_fp8.noise_floor`). Without FP8 the floor is ~1e-7.

What FP8 does not compose with is refused before launch (tests/test_fp8.py). The errors are
printed with ``pytest -s``.
"""

from __future__ import annotations

import functools

import pytest

from edu3d.config.layout import Layout
from edu3d.launch import launch
from edu3d.train.loop import reference_microbatches
from tests.workers_fp8 import noise_floor, options, parity_many, reference, tp_layers

TIGHT = 1e-6  # fp32 rounding of the same casts summed in another order
MARGIN = 4.0
STEPS = 2  # AdamW steps: the second runs on weights one update has made differ in rounding

LAYOUTS = {  # grouped by world size: one launch each; four serial references between them
    "dp2 zero1 m2": "--dp 2 --zero 1 --microbatches 2",
    "dp2 zero3 delayed prefetch": "--dp 2 --zero 3 --fp8-recipe delayed --prefetch",
    "dp2 zero2 rowwise": "--dp 2 --zero 2 --fp8-scaling rowwise",
    "dp2 zero3 rowwise": "--dp 2 --zero 3 --fp8-scaling rowwise",
    "dp2 zero3 recompute selective": "--dp 2 --zero 3 --recompute selective",
    "dp2 zero2 offload recompute full": "--dp 2 --zero 2 --offload --recompute full",
    "pp2 delayed": "--pp 2 --microbatches 2 --fp8-recipe delayed",
    "tp2 sp m2": "--tp 2 --sp --microbatches 2",
    "tp2 rowwise m2": "--tp 2 --fp8-scaling rowwise --microbatches 2",
    "dp2 pp2 zero3 m2": "--dp 2 --pp 2 --zero 3 --microbatches 2",
    "dp2 tp2 zero3": "--dp 2 --tp 2 --zero 3",
    "tp2 pp2 delayed": "--tp 2 --pp 2 --fp8-recipe delayed",
}


def _argv(name: str) -> list[str]:
    return ["--precision", "fp8", *LAYOUTS[name].split()]


def _layout(argv: list[str]) -> Layout:
    return Layout(**{k: int(argv[argv.index(f"--{k}") + 1]) if f"--{k}" in argv else 1
                     for k in ("dp", "tp", "pp")})


def _key(argv: list[str]) -> tuple:
    """What the serial reference depends on: the recipe and how many micro-batches it runs."""
    args = options(argv)
    return args.precision, reference_microbatches(args)


_REFERENCES: dict[tuple, tuple[dict, dict]] = {}


def _reference(name: str) -> tuple[dict, dict]:
    """The serial FP8 reference of ``name`` and its noise floor, shared by every layout with
    the same key (:func:`_key`)."""
    argv = _argv(name)
    key = _key(argv)
    if key not in _REFERENCES:
        ref = reference(argv, STEPS)
        _REFERENCES[key] = ref, noise_floor(argv, STEPS, ref)
    return _REFERENCES[key]


@functools.lru_cache(maxsize=None)
def _results(layout: Layout) -> dict[str, dict]:
    """Every case of ``layout`` in one launch."""
    names = [n for n in LAYOUTS if _layout(_argv(n)) == layout]
    argvs = [_argv(n) for n in names]
    refs = [_reference(n)[0] for n in names]
    run = launch(parity_many, layout.world_size, args=(argvs, refs), layout=layout,
                 timeout=300, name="fp8-parity")
    return dict(zip(names, run.results[0]))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_layout_equals_its_serial_fp8_run(name):
    argv = _argv(name)
    res, floor = _results(_layout(argv))[name], _reference(name)[1]
    print(f"\n{name}: grad {res['grad_err']:.1e} param {res['param_err']:.1e} loss "
          f"{res['loss_err']:.1e} norm {res['norm_err']:.1e}; floor: grad "
          f"{floor['grad_err']:.1e} loss {floor['loss_err']:.1e} norm {floor['norm_err']:.1e}")
    if "--tp" in argv:
        assert res["grad_err"] <= max(TIGHT, MARGIN * floor["grad_err"])
    else:
        assert res["grad_err"] < TIGHT and res["param_err"] < TIGHT
    assert res["loss_err"] <= max(TIGHT, MARGIN * floor["loss_err"])
    assert res["norm_err"] <= max(TIGHT, MARGIN * floor["norm_err"])
    assert res["losses"][-1] < res["losses"][0]  # it trains


TP_CASES = [{"precision": p, "kind": k, "sp": sp}
            for p in ({}, {"fp8_scaling": "rowwise"}, {"fp8_recipe": "delayed"})
            for k in ("column", "row") for sp in (False, True)]


def test_fp8_tp_layers_equal_the_serial_fp8_layer():
    """Same input, weight and output gradient: TP's FP8 layers cast what the serial FP8 layer
    casts, so their outputs and gradients agree within fp32 rounding."""
    run = launch(tp_layers, 2, args=(TP_CASES,), layout=Layout(tp=2), timeout=120,
                 name="fp8-tp-layers")
    for case, res in zip(TP_CASES, run.results[0]):
        print(f"\n{case}: {', '.join(f'{k} {v:.1e}' for k, v in res.items())}")
        assert max(res.values()) < TIGHT, (case, res)
