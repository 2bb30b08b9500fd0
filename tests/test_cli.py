"""The edu3d command as a user types it."""

import json
import subprocess
import sys
import textwrap
import time

import pytest

EDU3D = [sys.executable, "-m", "edu3d.cli"]


def _run(args, **kw):
    return subprocess.run(EDU3D + args, capture_output=True, text=True, timeout=300, **kw)


def test_launcher_path_imports_no_torch():
    code = ("import sys, edu3d.cli, edu3d.launch, edu3d.worker, edu3d.pool; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False"


def test_run_prefixes_output_and_exits_zero(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import os, sys\nprint('hi', sys.argv[1:], os.environ['RANK'])\n")
    p = _run(["run", "-n", "2", str(script), "a", "--b"])
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.splitlines()) == ["[rank 0] hi ['a', '--b'] 0",
                                             "[rank 1] hi ['a', '--b'] 1"]


def test_run_names_the_failing_rank(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(textwrap.dedent("""
        import torch.distributed as dist
        from edu3d import runtime
        mesh = runtime.init()
        if mesh.rank == 3:
            raise KeyError("missing shard")
        dist.barrier()
    """))
    t0 = time.monotonic()
    p = _run(["run", "-n", "4", str(script)])
    assert p.returncode == 1
    assert "edu3d run: rank 3 failed: KeyError: 'missing shard'" in p.stderr
    assert "---- traceback of rank 3 ----" in p.stderr and "bad.py" in p.stderr
    assert time.monotonic() - t0 < 60


def test_run_timeout_exit_code(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time\ntime.sleep(600)\n")
    p = _run(["run", "-n", "2", "--timeout", "5", str(script)])
    assert p.returncode == 124 and "did not finish within 5 s" in p.stderr


def test_train_json_is_exactly_one_object_per_step():
    p = _run(["train", "--steps", "4", "--json"])
    assert p.returncode == 0, p.stderr
    records = [json.loads(line) for line in p.stdout.splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(set(r) == {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mem_bytes",
                          "comm_s"} for r in records)
    assert records[0]["comm_s"] == {}  # one process: no communication


def test_train_rejects_a_bad_model_before_starting():
    p = _run(["train", "--heads", "5"])
    assert p.returncode == 2 and "n_heads=5 does not divide d_model=64" in p.stderr


def test_doctor_reports_gloo_working_on_two_ranks():
    p = _run(["doctor"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "gloo smoke run on 2 ranks: OK" in p.stdout


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["train", "--help"]])
def test_help(args):
    p = _run(args)
    assert p.returncode == 0 and "usage: edu3d" in p.stdout


def test_every_benchmark_entry_point_exists():
    """`edu3d bench NAME` resolves to a real function for every NAME it offers."""
    import importlib

    from edu3d.cli import BENCHMARKS

    assert {"launch", "comm", "dp", "zero", "tp", "pp"} <= set(BENCHMARKS)
    for name, target in BENCHMARKS.items():
        module, _, fn = target.partition(":")
        assert callable(getattr(importlib.import_module(module), fn)), name


# ---- every input checked before any process starts (issue 9) ---------------------------------
def _refused_before_launch(p):
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "launching" not in p.stderr and "Traceback" not in p.stderr


BAD_NUMBERS = [
    (["--lr", "-1"], "--lr: -1: must be a finite number > 0"),
    (["--lr", "inf"], "--lr: inf: must be a finite number > 0"),
    (["--vocab", "1"], "--vocab: 1: must be an integer >= 4"),
    (["--weight-decay", "nan"], "--weight-decay: nan: must be a finite number >= 0"),
    (["--bucket-mb", "0"], "--bucket-mb: 0: must be a finite number > 0"),
    (["--bucket-mb", "-1"], "--bucket-mb: -1: must be a finite number > 0"),
    (["--timeout", "0"], "--timeout: 0: must be a finite number > 0"),
]


def test_train_refuses_a_bad_number_in_one_line_before_launching():
    """The command as typed, in its own process: exit code 2, one line, nothing launched."""
    p = _run(["train", "--dp", "2", "--steps", "3", "--lr", "nan"])
    _refused_before_launch(p)
    assert p.stderr.startswith("edu3d train: error: argument")
    assert "--lr: nan: must be a finite number > 0" in p.stderr


@pytest.mark.parametrize("bad,message", BAD_NUMBERS)
def test_every_bad_number_is_refused_in_one_line(bad, message, capsys, monkeypatch):
    """The same check for every other number, through ``edu3d.cli.main`` in this process
    (a new interpreter per case would only add its start-up): nothing may launch."""
    from edu3d import cli, launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--dp", "2", "--steps", "3", *bad])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("edu3d train: error: argument") and message in err


def test_train_refuses_a_model_that_cannot_fit_before_launching():
    p = _run(["train", "--model", "gpt2-small", "--layers", "96", "--d-model", "8192",
              "--heads", "64", "--steps", "1"])
    _refused_before_launch(p)
    assert "this run cannot fit: 77.74 B parameters" in p.stderr


def test_train_describes_the_model_without_building_it(monkeypatch):
    import argparse

    from edu3d import train

    def no_model(*_, **__):
        raise AssertionError("the launching process built a model")

    monkeypatch.setattr(train, "GPT", no_model)
    monkeypatch.setattr(train, "_run_parallel", lambda *_: [])
    args = train.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--model", "medium", "--dp", "2"])
    assert train.run(args) == []


def _interrupt_after_first_record(argv):
    import signal

    # SIGINT's default disposition: a test run in the background inherits it ignored
    p = subprocess.Popen(EDU3D + ["train", "--steps", "100000", "--json", *argv],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.stdout.readline().startswith('{"step": 1')
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return p.returncode, err


@pytest.mark.parametrize("layout", [[], ["--dp", "2"]], ids=["serial", "dp2"])
def test_train_ctrl_c_is_one_line_and_exit_130(layout):
    code, err = _interrupt_after_first_record(layout)
    assert code == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1] == "edu3d train: interrupted"


def test_train_timeout_exits_124_and_names_the_option():
    p = _run(["train", "--dp", "2", "--steps", "100000", "--timeout", "5"])
    assert p.returncode == 124, p.stderr
    assert "edu3d train: --timeout 5 s: run did not finish within 5 s" in p.stderr
    assert "Traceback" not in p.stderr


# ---- help, errors, course --------------------------------------------------------------------
@pytest.mark.parametrize("args,shown", [
    (["train", "--help"], ["peak learning rate (default: 0.003)", "(default: 1f1b)",
                           "--lr-schedule", "--precision", "--grad-accum"]),
    (["run", "--help"], ["(default: 2)"]),
    (["doctor", "--help"], ["(default: 120.0)"]),
    (["course", "--help"], ["(default: 127.0.0.1", "passed to JupyterLab"]),
    (["schedule", "--help"], ["chunks per rank, interleaved only (default: 1)", "examples:"]),
])
def test_help_shows_defaults(args, shown):
    p = _run(args)
    assert p.returncode == 0
    for text in shown:
        assert text in " ".join(p.stdout.split()), text


def test_schedule_help_is_plain_text():
    out = _run(["schedule", "--help"]).stdout
    assert "``" not in out and "::" not in out


def test_argument_errors_are_one_line():
    p = _run(["schedule", "--name", "1f1b", "--pp", "0", "--microbatches", "4"])
    assert p.returncode == 2 and p.stderr.splitlines() == [
        "edu3d schedule: error: argument --pp: 0: must be a positive integer (1, 2, 3 ...) "
        "(see edu3d schedule --help)"]


def test_every_course_option_has_help():
    import argparse

    from edu3d.cli import build_parser

    sub = next(a for a in build_parser("")._actions if isinstance(a, argparse._SubParsersAction))
    assert all(action.help for action in sub.choices["course"]._actions)


def test_course_serves_the_root_on_loopback_and_passes_jupyter_options_through():
    from edu3d.cli import COURSE_ROOT, course_command, parse_args

    args = parse_args(["course", "--no-browser", "--port", "9000", "--ServerApp.token=s3cret"])
    cmd = course_command(args, as_root=False)
    assert cmd[1:3] == ["-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={COURSE_ROOT}" in cmd
    assert (COURSE_ROOT / "notebooks").is_dir() and (COURSE_ROOT / "exercises").is_dir()
    assert "--LabApp.default_url=/lab/tree/notebooks" in cmd
    assert "--ServerApp.ip=127.0.0.1" in cmd
    assert {"--no-browser", "--port=9000", "--ServerApp.token=s3cret"} <= set(cmd)
    assert "--allow-root" not in cmd
    assert "--allow-root" in course_command(args, as_root=True)


def test_bench_progress_goes_to_stderr_from_rank_0_only(monkeypatch, capsys):
    from edu3d.bench import progress

    monkeypatch.setenv("RANK", "1")
    progress("repetition 1/5")
    monkeypatch.setenv("RANK", "0")
    progress("repetition 2/5")
    out = capsys.readouterr()
    assert out.out == "" and out.err == "bench: repetition 2/5\n"
