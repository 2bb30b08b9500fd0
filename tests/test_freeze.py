"""``--freeze GLOB[,GLOB...]``: frozen parameters get no gradient and no optimizer state, stay
bitwise at their initial values, and every layout still equals the serial model frozen by
hand, at the gradient level (plain SGD) and after several AdamW steps, within 1e-5 (after
AdamW, beyond what rounding can do there: tests/adamw_noise.py)."""

from __future__ import annotations

import functools

import pytest

from edu3d.config.layout import Layout
from edu3d.launch import launch
from tests.workers_freeze import BAD_FREEZE, parity_many, serial_reference

TOL = 1e-5
ADAM_STEPS = 3
EMB = "--freeze tok_emb.*,pos_emb.*"
FIRST = "--freeze tok_emb.*,pos_emb.*,blocks.0.*,blocks.1.*"  # pp2: stage 0 wholly frozen

LAYOUTS = {
    "dp2 emb": f"--dp 2 {EMB}",
    "dp2 zero1 first": f"--dp 2 --zero 1 {FIRST}",
    "dp2 zero2 m2 mixed": "--dp 2 --zero 2 --microbatches 2 --freeze blocks.1.*,ln_f.*",
    "dp2 zero3 emb": f"--dp 2 --zero 3 {EMB}",
    "tp2 sp first": f"--tp 2 --sp {FIRST}",
    "pp2 first": f"--pp 2 --microbatches 2 {FIRST}",
    "dp2 pp2 zero1 first": f"--dp 2 --pp 2 --zero 1 --microbatches 2 {FIRST}",
    "dp2 pp2 zb-h1 emb": f"--dp 2 --pp 2 --schedule zb-h1 --microbatches 2 {EMB}",
    "dp2 tp2 zero3 tied emb": f"--dp 2 --tp 2 --zero 3 --tie {EMB}",
}


def _layout(argv: list[str]) -> Layout:
    return Layout(**{k: int(argv[argv.index(f"--{k}") + 1]) if f"--{k}" in argv else 1
                     for k in ("dp", "tp", "pp")})


@functools.lru_cache(maxsize=None)
def _results(layout: Layout) -> dict:
    names = [n for n in LAYOUTS if _layout(LAYOUTS[n].split()) == layout]
    argvs = [LAYOUTS[n].split() for n in names]
    refs = [serial_reference(a, ADAM_STEPS, TOL) for a in argvs]
    run = launch(parity_many, layout.world_size, args=(argvs, refs), layout=layout,
                 timeout=300, name="freeze")
    return dict(zip(names, run.results[0]))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_frozen_layout_equals_frozen_serial(name):
    res = _results(_layout(LAYOUTS[name].split()))[name]
    print(f"\n{name}: grad {res['grad_err']:.1e} sgd {res['sgd_err']:.1e} adam "
          f"{res['adam_err']:.1e} loss {res['loss_err']:.1e} norm {res['norm_err']:.1e}")
    assert res["frozen"], "the case froze nothing"
    assert res["frozen_grad_zero"] and res["frozen_bitwise"]
    assert res["optimizer_state_of_frozen"] == 0
    for key in ("grad_err", "sgd_err", "loss_err", "norm_err", "adam_err"):
        assert res[key] < TOL, (key, res[key])


def test_freezing_changes_the_run():
    """The reference itself differs from the unfrozen run (the frozen weights did not move
    while the trainable ones did), so the parity above is not parity of two no-ops."""
    ref = serial_reference(EMB.split(), 1)
    assert ref["grads"]["tok_emb.weight"] is None
    assert ref["grads"]["blocks.0.attn.qkv.weight"] is not None
    moved = ref["adam_params"]["blocks.0.attn.qkv.weight"] - ref["init"]["blocks.0.attn.qkv.weight"]
    assert moved.abs().max() > 0


@pytest.mark.parametrize("argv,message", BAD_FREEZE)
def test_a_bad_freeze_fails_before_any_process(argv, message, capsys, monkeypatch):
    from edu3d import cli
    from edu3d.launch import api

    monkeypatch.setattr(api, "launch", lambda *a, **k: pytest.fail("launched"))
    try:
        code = cli.main(["train", "--dp", "2", *argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
    if "matches no" in message:
        assert "blocks.0." in err  # a few real names


def test_freeze_is_part_of_a_checkpoints_identity(tmp_path):
    """A checkpoint written with one --freeze is refused by a run with another (its frozen
    weights never got optimizer state): one line naming the option."""
    from edu3d.ckpt.format import CheckpointError, check_resume
    from edu3d.commands.train import parse
    from edu3d.train.loop import run
    from edu3d.train.preflight import check_args
    import io

    ck = str(tmp_path / "ck")
    run(parse(["--steps", "1", "--ckpt-dir", ck, "--freeze", "tok_emb.*"]), out=io.StringIO())
    args = parse(["--steps", "2", "--ckpt-dir", ck, "--resume"])
    config, _ = check_args(args)
    with pytest.raises(CheckpointError, match="--freeze: checkpoint tok_emb"):
        check_resume(args, config)
