"""The launcher: results, rank prefixes, and every failure path (nothing may be left running)."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from edu3d.launch.api import LaunchError, LaunchTimeout, RankError, launch
from edu3d.launch.procs import running
from edu3d.config.layout import Layout
from tests import workers


def _pids(run_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in (run_dir / "pids").glob("rank*.pid")]


def _assert_all_gone(run_dir: Path, wait_s: float = 60.0):  # a hang guard: busy machines
    deadline = time.monotonic() + wait_s
    while any(running(p) for p in _pids(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [p for p in _pids(run_dir) if running(p)]
    assert not alive, f"processes left running: {alive}"


def _script(tmp_path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return path


# One world size: 2 and 8 ranks take no other code path here. Cold launches of 2 ranks are
# every other test of this file; of 8, test_launch_hardening's first_rank_to_die[kill-8]. The
# layout given to a function's ranks (--layout) sets their coordinates: dp-major, tp fastest.
def test_function_on_n_ranks_returns_per_rank_results():
    n = 4
    res = launch(workers.rank_info, n, kwargs={"numel": 7}, layout=Layout(dp=2, tp=2),
                 timeout=240, echo=False)
    assert [r["rank"] for r in res.results] == list(range(n))
    assert all(r["world"] == n and r["sum"] == n * (n + 1) / 2 for r in res.results)
    assert [r["coord"] for r in res.results] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert all(r["threads"] == 1 and r["omp"] == "1" and r["traced"] for r in res.results)
    events = [e for e in res.events() if e["op"] == "all_reduce"]
    assert sorted(e["rank"] for e in events) == list(range(n))
    assert all(e["bytes"] == 7 * 4 and e["n"] == n and e["t1"] >= e["t0"] for e in events)
    _assert_all_gone(res.run_dir)


def test_output_is_streamed_with_rank_prefix_and_script_arguments(tmp_path):
    """A script's ranks: output streamed with each line's rank, and the script's own
    arguments in sys.argv (a layout is test_function_on_n_ranks_returns_per_rank_results';
    a script that builds its mesh with runtime.init, test_raising_rank_...)."""
    script = _script(tmp_path, """
        import os, sys
        r = os.environ["RANK"]
        print("out from", r, sys.argv[1:])
        print("err from", r, file=sys.stderr)
    """)
    seen = []
    res = launch(script, 3, args=["--lr", "3"], echo=lambda *line: seen.append(line),
                 timeout=120)
    for r in range(3):
        assert (r, "stdout", f"out from {r} ['--lr', '3']") in seen
        assert (r, "stderr", f"err from {r}") in seen
        assert res.lines(r) == [f"out from {r} ['--lr', '3']"]


def test_raising_rank_is_named_with_traceback_and_nothing_is_left(tmp_path):
    """The partners wait in a barrier with no collective timeout of their own (an hour), so
    only the launcher can end them: a RankError, not the hang guard's LaunchTimeout (240 s,
    for a busy machine), proves it killed them (how soon: ``edu3d bench goals``)."""
    script = _script(tmp_path, """
        import os, time
        import torch.distributed as dist
        from edu3d.distributed import runtime
        mesh = runtime.init()
        if mesh.rank == 3:
            time.sleep(0.5)
            raise RuntimeError("rank three is broken")
        dist.barrier()
    """)
    with pytest.raises(RankError) as info:
        launch(script, 4, echo=False, timeout=240, env={"EDU3D_TIMEOUT": "3600"})
    err = info.value
    assert err.rank == 3
    assert "rank 3 failed: RuntimeError: rank three is broken" in str(err)
    assert 'script.py", line 8' in err.traceback and "worker.py" not in err.traceback
    _assert_all_gone(err.run_dir)


def test_function_failure_names_rank():
    with pytest.raises(RankError, match="rank 1 failed: ValueError: deliberate failure"):
        launch(workers.raise_on, 2, args=(1,), echo=False, timeout=120)


@pytest.mark.parametrize("body,reason", [
    ("os._exit(7)", "exited with code 7"),
    ("os.kill(os.getpid(), signal.SIGKILL)", "killed by signal SIGKILL"),
    ("sys.exit(4)", "exited with code 4"),
])
def test_rank_dying_without_python_error(tmp_path, body, reason):
    script = _script(tmp_path, f"""
        import os, signal, sys, time
        if os.environ["RANK"] == "1":
            {body}
        time.sleep(3600)
    """)
    with pytest.raises(RankError) as info:
        launch(script, 2, echo=False, timeout=240)
    assert info.value.rank == 1 and reason in str(info.value)
    _assert_all_gone(info.value.run_dir)


def test_timeout_kills_every_rank(tmp_path):
    """Ranks that sleep an hour: the launch returning at all proves the kill (how soon after
    the timeout: ``edu3d bench goals``). They import nothing (a function's would each import
    torch first): the same kill."""
    script = _script(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(3600)\n")
    with pytest.raises(LaunchTimeout, match=r"within 8 s; rank\(s\) \[0, 1, 2\]") as info:
        launch(script, 3, echo=False, timeout=8)
    run_dir = Path(str(info.value).rsplit("run folder: ", 1)[1].rstrip(")"))
    _assert_all_gone(run_dir)


def _start_cli_run(tmp_path, n=2):
    script = _script(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    runs = tmp_path / "runs"
    env = {**os.environ, "EDU3D_RUNS": str(runs)}
    proc = subprocess.Popen([sys.executable, "-m", "edu3d.cli", "run", "-n", str(n), str(script)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240  # a hang guard, generous for a busy machine
    while time.monotonic() < deadline:
        dirs = list(runs.glob("*")) if runs.exists() else []
        if dirs and len(_pids(dirs[0])) == n:
            return proc, dirs[0]
        time.sleep(0.1)
    proc.kill()
    pytest.fail("ranks did not start within 240 s")


# Ctrl-C of `edu3d run`: test_launch_hardening's test_interrupted_edu3d_run_is_one_line_and_130
# (exit 130, one line, every rank gone)


def test_launcher_killed_hard_leaves_no_orphans(tmp_path):
    """SIGKILL gives the launcher no chance to clean up: the ranks' watchdogs must."""
    proc, run_dir = _start_cli_run(tmp_path)
    proc.kill()
    proc.wait()
    _assert_all_gone(run_dir, wait_s=120)  # the watchdogs poll; a busy machine is slow


def test_bad_input_fails_before_any_process(tmp_path):
    with pytest.raises(LaunchError, match="nprocs must be a positive integer"):
        launch(workers.rank_info, 0)
    with pytest.raises(LaunchError, match="does not exist"):
        launch(str(tmp_path / "missing.py"), 2)
    with pytest.raises(LaunchError, match="defined in a notebook cell"):
        launch(lambda mesh: None, 2)
    with pytest.raises(ValueError, match="8 ranks, but 4 were launched"):
        launch(workers.rank_info, 4, layout=Layout(dp=2, tp=2, pp=2))
    assert not list(Path(os.environ["EDU3D_RUNS"]).glob("*missing*"))
    assert not list(Path(os.environ["EDU3D_RUNS"]).glob("*lambda*"))


def test_progress_outside_ipython_shows_nothing_and_never_fails(capsys, tmp_path,
                                                                monkeypatch):
    """``launch(progress=True)`` from a plain script: there is no cell to show the status
    line under (IPython's ``display`` would print the object's repr, and its handle is None).
    No IPython shell here, even where an earlier test in this process made one."""
    from edu3d.launch import status as status_module

    monkeypatch.setattr(status_module, "get_ipython", lambda: None)
    status = status_module.NotebookStatus(2, new_pool=True)
    status.running(0.5, 1)
    status.finished(1.0, tmp_path)
    status.failed("failed: rank 1")
    assert capsys.readouterr() == ("", "")
