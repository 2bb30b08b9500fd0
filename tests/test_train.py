"""The serial training loop: its JSON records, and that the tiny model learns."""

import argparse
import io
import json

import pytest

from edu3d.train import RECORD_KEYS, add_arguments, main, run


def _args(*argv):
    return add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_json_output_is_one_record_per_line():
    out = io.StringIO()
    records = run(_args("--steps", "3", "--json", "--warmup", "2"), out=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines, start=1):
        rec = json.loads(line)
        assert tuple(rec) == RECORD_KEYS and rec["step"] == i
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
    assert [tuple(json.loads(line)) for line in captured.out.splitlines()] == [RECORD_KEYS] * 2
    assert "234,880 parameters" in captured.err


def test_table_output():
    out = io.StringIO()
    run(_args("--steps", "2"), out=out)
    header, *rows = out.getvalue().splitlines()
    assert header.split() == ["step", "loss", "grad", "norm", "lr", "tok/s"] and len(rows) == 2


def test_main_reports_bad_config_as_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--heads", "3"])
    assert exc.value.code == 2
    assert "n_heads=3 does not divide d_model=64" in capsys.readouterr().err
