"""The launcher's safety (issue 29): a warm pool whose fork server dies says so, state files
are written atomically, only a trusted runs folder is used, ``edu3d runs clean`` removes only
what edu3d made, and short DP/ZeRO runs on gloo end without an abort at process exit."""

import os
from pathlib import Path

import pytest

from edu3d.launch import runs
from edu3d.launch.api import LaunchError, LaunchTimeout, RankError, launch
from edu3d.launch.warm import pool
from tests import workers_launch_safety as work


@pytest.fixture(autouse=True)
def _no_pools_left():
    pool.shutdown()
    yield
    pool.shutdown()


# ---- a warm pool's fork server killed mid-job ------------------------------------------------
def test_a_fork_server_killed_mid_job_is_named_and_the_next_launch_recovers(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("EDU3D_RUNS", str(tmp_path / "runs"))
    launch(work.world_sum, 2, timeout=120, echo=False, pool=True)  # warm
    p = pool.pools()[0]
    assert p.zygote is not None
    with pytest.raises(LaunchError) as info:  # its ranks sleep an hour: only this ends them
        launch(work.kill_the_fork_server, 2, timeout=240, echo=False, pool=True)
    text = str(info.value)
    assert not isinstance(info.value, (RankError, LaunchTimeout)), text  # named, at once
    assert "the warm pool's fork server died (killed by signal SIGKILL)" in text, text
    assert not p.alive() and p not in pool.pools()
    again = launch(work.world_sum, 2, timeout=120, echo=False, pool=True)
    assert again.results == [3.0, 3.0]


# ---- the runs folder: trusted, and only edu3d's folders are cleaned ----------------------------
def _cli(*args, env=None):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", "edu3d.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=root, env={**os.environ, **(env or {})})


def test_runs_clean_removes_only_folders_edu3d_made(tmp_path, monkeypatch):
    base = tmp_path / "runs"
    monkeypatch.setenv("EDU3D_RUNS", str(base))
    made = [runs.new_run_dir(f"r{i}") for i in range(2)]
    for d in made:
        assert (d / runs.MARKER).is_file()
    mine = base / "my-project"  # the user's own folder that happens to hold a command.json
    mine.mkdir()
    (mine / "command.json").write_text("{}")
    (mine / "notes.txt").write_text("keep me")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / runs.MARKER).write_text("")
    (base / "link").symlink_to(outside)  # a link to a marked folder is no run folder
    assert runs.list_runs() == sorted(made, key=lambda d: (d / runs.MARKER).stat().st_mtime)
    out = _cli("runs", "clean", env={"EDU3D_RUNS": str(base)})
    assert out.returncode == 0, out.stderr
    assert "removed 2 run folder(s)" in out.stdout and "left alone 2 folder(s)" in out.stdout
    assert sorted(p.name for p in base.iterdir()) == ["link", "my-project"]
    assert (mine / "notes.txt").read_text() == "keep me" and outside.is_dir()
    # a reused folder of the user's is a run folder for that launch, never marked as edu3d's
    res = launch(work.world_sum, 2, run_dir=mine, timeout=120, echo=False, pool=False)
    assert res.results == [3.0, 3.0] and not (mine / runs.MARKER).exists()


def test_a_runs_folder_others_can_write_is_refused_in_one_line(tmp_path, monkeypatch):
    base = tmp_path / "shared"
    base.mkdir()
    base.chmod(0o777)
    monkeypatch.setenv("EDU3D_RUNS", str(base))
    with pytest.raises(LaunchError, match=r"writable by every user \(mode 777, no sticky bit\)"):
        launch(work.world_sum, 2, timeout=60, echo=False, pool=False)
    assert not list(base.iterdir())  # refused before any folder or process
    out = _cli("run", "-n", "2", "-m", "json.tool", env={"EDU3D_RUNS": str(base)})
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "chmod o-w" in out.stderr and "Traceback" not in out.stderr
    assert _cli("runs", "clean", env={"EDU3D_RUNS": str(base)}).returncode == 2
    base.chmod(0o1777)  # the sticky bit (as /tmp): others cannot touch what is not theirs
    runs.new_run_dir("ok")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_runs_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    base = tmp_path / "theirs"
    base.mkdir()
    os.chown(base, 65534, 65534)
    monkeypatch.setenv("EDU3D_RUNS", str(base))
    with pytest.raises(runs.RunsError, match="belongs to user id 65534, not to you"):
        runs.new_run_dir("x")


# ---- state files are written atomically ---------------------------------------------------------
def test_write_atomic_syncs_renames_and_leaves_no_temporary(tmp_path, monkeypatch):
    from edu3d.launch import worker

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    target = tmp_path / "command.json"
    worker.write_atomic(target, '{"a": 1}')
    assert target.read_text() == '{"a": 1}' and synced
    assert os.listdir(tmp_path) == ["command.json"]

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        worker.write_atomic(target, '{"a": 2}')
    assert target.read_text() == '{"a": 1}' and os.listdir(tmp_path) == ["command.json"]


def test_the_launchers_state_files_go_through_write_atomic(tmp_path, monkeypatch):
    """command.json, call-args.pkl (cold), env.json, command.json, current (warm): each is
    written by write_atomic, so a reader never sees half of one."""
    from edu3d.launch import api
    from edu3d.launch import worker

    monkeypatch.setenv("EDU3D_RUNS", str(tmp_path / "runs"))
    written = []
    real = worker.write_atomic

    def spy(path, data):
        written.append(Path(path).name)
        real(path, data)

    for module in (api, pool):
        monkeypatch.setattr(module, "write_atomic", spy)
    launch(work.dp_and_zero_steps, 2, args=(1,), timeout=120, echo=False, pool=False)
    assert {"command.json", "call-args.pkl"} <= set(written), written
    written.clear()
    launch(work.world_sum, 2, timeout=120, echo=False, pool=True)
    assert {"env.json", "command.json", "current"} <= set(written), written


def test_the_recorders_files_are_where_the_run_folders_rules_say(tmp_path):
    """edu3d.distributed.trace writes the flight and trace files from below the launcher's
    floor, so it spells their names itself: they must be edu3d.launch.run_files' names."""
    from edu3d.distributed import trace
    from edu3d.launch import run_files

    assert trace.flight_file(tmp_path, 3) == run_files.path(tmp_path, "flight", 3)
    assert trace.rank_file(tmp_path, 3) == tmp_path / run_files.TRACE_FILE.format(3)


def test_a_ranks_file_counts_under_its_own_name_only(tmp_path):
    from edu3d.launch import run_files

    for name in ("rank0", "rank12", "rank03", "rankx", "rank-1", ".rank4.1.2.tmp"):
        (tmp_path / "done").mkdir(exist_ok=True)
        (tmp_path / "done" / name).write_text("")
    assert run_files.ranks(tmp_path, "done") == {0, 12}
    run_files.write_atomic(run_files.path(tmp_path, "pids", 5), "123")
    assert run_files.pid_files(tmp_path) == {5: 123}


# ---- no abort at process exit ---------------------------------------------------------------------
def test_short_dp_and_zero_runs_end_without_an_abort(tmp_path):
    """Five 2-rank DP + ZeRO-1 runs on gloo whose ranks end as a user's own script does (the
    interpreter's teardown, no ``os._exit``): every rank exits 0, none prints "terminate
    called", and when the teardown begins the process group is gone (edu3d's exit hook left
    it and collected what held its groups, so no gloo thread works into the teardown)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "tests.workers_launch_safety", "5",
                          str(tmp_path)], capture_output=True, text=True, timeout=600,
                         cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1",
                                        "GLOO_SOCKET_IFNAME": runtime_ifname()})
    assert out.returncode == 0, out.stderr[-3000:]
    codes = [line.split() for line in out.stdout.splitlines()]
    assert len(codes) == 10 and all(c[2] == "0" for c in codes), out.stdout
    for err in sorted(tmp_path.glob("r*.err")):
        text = err.read_text()
        assert "terminate called" not in text, (err.name, text[-2000:])
        assert "at teardown: initialized=False" in text, (err.name, text[-2000:])
    # and through the launcher (its ranks end with os._exit): no abort text, every result back
    for _ in range(3):
        res = launch(work.dp_and_zero_steps, 2, timeout=120, echo=False, pool=False)
        assert not any("terminate called" in line for _, _, line in res.output)
        assert res.results[0] == res.results[1]


def runtime_ifname() -> str:
    from edu3d.distributed.runtime import loopback_ifname

    return loopback_ifname()
