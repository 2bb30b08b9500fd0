"""The edu3d command as a user types it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

EDU3D = [sys.executable, "-m", "edu3d.cli"]


def _run(args, timeout: float = 300, **kw):
    return subprocess.run(EDU3D + args, capture_output=True, text=True, timeout=timeout, **kw)


def test_launcher_path_imports_no_torch():
    code = ("import sys, edu3d.cli, edu3d.launch.api, edu3d.launch.worker, edu3d.launch.warm.pool; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False"


def test_run_prefixes_output_and_exits_zero(tmp_path):
    """... and prints its run folder (to stderr)."""
    script = tmp_path / "ok.py"
    script.write_text("import os, sys\nprint('hi', sys.argv[1:], os.environ['RANK'])\n")
    p = _run(["run", "-n", "2", str(script), "a", "--b"],
             env={**os.environ, "EDU3D_RUNS": str(tmp_path / "runs")})
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.splitlines()) == ["[rank 0] hi ['a', '--b'] 0",
                                             "[rank 1] hi ['a', '--b'] 1"]
    folder = next((tmp_path / "runs").iterdir())
    assert f"run folder {folder}" in p.stderr


def test_run_names_the_failing_rank(tmp_path):
    """The command's report of a failed run: exit 1, the rank, its traceback, and the other
    rank killed, not waited for: it sleeps an hour, so the command ending at all before its
    hang guard (240 s, for a busy machine) proves the kill (how soon: ``edu3d bench goals``).
    Its ranks import nothing: the launcher naming the raising rank among partners failing in
    a collective is test_launch's test_raising_rank_is_named_with_traceback_and_nothing_is_left
    (4 ranks)."""
    script = tmp_path / "bad.py"
    script.write_text(textwrap.dedent("""
        import os, time
        if os.environ["RANK"] == "1":
            raise KeyError("missing shard")
        time.sleep(3600)
    """))
    try:
        p = _run(["run", "-n", "2", str(script)], timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("edu3d run waited for the sleeping rank instead of killing it")
    assert p.returncode == 1
    assert "edu3d run: rank 1 failed: KeyError: 'missing shard'" in p.stderr
    assert "---- traceback of rank 1 ----" in p.stderr and "bad.py" in p.stderr


def test_run_timeout_exit_code(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time\ntime.sleep(600)\n")
    p = _run(["run", "-n", "2", "--timeout", "5", str(script)])
    assert p.returncode == 124 and "did not finish within 5 s" in p.stderr


def test_train_json_is_exactly_one_object_per_step(capfd):
    """Through ``edu3d.cli.main`` in this process, every write to fd 1 captured (that nothing
    is written to stdout before the first record, not even at import, is the subprocess in
    test_train_ctrl_c_is_one_line_and_exit_130)."""
    from edu3d import cli

    assert cli.main(["train", "--steps", "4", "--json"]) == 0
    out, err = capfd.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(set(r) == {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mem_bytes",
                          "comm_s", "exposed_s", "comm_any_s", "wire_bytes"} for r in records)
    assert records[0]["comm_s"] == records[0]["wire_bytes"] == {}  # one process: no traffic
    assert records[0]["exposed_s"] == records[0]["comm_any_s"] == {}


def test_train_rejects_a_bad_model_before_starting(capsys, monkeypatch):
    # in this process (the command as typed, in its own: the bad-number refusal below)
    err = _refused_in_process(["train", "--heads", "5"], capsys, monkeypatch)
    assert "n_heads=5 does not divide d_model=64" in err


def test_doctor_reports_gloo_working_on_two_ranks(capfd):
    """In this process, its 2-rank launch a real one (CI runs `edu3d doctor` as typed)."""
    from edu3d import cli

    code = cli.main(["doctor"])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert "gloo smoke run on 2 ranks: OK" in out


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["train", "--help"]])
def test_help(args):
    p = _run(args)
    assert p.returncode == 0 and "usage: edu3d" in p.stdout


def test_every_benchmark_entry_point_exists():
    """`edu3d bench NAME` resolves to a real function for every NAME it offers."""
    import importlib

    from edu3d.commands.bench import BENCHMARKS

    assert {"launch", "comm", "dp", "zero", "tp", "pp"} <= set(BENCHMARKS)
    for name, target in BENCHMARKS.items():
        module, _, fn = target.partition(":")
        assert callable(getattr(importlib.import_module(module), fn)), name


# ---- every input checked before any process starts (issue 9) ---------------------------------
def _refused_before_launch(p):
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "launching" not in p.stderr and "Traceback" not in p.stderr


def _refused_in_process(argv, capsys, monkeypatch) -> str:
    """``edu3d.cli.main(argv)`` in this process (a new interpreter per case would only add its
    start-up and torch import): exit code 2, one line, no model built, nothing launched."""
    from edu3d import cli
    from edu3d.launch import api as launch
    from edu3d.train import loop as train

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(train, "GPT", lambda *a, **k: pytest.fail("built the model"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert "launching" not in err and "Traceback" not in err, err
    return err


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
    from edu3d import cli
    from edu3d.launch import api as launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--dp", "2", "--steps", "3", *bad])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("edu3d train: error: argument") and message in err


def test_train_refuses_a_model_that_cannot_fit_before_launching(capsys, monkeypatch):
    err = _refused_in_process(["train", "--model", "gpt2-small", "--layers", "96", "--d-model",
                               "8192", "--heads", "64", "--steps", "1"], capsys, monkeypatch)
    assert "this run cannot fit: 77.74 B parameters" in err


def test_train_describes_the_model_without_building_it(monkeypatch):
    from edu3d.commands.train import parse
    from edu3d.train import loop as train

    def no_model(*_, **__):
        raise AssertionError("the launching process built a model")

    monkeypatch.setattr(train, "GPT", no_model)
    monkeypatch.setattr(train, "_run_parallel", lambda *_: [])
    args = parse(["--model", "medium", "--dp", "2"])
    assert train.run(args) == []


def test_train_ctrl_c_is_one_line_and_exit_130():
    """The command as typed, in its own process, with --dp 2 (the launcher kills the ranks);
    serially, below, in this process."""
    import signal

    # SIGINT's default disposition: a test run in the background inherits it ignored
    p = subprocess.Popen(EDU3D + ["train", "--steps", "100000", "--json", "--dp", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.stdout.readline().startswith('{"step": 1')
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1] == "edu3d train: interrupted"


def test_serial_train_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch):
    """A real SIGINT to this process once the first record is written (a new interpreter
    would only add its start-up): ``edu3d.cli.main`` returns 130 and says one line."""
    import signal

    from edu3d import cli

    class Stdout:  # Ctrl-C as the first record appears
        def write(self, text):
            captured.write(text)
            if text.startswith('{"step": 1'):
                os.kill(os.getpid(), signal.SIGINT)
            return len(text)

        def flush(self):
            captured.flush()

    captured = sys.stdout
    monkeypatch.setattr(sys, "stdout", Stdout())
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = cli.main(["train", "--steps", "100000", "--json"])
    finally:
        signal.signal(signal.SIGINT, previous)
    out, err = capsys.readouterr()
    assert out.startswith('{"step": 1')
    assert code == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1] == "edu3d train: interrupted"


def test_train_timeout_exits_124_and_names_the_option(capfd):
    """Through ``edu3d.cli.main`` in this process (a new interpreter would only add its start-up
    and torch import); its 2-rank launch is a real one, killed at the timeout."""
    from edu3d import cli

    code = cli.main(["train", "--dp", "2", "--steps", "100000", "--timeout", "3"])
    _, err = capfd.readouterr()
    assert code == 124, err
    assert "edu3d train: --timeout 3 s: run did not finish within 3 s" in err
    assert "Traceback" not in err


# ---- help, errors, course --------------------------------------------------------------------
@pytest.mark.parametrize("args,shown", [
    (["train", "--help"], ["peak learning rate (default: 0.003)", "(default: 1f1b)",
                           "--lr-schedule", "--precision", "--grad-accum"]),
    (["run", "--help"], ["(default: 2)"]),
    (["doctor", "--help"], ["(default: 120.0)"]),
    (["course", "--help"], ["(default: 127.0.0.1", "passed to JupyterLab"]),
    (["schedule", "--help"], ["chunks per rank, interleaved only (default: 1)", "examples:"]),
])
def test_help_shows_defaults(args, shown, capsys, monkeypatch):
    """Through ``edu3d.cli.main`` in this process (``train --help`` in a new interpreter
    imports torch first); the commands' help as typed is test_help. 80 columns, as a
    subprocess writing to a pipe gets."""
    from edu3d import cli

    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for text in shown:
        assert text in " ".join(out.split()), text


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

    sub = next(a for a in build_parser("course")._actions if isinstance(a, argparse._SubParsersAction))
    assert all(action.help for action in sub.choices["course"]._actions)


def test_course_serves_the_root_on_loopback_and_passes_jupyter_options_through():
    from edu3d.cli import parse_args
    from edu3d.commands.course import COURSE_ROOT, course_command

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
    from edu3d.bench.harness import progress

    monkeypatch.setenv("RANK", "1")
    progress("repetition 1/5")
    monkeypatch.setenv("RANK", "0")
    progress("repetition 2/5")
    out = capsys.readouterr()
    assert out.out == "" and out.err == "bench: repetition 2/5\n"
