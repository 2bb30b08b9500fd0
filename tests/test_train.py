"""The serial training loop: its JSON records, and that the tiny model learns."""

import io
import json

import pytest

from edu3d.train.data import SyntheticCorpus
from edu3d.model.gpt import GPT, PRESETS
from edu3d.train.optim import make_optimizer
from edu3d.commands.train import main, parse
from edu3d.train.loop import RECORD_KEYS, TRAINER_KEYS, run, train_step


def _args(*argv):
    return parse(list(argv))


def test_json_output_is_one_record_per_line():
    out = io.StringIO()
    records = run(_args("--steps", "3", "--json", "--warmup", "2"), out=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines, start=1):
        rec = json.loads(line)
        assert tuple(rec) == RECORD_KEYS + TRAINER_KEYS and rec["step"] == i
        assert all(isinstance(rec[k], float) for k in RECORD_KEYS[1:])
    assert [r["lr"] for r in records] == pytest.approx([1.5e-3, 3e-3, 3e-3])


def test_runs_are_reproducible_and_sgd_without_clip_works():
    a = run(_args("--steps", "2", "--json"), out=io.StringIO())
    b = run(_args("--steps", "2", "--json"), out=io.StringIO())
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    sgd = run(_args("--steps", "2", "--optimizer", "sgd", "--clip", "0", "--lr", "0.1"),
              out=io.StringIO())
    assert sgd[0]["loss"] == a[0]["loss"] and sgd[1]["loss"] != a[1]["loss"]


def test_tiny_model_loss_falls():
    records = run(_args("--steps", "60", "--json"), out=io.StringIO())
    first = records[0]["loss"]
    last5 = sum(r["loss"] for r in records[-5:]) / 5
    assert last5 < first - 1.0, (first, last5)


def test_main_prints_only_json_on_stdout(capsys):
    assert main(["--steps", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert ([tuple(json.loads(line)) for line in captured.out.splitlines()]
            == [RECORD_KEYS + TRAINER_KEYS] * 2)
    assert "234,880 parameters" in captured.err


def test_table_output():
    out = io.StringIO()
    run(_args("--steps", "2"), out=out)
    header, *rows = out.getvalue().splitlines()
    assert header.split() == ["step", "loss", "grad", "norm", "lr", "tok/s"]
    assert [r.split()[0] for r in rows[:2]] == ["1", "2"]
    assert rows[2].startswith("throughput:") and rows[3].startswith("memory of the fullest rank")


def test_the_one_trainer_serially_equals_the_reference_step():
    """``edu3d train`` with one process runs the one Trainer (a one-stage pipeline with one
    micro-batch); the reference step (``train_step``) is written independently: they agree
    (the norm is summed in float64 by the trainer, in float32 by the reference)."""
    args = _args("--steps", "5", "--json")
    got = run(args, out=io.StringIO())
    model = GPT(PRESETS["tiny"], seed=0)
    opt = make_optimizer(model, args)
    corpus = SyntheticCorpus(256, 32, seed=0)
    want = [train_step(model, opt, *corpus.batch(s, 8), s, args) for s in range(1, 6)]
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)


def test_main_reports_bad_config_as_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--heads", "3"])
    assert exc.value.code == 2
    assert "n_heads=3 does not divide d_model=64" in capsys.readouterr().err
