"""``edu3d train --impl torch``: the same layouts on PyTorch's own APIs equal the serial run.

For each layout, :func:`edu3d.production.compare.parity` runs
:class:`~edu3d.production.torch_impl.TorchTrainer` against the serial reference step: every
gradient of step 1 gathered by serial name, then with plain SGD the gradient norms of steps 1
and 2 and the loss of step 2 (a wrong ``1/dp`` or ``1/m`` shows there), then the losses and
norms of 3 AdamW steps (was 5: on this tiny model a step is mostly DTensor's per-op overhead,
and the first 3 of the 5 steps are the same steps, so the errors are a subset of those the 5
gave). edu3d's own layouts equal the serial run to 1e-5 (tests/test_3d_parity.py), so
equality with serial is equality with edu3d. One launch per world size runs all its layouts,
each with its own meshes and model.

Tolerance: 1e-5 relative (fp32), as every parity test; the arithmetic is the same but not
bitwise (DDP's bucketed all-reduce, DTensor's reductions and the TP matmuls sum in other
orders than one process does). The losses and gradient norms of the AdamW steps are allowed,
besides, what rounding can do to them through AdamW, which amplifies it in tiny gradients:
how far the serial run's control ends from the serial run itself, scaled to the layout's
measured gradient error (:func:`tests.adamw_noise.beyond_records`; measured worst before
that allowance: 4.2e-6, AdamW's gradient norm, tp2 with tied embeddings; gradients 6e-7).
"""

from __future__ import annotations

import functools

import pytest

from edu3d.launch import launch
from edu3d.commands.train import parse
from edu3d.model.gpt import GPT
from edu3d.production.compare import options, parity_many, world_size
from edu3d.production.torch_check import unsupported
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import train_step
from edu3d.train.optim import make_optimizer
from edu3d.train.preflight import model_config
from tests.adamw_noise import serial_and_control

TOL = 1e-5
ADAMW_STEPS = 3

LAYOUTS = {
    "dp2": "--dp 2",
    "dp2 zero1": "--dp 2 --zero 1",
    "dp2 zero2 m2": "--dp 2 --zero 2 --microbatches 2",
    "dp2 zero3 tied": "--dp 2 --zero 3 --tie",
    "tp2 tied": "--tp 2 --tie",
    "tp2 sp recompute": "--tp 2 --sp --recompute full",
    "pp2 1f1b": "--pp 2 --schedule 1f1b --microbatches 4",
    "pp2 interleaved": "--pp 2 --schedule interleaved --vpp 2 --microbatches 4",
    "pp2 gpipe": "--pp 2 --schedule gpipe --microbatches 2",
    "pp2 zb-h1": "--pp 2 --schedule zb-h1 --microbatches 4",
    "pp2 zbv": "--pp 2 --schedule zbv --microbatches 4",
    "pp2 dualpipev": "--pp 2 --schedule dualpipev --microbatches 4",
    "dp2-tp2-pp2": "--dp 2 --tp 2 --pp 2 --microbatches 4",
}


@functools.lru_cache(maxsize=None)
def _results(ws: int) -> dict[str, dict]:
    names = [n for n in LAYOUTS if world_size(LAYOUTS[n].split()) == ws]
    run = launch(parity_many, ws, args=([LAYOUTS[n].split() for n in names], ADAMW_STEPS,
                                        False), timeout=300, name="impl-torch")
    return dict(zip(names, run.results[0]))


@functools.lru_cache(maxsize=None)
def rounding_spread(argv: tuple[str, ...], steps: int = ADAMW_STEPS) -> dict[str, float]:
    """How far the serial AdamW run's control ends from the serial run itself, worst step,
    relative, for gradient noise of ``TOL``: what rounding can do to the losses and gradient
    norms the layouts are compared on, in proportion to their noise
    (:mod:`tests.adamw_noise`; the serial run of :func:`edu3d.production.compare.parity`)."""
    args = options([*argv, "--impl", "torch"])
    config = model_config(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)

    def build():
        model = GPT(config, seed=args.training.seed)
        return model, make_optimizer(model, args)

    def train(model, opt):
        return [train_step(model, opt, *corpus.batch(s, args.batch.global_batch), s, args)
                for s in range(1, steps + 1)]

    run = serial_and_control(build, train, TOL)
    return {k: max(abs(c[k] - r[k]) / abs(r[k]) for c, r in zip(run["control"], run["records"]))
            for k in ("loss", "grad_norm")}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if world_size(a.split()) == 8 else n
    for n, a in LAYOUTS.items()])
def test_torch_layout_equals_serial(name):
    res = _results(world_size(LAYOUTS[name].split()))[name]
    errs = {k: res[k] for k in ("grad_err", "sgd_norm_err", "sgd_loss2_err",
                                "adam_loss_err_serial", "adam_norm_err_serial")}
    spread = rounding_spread(tuple(LAYOUTS[name].split()))
    print(f"\n{name}: " + " ".join(f"{k} {v:.1e}" for k, v in errs.items())
          + f" (AdamW's rounding spread: loss {spread['loss']:.1e} norm {spread['grad_norm']:.1e})")
    noise = res["grad_err"] / TOL  # the layout's gradient noise, against the control's
    allowed = {"adam_loss_err_serial": noise * spread["loss"],
               "adam_norm_err_serial": noise * spread["grad_norm"]}
    assert all(v < TOL + allowed.get(k, 0.0) for k, v in errs.items()), errs
    assert res["losses_torch"][-1] < res["losses_torch"][0]  # it trains


# HSDP: FSDP2 on the 2-D mesh (dp_replicate, dp_shard), against serial and edu3d's own run
HSDP = {"dp4 zero3 hsdp2 m2": "--dp 4 --zero 3 --hsdp 2 --microbatches 2",
        "dp4 zero2 hsdp2 m2 per-step": "--dp 4 --zero 2 --hsdp 2 --microbatches 2 "
                                       "--grad-reduce per-step"}


def test_hsdp_on_fsdp2s_2d_mesh_equals_serial_and_edu3d():
    """``--hsdp 2`` on dp4: ``fully_shard(mesh=mesh["dp_replicate", "dp_shard"])`` of
    ``init_device_mesh(..., (pp, 2, 2, tp))`` equals the serial run, and its AdamW losses
    edu3d's own HSDP run (shards within the groups, one all-reduce across per step)."""
    run = launch(parity_many, 4, args=([a.split() for a in HSDP.values()], ADAMW_STEPS, True),
                 timeout=300, name="impl-torch-hsdp")
    for name, res in zip(HSDP, run.results[0]):
        errs = {k: res[k] for k in ("grad_err", "sgd_norm_err", "sgd_loss2_err",
                                    "adam_loss_err_serial", "adam_norm_err_serial",
                                    "adam_loss_err_edu3d")}
        print(f"\n{name}: " + " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        assert max(errs.values()) < TOL, errs
        assert res["losses_torch"][-1] < res["losses_torch"][0]


@pytest.mark.parametrize("argv,flag", [
    ("--dp 2 --compress fp16", "--compress"),
    ("--dp 2 --dp-impl naive", "--dp-impl"),
    ("--dp 2 --zero 3 --prefetch", "--prefetch"),
    ("--tp 2 --tp-overlap", "--tp-overlap"),
    ("--dp 2 --zero 1 --offload", "--offload"),
    ("--pp 2 --partition balanced", "--partition"),
    ("--dp 2 --recompute selective", "--recompute"),
    ("--dp 2 --precision fp16", "--precision"),
    ("--dp 2 --ckpt-dir /tmp/x", "--ckpt-dir"),
    ("--dp 2 --inject-fault rank=1,step=1", "--inject-fault"),
    ("--pp 2 --tie", "--tie"),
    ("--model gpt2-small --pp 2", "--tie"),
    ("--dp 2 --tp 2 --zero 1", "--zero 1"),
    ("--dp 2 --pp 2 --zero 1", "--zero 1"),
    ("--dp 4 --zero 1 --hsdp 2", "--hsdp"),
])
def test_unsupported_flag_is_named(argv, flag):
    args = parse(argv.split())
    message = unsupported(args)
    assert message and flag in message, message
    assert "--impl edu3d" in message or "use --" in message  # says what would work


def test_supported_layouts_pass_the_check():
    for argv in [*LAYOUTS.values(), *HSDP.values()]:
        args = parse(argv.split())
        assert unsupported(args) is None, argv


def test_unsupported_flag_exits_2_before_any_process(capsys, monkeypatch):
    """``edu3d train --impl torch --compress fp16 --dp 2`` stops in the option check with
    exit code 2 and the flag named; nothing is launched."""
    import edu3d.launch.api
    from edu3d.commands.train import main

    def no_launch(*a, **k):
        raise AssertionError("launched")

    monkeypatch.setattr(edu3d.launch.api, "launch", no_launch)
    with pytest.raises(SystemExit) as exc:
        main(["--impl", "torch", "--compress", "fp16", "--dp", "2", "--steps", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--compress fp16" in err and "--impl torch" in err
