"""``edu3d calibrate`` and the CPU terms of the model, machine-independently.

The fits are held to synthetic measurements made from known constants (they must give the
constants back); a profile built from them is written, read back by name and predicted with;
bad profiles and bad options are refused in one line; the CPU terms (the step's loops over
tensors, data parallelism's hooks, gloo's collectives by kind, ZeRO unit by unit) change the
prediction the way the trace of a real step says. Nothing here times anything.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from edu3d import cli
from edu3d.bench import calibration, cpu_fit, profile_fit, trainer_steps
from edu3d.config.sections import Run
from edu3d.plan import cpu, hardware, links, trainer_comm
from edu3d.plan.estimate import setup, spec_of
from edu3d.plan.hardware import ProfileError, load_profile, profile_from_dict
from edu3d.plan.step import predict

RATE, FIXED, DISPATCH = 90e9, 50e-6, 44e-6  # FLOP/s, s per linear layer, s of it at 1x1x1
KERNEL, TENSOR, HOOK = 20e-6, 30e-6, 8e-6  # s per kernel, per tensor per step, per mb
SYNC = 16e-6  # s per tensor per step beyond the serial step, under data parallelism
CORUN = 1.25  # how much slower the serial steps run on both ranks at once
ALPHA, BUSBW = 200e-6, 1.5e9
WRAP, CALLS, INSIDE = 150e-6, 48, 100e-6  # s around a collective, per micro-batch, inside one
TENSORS, KERNELS = 53, 109
CHECKPOINT, REGIONS, RECOMPUTED = 350e-6, 4, 4  # s per checkpointed block, blocks, kernels
ABOUT = "measured by edu3d calibrate on 2026-01-01, test, torch 0"


def linear_times(shapes, rate=RATE, fixed=FIXED):
    return [fixed + 6.0 * m * n * k / rate for m, n, k in shapes]


def ring_times(kind, sizes, n=2, alpha=ALPHA, busbw=BUSBW):
    """``[bytes, median, minimum, CPU inside, mean]``: a heavy tail puts the mean (what the
    profile takes: a step sums dozens of collectives) above the median."""
    steps, factor = profile_fit.ring(kind, n)
    return [[s, 0.7 * (alpha * steps + s * factor / busbw), alpha * steps / 2, INSIDE,
             alpha * steps + s * factor / busbw] for s in sizes]


def measurements() -> dict:
    """What :func:`edu3d.bench.calibration.measure` returns, made from the constants above."""
    shapes = calibration.SHAPES["cpu"]
    eager = {"microbatches": [1, 2, 4], "model": "tiny, width 8", "tensors": TENSORS,
             "kernels": KERNELS, "dispatches": 442,
             "seconds": [TENSORS * TENSOR + m * KERNELS * KERNEL for m in (1, 2, 4)]}
    dp = {"microbatches": [1, 2, 4],
          "seconds": [TENSORS * (TENSOR + SYNC) + m * (KERNELS * KERNEL + TENSORS * HOOK)
                      for m in (1, 2, 4)]}
    tp = {"microbatches": [1, 2, 4], "collectives": CALLS,
          "seconds": [TENSORS * TENSOR + m * (KERNELS * KERNEL + CALLS * (WRAP + INSIDE))
                      for m in (1, 2, 4)]}
    rec = {"microbatches": [1, 2, 4], "kernels": KERNELS + RECOMPUTED, "regions": REGIONS,
           "seconds": [TENSORS * TENSOR + m * ((KERNELS + RECOMPUTED) * KERNEL
                                               + REGIONS * CHECKPOINT) for m in (1, 2, 4)]}
    block = {"shape": "b=4 s=32 d=64 heads=4", "ops": [["matmul", 3e6, 1e5, 1],
                                                       ["memory", 0.0, 4e6, 2]]}
    block["seconds"] = 3 * KERNEL + 3e6 / RATE + 4e6 / 8e9  # 8 GB/s elementwise
    return {
        "device": "cpu", "dtype": "fp32", "clock": "synthetic",
        "matmul": {p: {"shapes": [list(s) for s in shapes], "dispatch_s": DISPATCH,
                       "seconds": linear_times(shapes, rate)}
                   for p, rate in (("fp32", RATE), ("bf16", 2 * RATE))},
        "stream": {"bytes": 2**26, "seconds": 2 * 2**26 / 16e9},
        "attention": {"shape": "b=4", "flops": 1e9, "seconds": 1e9 / (0.3 * RATE)},
        "eager": eager, "recompute": rec, "layers": [block],
        "collectives": {"ranks": 2, "backend": "gloo", "runtime_bytes": 3e8,
                        "data_parallel": dp, "tensor_parallel": tp,
                        "together": {"microbatches": [1, 2, 4], "seconds": [
                            CORUN * t for t in eager["seconds"]]},
                        "ops": {k: ring_times(k, calibration.COLLECTIVE_SIZES)
                                for k in calibration.OPS}},
        "name": "this-machine", "description": "a test machine", "memory_bytes": 16e9,
        "memory_from": "test", "allocator_factor": 1.0, "allocator_from": "test",
        "ranks_per_node": 64, "ranks_per_node_from": "test", "cores": 2}


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EDU3D_PROFILES", str(tmp_path))
    return tmp_path


# ---- the fits give back the constants they were made from -----------------------------------------
def test_fits_recover_known_constants():
    a, b = cpu_fit.line([1, 2, 4], [3.0, 5.0, 9.0])
    assert (a, b) == pytest.approx((1.0, 2.0))
    shapes = calibration.SHAPES["cpu"]
    mm = profile_fit.matmul_fit(shapes, linear_times(shapes), DISPATCH)
    assert mm["rate"] == pytest.approx(RATE) and mm["fixed"] == pytest.approx(FIXED)
    assert mm["half_flops"] == pytest.approx((FIXED - DISPATCH) / 3 * RATE)
    for kind in calibration.OPS:
        pts = ring_times(kind, calibration.COLLECTIVE_SIZES)
        f = profile_fit.alpha_beta(kind, 2, [p[0] for p in pts], [p[4] for p in pts])
        assert (f["alpha"], f["bandwidth"]) == pytest.approx((ALPHA, BUSBW)), kind
    m = measurements()
    e = profile_fit.eager_fit([1, 2, 4], m["eager"]["seconds"], KERNELS, TENSORS)
    assert (e["per_kernel"], e["per_tensor"]) == pytest.approx((KERNEL, TENSOR))
    hook = cpu_fit.hook_fit([1, 2, 4], m["collectives"]["data_parallel"]["seconds"],
                                e["per_microbatch"], TENSORS)
    assert hook == pytest.approx(HOOK)
    sync = cpu_fit.sync_fit([1, 2, 4], m["collectives"]["data_parallel"]["seconds"],
                                e["per_step"], TENSORS)
    assert sync == pytest.approx(SYNC)
    assert cpu_fit.corun_fit(m["collectives"]["together"]["seconds"],
                                 m["eager"]["seconds"]) == pytest.approx(CORUN)
    assert cpu_fit.corun_fit([1.0], [2.0]) == 1.0  # never faster together than alone
    tp = m["collectives"]["tensor_parallel"]
    wrap = cpu_fit.collective_fit([1, 2, 4], tp["seconds"], e["per_microbatch"], CALLS,
                                      INSIDE)
    assert wrap == pytest.approx(WRAP)
    prof = profile_fit.profile_from(m, ABOUT)
    assert prof["collective_overhead"]["value"] == pytest.approx(WRAP)
    # a checkpointed block: its recomputing steps' slope less the kernels it re-launches
    rec = m["recompute"]
    assert cpu_fit.checkpoint_fit([1, 2, 4], rec["seconds"], e["per_microbatch"], RECOMPUTED,
                                  KERNEL, REGIONS) == pytest.approx(CHECKPOINT)
    assert prof["checkpoint_overhead"]["value"] == pytest.approx(CHECKPOINT)
    assert "4 regions a micro-batch" in prof["checkpoint_overhead"]["source"]
    old = dict(m)
    del old["recompute"]  # measured before calibrate timed the checkpoints: no term
    assert "checkpoint_overhead" not in profile_fit.profile_from(old, ABOUT)
    # what calibrate's tensor-parallel steps issue per micro-batch, as the model counts them
    assert cpu_fit.collectives_per_microbatch(Run.of(**trainer_steps.EAGER, global_batch=1,
                                                         microbatches=1, tp=2, sp=True)) == 48
    w = profile_fit.elementwise_fit(m["layers"], RATE, 0.0, 0.3, KERNEL)
    assert w["bandwidth"] == pytest.approx(8e9)


def test_noisy_measurements_fall_back_or_are_refused_in_one_line():
    # a large message no slower than a small one: alpha from the smallest, bandwidth after it
    f = profile_fit.alpha_beta("all_reduce", 2, [4, 2**20, 2**22], [3e-4, 2e-4, 4e-3])
    assert f["alpha"] > 0 and f["bandwidth"] > 0
    for call in (lambda: cpu_fit.line([1, 1], [1.0, 2.0]),
                 lambda: cpu_fit.line([1, 2], [1.0, 0.0]),
                 lambda: profile_fit.matmul_fit([(1, 1, 1), (64, 64, 64)], [1e-3, 1e-4], 0.0),
                 lambda: profile_fit.eager_fit([1, 4], [5e-3, 4e-3], 100, 10),
                 lambda: profile_fit.elementwise_fit(
                     [{"shape": "b=1", "seconds": 1e-6, "ops": [["matmul", 1e9, 0, 1]]}],
                     RATE, 0.0, 0.3, KERNEL),
                 lambda: profile_fit.ring("all_to_all", 2)):
        with pytest.raises(cpu_fit.CalibrationError) as err:
            call()
        assert "\n" not in str(err.value)


# ---- the profile: schema, sources, written and read back ----------------------------------------
def test_profile_is_valid_sourced_written_and_read_back_by_name(profile_dir):
    prof = profile_fit.profile_from(measurements(), ABOUT)
    loaded = profile_from_dict(prof, "synthetic")
    assert loaded.peak_flops["fp32"] == pytest.approx(RATE)
    assert loaded.peak_flops["bf16"] == pytest.approx(2 * RATE)
    assert loaded.kernel_overhead == pytest.approx(KERNEL)
    assert loaded.step_overhead == pytest.approx(TENSOR)
    assert loaded.hook_overhead == pytest.approx(HOOK)
    assert loaded.sync_overhead == pytest.approx(SYNC)
    assert loaded.corun == pytest.approx(CORUN)
    assert loaded.checkpoint_overhead == pytest.approx(CHECKPOINT)
    assert loaded.cores == 2 and loaded.intra_alpha == pytest.approx(ALPHA)
    assert loaded.collectives["reduce_scatter"] == pytest.approx((ALPHA, BUSBW))
    assert all(s.startswith(ABOUT) for s in loaded.sources.values())
    alpha = loaded.sources["link.intra.alpha"]
    assert "mean of the repetitions" in alpha and "their minimum" in alpha
    assert f"the median of the same repetitions gives {0.7 * ALPHA * 1e6:.1f} us" in alpha
    old = measurements()  # a measurement from before the mean was kept: fitted on the median
    for pts in old["collectives"]["ops"].values():
        for p in pts:
            del p[4]
    before = profile_from_dict(profile_fit.profile_from(old, ABOUT), "synthetic")
    assert before.intra_alpha == pytest.approx(0.7 * ALPHA)
    assert "median of the repetitions" in before.sources["link.intra.alpha"]
    with pytest.raises(ProfileError, match="run edu3d calibrate"):
        load_profile(hardware.USER_PROFILE)
    profile_fit.write(prof, hardware.user_profiles() / "this-machine.json")
    again = load_profile("this-machine")
    assert again.kernel_overhead == pytest.approx(KERNEL) and again.name == "this-machine"
    assert [p.name for p in profile_dir.iterdir()] == ["this-machine.json"]  # no temporary left


BAD = [(lambda d: d.pop("kernel_overhead"), "missing constant kernel_overhead"),
       (lambda d: d["link"]["intra"]["bandwidth"].update(value=-1.0), "outside"),
       (lambda d: d["cores"].update(value=1.5), "not a whole number"),
       (lambda d: d["step_overhead"].update(value=1.0), "step_overhead = 1 is outside"),
       (lambda d: d.update(collectives=[1, 2]), "collectives must be an object"),
       (lambda d: d["collectives"]["send_recv"].pop("alpha"), "collectives.send_recv.alpha"),
       (lambda d: d["hook_overhead"].update(source="me"), "has no source")]


@pytest.mark.parametrize("change,message", BAD, ids=[b[1] for b in BAD])
def test_a_bad_profile_is_refused_in_one_line(change, message, tmp_path):
    prof = profile_fit.profile_from(measurements(), ABOUT)
    change(prof)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(prof))
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert message in str(err.value) and "\n" not in str(err.value)


# ---- the command -------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,message", [(["--budget", "5"], "--budget: 5: must be"),
                                          (["--budget", "nan"], "--budget: nan: must be"),
                                          (["--output", "x.txt"], "ending in .json")])
def test_bad_options_are_refused_before_measuring(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["calibrate", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err


def test_the_command_writes_the_profile_or_says_in_one_line_why_not(profile_dir, capsys,
                                                                    monkeypatch):
    def spoiled(*a, **k):
        raise cpu_fit.CalibrationError("matmul times do not grow with their FLOPs")

    monkeypatch.setattr(calibration, "measure", spoiled)
    assert cli.main(["calibrate"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "edu3d calibrate: matmul times do not grow with their FLOPs"
    assert not list(profile_dir.iterdir())
    monkeypatch.setattr(calibration, "measure", lambda budget, progress: measurements())
    assert cli.main(["calibrate", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["kernel_overhead"]["value"] == pytest.approx(KERNEL)
    assert load_profile("this-machine").cores == 2


# ---- the CPU terms in the model ----------------------------------------------------------------
def cpu_profile():
    return profile_from_dict(profile_fit.profile_from(measurements(), ABOUT), "synthetic")


def test_cpu_terms_add_what_a_real_step_spends():
    prof, gpu = cpu_profile(), load_profile("h100-sxm")
    spec = spec_of(Run.of(model="tiny"))
    serial, dp2 = setup(precision="fp32"), setup(precision="fp32", dp=2, microbatches=2)
    assert cpu.tensors_held(spec, serial, 0) == TENSORS  # edu3d's tiny GPT: 53 tensors
    assert cpu.step_overhead(spec, serial, prof, 0) == pytest.approx(TENSORS * TENSOR)
    assert cpu.step_overhead(spec, serial, gpu, 0) == 0.0
    assert cpu.microbatch_overhead(spec, serial, prof, 0) == 0.0  # no data parallelism
    assert cpu.microbatch_overhead(spec, dp2, prof, 0) == pytest.approx(TENSORS * HOOK * CORUN)
    # data parallelism's once-a-step cost: charged to a data-parallel step, on a CPU only
    assert cpu.sync_overhead(spec, serial, prof, 0) == 0.0
    assert cpu.sync_overhead(spec, dp2, prof, 0) == pytest.approx(TENSORS * SYNC * CORUN)
    assert cpu.sync_overhead(spec, dp2, gpu, 0) == 0.0
    without = dataclasses.replace(prof, sync_overhead=0.0)
    assert (predict(spec, dp2, prof, memory=False).parts["optimizer"]
            - predict(spec, dp2, without, memory=False).parts["optimizer"]) == pytest.approx(
                TENSORS * SYNC * CORUN)
    assert predict(spec, serial, prof, memory=False).step_time == pytest.approx(
        predict(spec, serial, without, memory=False).step_time)
    assert cpu.ranks_per_core(prof, 8) == 4 * CORUN and cpu.ranks_per_core(gpu, 8) == 1
    # ranks beside each other: a multi-rank step's host and compute terms stretch by corun,
    # a serial step's and a GPU's not at all
    assert cpu.corun(prof, 1) == 1.0 and cpu.corun(prof, 2) == CORUN and cpu.corun(gpu, 2) == 1
    alone = dataclasses.replace(prof, corun=1.0)
    assert predict(spec, serial, prof, memory=False).step_time == pytest.approx(
        predict(spec, serial, alone, memory=False).step_time)
    two, one = (predict(spec, dp2, p, memory=False).parts for p in (prof, alone))
    for part in ("compute", "overhead"):
        assert two[part] == pytest.approx(CORUN * one[part])
    # gloo by kind: a reduce-scatter costs what was measured for it, not all-gather's figure
    link = links.link_for(prof, 1, 2)
    assert set(link.kinds) == set(links.KINDS) - {"all_to_all"}  # all-to-all: not measured
    assert not links.link_for(gpu, 1, 8).kinds
    assert links.collective_time("send", 0.0, 2, link) == 0.0
    assert links.collective_time("send", 1.0, 2, link) == pytest.approx(ALPHA + 1 / BUSBW
                                                                         + WRAP)
    assert links.link_for(gpu, 1, 8).host == 0.0  # a GPU profile: no host term
    # recomputation: each checkpointed block costs its host machinery, on a CPU only
    sel = setup(precision="fp32", recompute="selective")
    assert cpu.checkpoint_overhead(prof, "none", 1) == 0.0
    assert cpu.checkpoint_overhead(gpu, "selective", 1) == 0.0
    assert cpu.checkpoint_overhead(prof, "selective", 2) == pytest.approx(CHECKPOINT * CORUN)
    bare = dataclasses.replace(prof, checkpoint_overhead=0.0)
    assert (predict(spec, sel, prof, memory=False).step_time
            - predict(spec, sel, bare, memory=False).step_time) == pytest.approx(
                spec.n_layers * CHECKPOINT)  # one region a block, one micro-batch
    assert predict(spec, serial, prof, memory=False).step_time == pytest.approx(
        predict(spec, serial, bare, memory=False).step_time)


def test_zero_reduces_unit_by_unit_and_zero2_every_microbatch():
    prof = cpu_profile()
    spec = spec_of(Run.of(model="tiny"))
    link, n = links.group_link(prof, setup(dp=2).layout, "dpcp")
    units = trainer_comm.unit_elements(spec, setup(dp=2, zero=1), 0, False)
    assert len(units) == 6 and sum(units) == 234_880  # 4 blocks, embedding, final norm
    one = trainer_comm.zero_reduce(spec, setup(dp=2, zero=1, microbatches=4), 0, False, 2, 2, n,
                                   link)
    two = trainer_comm.zero_reduce(spec, setup(dp=2, zero=2, microbatches=4), 0, False, 2, 2, n,
                                   link)
    assert one[0] >= 6 * ALPHA and two[0] == pytest.approx(4 * one[0]) and two[1] == one[1]
    assert trainer_comm.bookkeeping(spec, setup(), prof) == 0.0
    assert trainer_comm.bookkeeping(spec, setup(dp=2), prof) == pytest.approx(  # the loss only
        links.collective_time("all_reduce", 4, 2, link))
    assert trainer_comm.bookkeeping(spec, setup(dp=2, zero=1), prof) == pytest.approx(
        links.collective_time("all_reduce", 4, 2, link)  # and the norm of the shards
        + links.collective_time("all_reduce", 8, 2, link))
    steps = {z: predict(spec, setup(precision="fp32", dp=2, zero=z, microbatches=2), prof)
             for z in (0, 1, 2)}
    assert steps[0].step_time < steps[1].step_time < steps[2].step_time  # as measured
