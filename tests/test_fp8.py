"""FP8's numbers, refusals and bytes: the emulation casts as torch's float8 types round, what
FP8 does not compose with is refused before launch, and ZeRO-3 gathers half of bf16's bytes.

* **casts** (:func:`edu3d.parallel.fp8.scaling.cast`): for every exact midpoint between two
  neighbouring FP8 numbers (a tie), the fp32 numbers on either side of it, random numbers
  over the whole range and numbers past it, the cast equals a rounding written out here
  from the 256 codes (nearest number, a tie to the even code, saturating at ±fmax) and,
  inside the range, torch's own ``.to(torch.float8_e4m3fn / float8_e5m2)``. The scale maps
  the amax onto fmax exactly;
* **products**: :func:`~edu3d.parallel.fp8.scaling.scaled_mm` equals torch's
  ``torch._scaled_mm`` (tensorwise and rowwise) on this CPU; on an FP8 GPU the real kernel
  equals the emulation (skipped without one);
* **gathers**: FP8 bytes widened to ``q / s`` and cast again by ``s`` give back ``q``, so
  the layer after ZeRO-3's FP8 gather casts the bytes that travelled; and on gloo, one
  all-gather of every unit moves exactly what :func:`edu3d.plan.estimate.zero3_gather_bytes`
  says, the blocks' linear weights in 1 byte against 2 under bf16 (the control) and 4 in fp32;
* **the planner**: a measured ``--precision fp8 --dp 2 --zero 3`` run's state equals
  :func:`edu3d.plan.estimate.estimate_for`'s (within ZeRO's padding), its activations
  within 1e-4; FP8's matrix rate is the profile's sourced FP8 peak;
* **refusals**: each combination :mod:`edu3d.train.fp8_rules` refuses, in one line that
  names the flag.
"""

from __future__ import annotations

import io

import pytest
import torch

from edu3d.commands.train import parse
from edu3d.config.layout import Layout, LayoutError
from edu3d.config.sections import Run, from_flags
from edu3d.launch import launch
from edu3d.parallel import fp8
from edu3d.parallel.fp8.scaling import (E4M3, E5M2, amax_to_scale, cast, fmax, fp8_kernels,
                                        quantize, real_scaled_mm, scaled_mm)
from edu3d.plan.estimate import estimate_for, spec_of, zero3_gather_bytes
from edu3d.plan.hardware import load_profile, matmul_rate
from edu3d.train import fp8_rules
from edu3d.train.loop import run as train
from edu3d.train.preflight import check_args
from tests.workers_fp8 import gather_bytes

FORMATS = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]


def _grid(fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite non-negative number of ``fmt`` in increasing order, and its code."""
    codes = torch.arange(128, dtype=torch.uint8)  # the sign bit clear
    values = codes.view(fmt).float()
    keep = torch.isfinite(values)
    return values[keep], codes[keep]


def _rne(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """Round-to-nearest-even onto ``fmt``'s numbers, saturating at ±fmax, from the codes
    alone: the nearest number; of two equally near, the one whose code is even."""
    values, codes = _grid(fmt)
    a = x.abs().clamp(max=fmax(fmt)).double()
    hi = torch.searchsorted(values.double(), a).clamp(max=len(values) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - values[lo].double(), values[hi].double() - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (codes[hi] % 2 == 0))
    out = torch.where(pick_hi, values[hi], values[lo])
    return torch.where(x < 0, -out, out)


def _probes(fmt: torch.dtype) -> torch.Tensor:
    """Ties, their fp32 neighbours, random numbers over the whole range, and past it."""
    values, _ = _grid(fmt)
    mids = (values[1:] + values[:-1]) / 2  # exact in fp32: at most 4 significant bits + 1
    up, down = torch.nextafter(mids, torch.tensor(float("inf"))), torch.nextafter(
        mids, torch.tensor(0.0))
    g = torch.Generator().manual_seed(0)
    spread = torch.exp2(torch.empty(4000).uniform_(-20, torch.log2(torch.tensor(fmax(fmt)))
                                                   .item() + 2, generator=g))
    x = torch.cat([values, mids, up, down, spread, torch.tensor([0.0, 1e30])])
    return torch.cat([x, -x])


@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_rounds_to_nearest_even_and_saturates_as_torch_does(fmt):
    x = _probes(fmt)
    inside = x.abs() <= fmax(fmt)
    ref = _rne(x, fmt)
    # torch's own cast is this rounding inside the range
    assert torch.equal(x[inside].to(fmt).float(), ref[inside])
    # the emulation's cast (scale 1) is the same, and saturates where torch would not (E5M2: inf)
    ours = cast(x, torch.tensor(1.0), fmt).float()
    assert torch.equal(ours, ref)
    assert ours.abs().max() == fmax(fmt)
    ties = (_grid(fmt)[0][1:] + _grid(fmt)[0][:-1]) / 2
    assert not torch.equal(ties.to(fmt).float(), ties)  # ties do move: to the even code
    # with a scale: the product in fp32, then the same rounding
    s = torch.tensor(3.7)
    assert torch.equal(cast(x, s, fmt).float(), _rne(x * s, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("power_of_two", [False, True])
def test_the_scale_puts_the_amax_on_fmax(fmt, power_of_two):
    g = torch.Generator().manual_seed(1)
    for amax in (1e-6, 0.0123, 1.0, 3.0e3, 7.5e6):
        t = torch.randn(64, 64, generator=g)
        t = t / t.abs().max() * amax
        s = amax_to_scale(t.abs().max(), fmt, power_of_two)
        exact = (fmax(fmt) / t.abs().max().double()).float()
        if power_of_two:  # 2^k <= fmax / amax < 2^(k+1): exact scaling, the amax below fmax
            assert s <= exact < 2 * s and torch.log2(s) == torch.round(torch.log2(s))
        else:
            assert s == exact
            assert cast(t, s, fmt).float().abs().max() == fmax(fmt)
    assert torch.isfinite(amax_to_scale(torch.tensor(0.0), fmt))  # an all-zero tensor


def test_scaled_mm_equals_torchs_scaled_mm():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(32, 64, generator=g), torch.randn(64, 48, generator=g) * 1e-3
    for rowwise in (False, True):
        sa = amax_to_scale(a.abs().amax(1, keepdim=True) if rowwise else a.abs().max(), E4M3)
        sb = amax_to_scale(b.abs().amax(0, keepdim=True) if rowwise else b.abs().max(), E4M3)
        qa, qb = cast(a, sa, E4M3), cast(b, sb, E4M3)
        ours = scaled_mm(qa, qb, sa.reciprocal(), sb.reciprocal())
        theirs = real_scaled_mm(qa, qb, sa.reciprocal(), sb.reciprocal())
        err = float((ours - theirs).norm() / theirs.norm())
        print(f"\nrowwise={rowwise}: emulated vs torch._scaled_mm {err:.1e}; vs fp32 product "
              f"{float((ours - a @ b).norm() / (a @ b).norm()):.1e}")
        assert err < 1e-6


def test_gathered_fp8_weights_cast_back_to_the_bytes_that_travelled():
    values, codes = _grid(E4M3)
    q = torch.cat([codes, codes | 0x80]).view(E4M3)  # every finite code, both signs
    g = torch.Generator().manual_seed(3)
    for s in [*torch.exp2(torch.empty(50).uniform_(-30, 30, generator=g)),
              torch.tensor(448 / 0.0731)]:
        back = q.float() / s  # what the FP8 gather widens into the fp32 buffer
        assert torch.equal(cast(back, s, E4M3).view(torch.uint8), q.view(torch.uint8))


def test_rowwise_scales_lose_less_than_one_tensorwise_scale_beside_an_outlier():
    """Rows of magnitudes 1e-4 to 1 and one outlier: one scale for all squeezes the small rows
    into E4M3's subnormals (or to 0); a scale per row keeps every row's 3 mantissa bits."""
    g = torch.Generator().manual_seed(4)
    t = torch.randn(64, 256, generator=g) * torch.logspace(-4, 0, 64).unsqueeze(1)
    t[-1, 0] = 50.0  # one outlier, in the largest row
    tw, rw = quantize(t, "tensorwise"), quantize(t, "rowwise")
    raw = quantize(t, scale=torch.tensor(1.0))

    def worst_row(q):  # the largest relative error of one row
        return float(((q.dequantized - t).norm(dim=1) / t.norm(dim=1)).max())

    print(f"\ntensorwise: rel {tw.rel_error:.2e}, worst row {worst_row(tw):.2e}, flushed "
          f"{tw.flushed:.1%}; rowwise: rel {rw.rel_error:.2e}, worst row {worst_row(rw):.2e}, "
          f"flushed {rw.flushed:.1%}; unscaled: flushed {raw.flushed:.1%}")
    assert worst_row(rw) < 2.0**-4 < 0.5 < worst_row(tw)  # a small row flushed to zeros
    assert rw.flushed < tw.flushed < raw.flushed
    assert rw.max_rel_error <= 2.0**-4  # every element normal in E4M3: half a 3-bit step
    assert tw.scale.numel() == 1 and rw.scale.shape == (64, 1)


def test_fp8_rules_name_the_mechanics_choices():
    assert fp8_rules.SCALINGS == fp8.SCALINGS and fp8_rules.RECIPES == fp8.KINDS
    assert parse(["--precision", "fp8", "--fp8-scaling", "rowwise"]).precision.fp8_scaling \
        == "rowwise"


REFUSED = {
    "--precision fp8 --experts 4": "--experts",
    "--precision fp8 --cp 2": "--cp 2",
    "--precision fp8 --tp 2 --tp-overlap": "--tp-overlap",
    "--precision fp8 --impl torch": "--impl torch",
    "--precision fp8 --fp8-scaling rowwise --fp8-recipe delayed": "rowwise",
    "--precision fp8 --fp8-recipe delayed --ckpt-dir ck": "--ckpt-dir",
    "--fp8-scaling rowwise": "add --precision fp8",
    "--precision bf16 --fp8-recipe delayed": "add --precision fp8",
    "--precision fp8 --fp8-scaling columnwise": "choose one of tensorwise, rowwise",
    "--precision fp8 --fp8-history 0": "--fp8-history 0",
}


@pytest.mark.parametrize("flags", list(REFUSED))
def test_what_fp8_does_not_compose_with_is_refused_in_one_line(flags):
    with pytest.raises(LayoutError) as err:
        check_args(from_flags(flags.split()))
    assert REFUSED[flags] in str(err.value) and "\n" not in str(err.value)


def test_fp8_composes_with_the_rest():
    for flags in ("--precision fp8 --dp 2 --zero 3 --fp8-recipe delayed",
                  "--precision fp8 --tp 2 --sp --pp 2 --microbatches 2 --fp8-scaling rowwise",
                  "--precision fp8 --recompute full --compile"):
        check_args(from_flags(flags.split()))


def test_the_planner_rates_fp8_matmuls_from_the_profiles_peak():
    h100, a100 = load_profile("h100-sxm"), load_profile("a100-40gb")
    assert matmul_rate(h100, "fp8") == 2 * matmul_rate(h100, "bf16")  # 1979 vs 989.5 TFLOP/s
    assert "h100" in h100.sources["peak_flops.fp8"].lower()
    with pytest.raises(ValueError, match="fp8"):
        matmul_rate(a100, "fp8")


def test_zero3_gathers_fp8_weights_in_half_of_bf16s_bytes():
    """One launch, dp=2: ZeRO-3 in fp32 and in FP8 (the trainer), and the bf16 control."""
    cases = {"fp32": "--dp 2 --zero 3", "fp8": "--dp 2 --zero 3 --precision fp8"}
    run = launch(gather_bytes, 2, args=({k: v.split() for k, v in cases.items()},),
                 layout=Layout(dp=2), timeout=120, name="fp8-gather-bytes")
    units = run.results[0]
    per = {}  # case -> {unit index: bytes of each of its gathers}
    for ev in run.events():
        if ev["rank"] == 0 and ev["op"] == "all_gather" and "chunk" in ev:
            per.setdefault(ev["case"], {}).setdefault(ev["chunk"], set()).add(ev["bytes"])
    one = {case: {units[case][i][0]: b.pop() for i, b in chunks.items() if len(b) == 1}
           for case, chunks in per.items()}
    for case, chunks in per.items():
        assert len(one[case]) == len(units[case]) == len(chunks), case  # each unit, one size
    low = {n: b for n, b in one["fp8"].items() if n.endswith(fp8.fp8_gather.SUFFIX)}
    padded = {n: p for n, _, p in units["fp8"]}
    assert low and all(b == padded[n] for n, b in low.items())  # 1 byte per element
    fp8_bytes, bf16_bytes = sum(low.values()), sum(one["bf16"][n] for n in low)
    fp32_bytes = 4 * fp8_bytes
    for case, flags in cases.items():
        formula = zero3_gather_bytes(spec_of(from_flags(flags.split())),
                                     from_flags(flags.split()))
        print(f"\n{case}: one gather of every unit {sum(one[case].values())} B, formula "
              f"{formula} B")
        assert sum(one[case].values()) == formula
    print(f"blocks' linear weights per gather: fp8 {fp8_bytes} B, bf16 {bf16_bytes} B, fp32 "
          f"{fp32_bytes} B; whole gather: fp8 {sum(one['fp8'].values())}, bf16 "
          f"{sum(one['bf16'].values())}, fp32 {sum(one['fp32'].values())}")
    assert 2 * fp8_bytes == bf16_bytes


def test_the_planner_equals_a_measured_fp8_zero3_run():
    """``edu3d train --precision fp8 --dp 2 --zero 3``: the state the run records equals the
    planner's (ZeRO-3's FP8 weights in units of their own pad their shards a few elements
    differently from the planner's flat units: 16 bytes of 939,664 measured), and the
    activations (fp32 inputs kept for backward plus each FP8 layer's scales) within 1e-4."""
    options = Run.of(precision="fp8", dp=2, zero=3, json=True, steps=1, timeout=300)
    check_args(options)
    measured = train(options, out=io.StringIO())[-1]["mem_bytes"]
    planned = estimate_for(options, at="rest")
    for cat in ("params", "grads", "optimizer"):
        assert abs(measured[cat] - planned[f"{cat}_bytes"]) <= 64, (cat, measured, planned)
    ratio = planned["activations_bytes"] / measured["activations"]
    print(f"\nmeasured {measured}; planner activations / measured {ratio:.7f}")
    assert abs(ratio - 1) < 1e-4


@pytest.mark.skipif(not (torch.cuda.is_available() and fp8_kernels(torch.device("cuda"))),
                    reason="needs a GPU with FP8 tensor cores (compute capability 8.9+)")
def test_the_real_fp8_kernels_equal_the_emulation():
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(128, 256, generator=g), torch.randn(256, 64, generator=g)
    for rowwise in (False, True):
        sa = amax_to_scale(a.abs().amax(1, keepdim=True) if rowwise else a.abs().max(), E4M3)
        sb = amax_to_scale(b.abs().amax(0, keepdim=True) if rowwise else b.abs().max(), E4M3)
        qa, qb = cast(a, sa, E4M3), cast(b, sb, E4M3)
        cpu = scaled_mm(qa, qb, sa.reciprocal(), sb.reciprocal())
        gpu = scaled_mm(qa.cuda(), qb.cuda(), sa.reciprocal().cuda(), sb.reciprocal().cuda())
        err = float((gpu.cpu() - cpu).norm() / cpu.norm())
        print(f"\nrowwise={rowwise}: the GPU's FP8 kernel vs the emulation {err:.1e}")
        assert err < (1e-2 if rowwise else 1e-5)  # rowwise: the kernel's output is bf16
