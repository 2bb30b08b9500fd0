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
    code = "import sys, edu3d.cli, edu3d.launch, edu3d.worker; print('torch' in sys.modules)"
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
    assert all(set(r) == {"step", "loss", "grad_norm", "lr", "tokens_per_s"} for r in records)


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
