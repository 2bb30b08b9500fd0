"""The launcher under a careless or hostile user: sockets, pids, blame, hangs, output, folders."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from edu3d.distributed import trace
from edu3d.launch.api import LaunchError, LaunchTimeout, RankError, kill_run, launch
from edu3d.launch.procs import running
from edu3d.launch.warm import pool
from tests import workers

ROOT = Path(__file__).resolve().parent.parent


def _script(tmp_path, body: str, name="script.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _pids(run_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in (run_dir / "pids").glob("rank*.pid")]


def _assert_all_gone(run_dir: Path, wait_s: float = 60.0):  # a hang guard: busy machines
    deadline = time.monotonic() + wait_s
    pids = _pids(run_dir)
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if running(p)], "processes left running"


# ---- security: no socket of a run outside loopback --------------------------------------------
def _listening(pids) -> list[tuple[int, str]]:
    """(pid, address) of every listening TCP socket owned by ``pids`` (from /proc)."""
    inodes = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except OSError:
            pass
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                out.append((inodes[cols[9]], cols[1]))
    return out


def _loopback(hex_addr: str) -> bool:
    addr = hex_addr.split(":")[0]
    if len(addr) == 8:  # IPv4, little-endian bytes: 127.x.x.x ends in 7F
        return addr.endswith("7F")
    return addr in ("00000000000000000000000001000000",  # ::1
                    ) or (addr.startswith("0000000000000000FFFF0000") and addr.endswith("7F"))


def list_run_sockets(mesh):
    import torch.distributed as dist

    dist.barrier()  # every rank and store is up
    found = []
    if mesh.rank == 0:
        pids = [os.getppid(), *_pids(Path(os.environ["EDU3D_RUN_DIR"]))]
        found = _listening(pids)
    dist.barrier()
    return found


def test_run_listens_only_on_loopback():
    # 2 ranks: the agent's store and each rank's gloo sockets, the same kinds as at any size
    res = launch(list_run_sockets, 2, echo=False, timeout=120)
    sockets = res.results[0]
    assert sockets, "found no listening socket at all: the check itself is broken"
    outside = [s for s in sockets if not _loopback(s[1])]
    assert not outside, f"listening outside loopback: {outside}"


# ---- kill_run signals only the run's own processes --------------------------------------------
def test_kill_run_spares_a_process_that_recycled_a_pid(tmp_path):
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        run_dir = tmp_path / "run"
        (run_dir / "pids").mkdir(parents=True)
        (run_dir / "command.json").write_text(json.dumps({"run_id": "deadbeef"}))
        (run_dir / "pids" / "rank0.pid").write_text(str(stranger.pid))
        agent = subprocess.Popen(["true"], start_new_session=True)
        agent.wait()
        kill_run(agent, run_dir, grace_s=0.5)
        time.sleep(0.2)
        assert stranger.poll() is None, "kill_run killed a process that is not the run's"
    finally:
        stranger.kill()
        stranger.wait()


# ---- the first rank to die is the one named ---------------------------------------------------
DEATHS = {
    "exit": ("os._exit(3)", "exited with code 3"),
    "segfault": ("import ctypes; ctypes.string_at(0)", "killed by signal SIGSEGV"),
    "kill": ("os.kill(os.getpid(), signal.SIGKILL)", "killed by signal SIGKILL"),
}


def dying_script(tmp_path, how: str, victim: int) -> Path:
    # three traced all-reduces first: what the victim's trace must keep (see the test)
    return _script(tmp_path, f"""
        import os, signal, time
        import torch, torch.distributed as dist
        from edu3d.distributed import comm, runtime
        mesh = runtime.init()
        for step in range(3):
            comm.all_reduce(torch.ones(4))
        dist.barrier()
        if mesh.rank == {victim}:
            time.sleep(0.3)
            {DEATHS[how][0]}
        dist.all_reduce(torch.ones(4))
        time.sleep(60)
    """)


def _blamed(tmp_path, how: str, n: int, victim: int) -> RankError:
    with pytest.raises(RankError) as info:
        launch(dying_script(tmp_path, how, victim), n, echo=False, timeout=240,
               env={"EDU3D_TIMEOUT": "60"})
    return info.value


def test_a_death_torchrun_reaped_first_is_still_recorded():
    """The agent's thread waits for each rank with waitid(WNOWAIT); torchrun's monitor reaps
    (Popen.poll) and on a loaded machine can do it before that thread looks, which then gets
    ECHILD. The death is then read from torchrun's Popen, so the rank that died first is
    still the one named (CI once named its partner's lost connection instead)."""
    from edu3d.launch import agent as launcher

    exited = subprocess.Popen([sys.executable, "-c", "import os; os._exit(3)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    for proc in (exited, killed):
        proc.wait()  # reaped, as torchrun's poll() does, before _exit_of looks
        launcher._POPENS[proc.pid] = proc
    try:
        assert launcher._exit_of(exited.pid) == {"code": 3}
        assert launcher._exit_of(killed.pid) == {"signal": signal.SIGKILL}
    finally:
        for proc in (exited, killed):
            launcher._POPENS.pop(proc.pid, None)
    assert launcher._exit_of(os.getppid(), wait_s=0.1) is None  # not a child of this process


# every death at 4 ranks or more, SIGKILL at 8 only (about 9 s on an idle 2-core machine,
# twice that under load): 8 ranks are 4 with more partners racing to fail after the victim, so
# kill at 4 proved nothing kill at 8 does not. More ranks only widen the race between the
# agent's thread and torchrun's reaping, which test_a_death_torchrun_reaped_first_is_still_recorded
# forces deterministically
@pytest.mark.parametrize("how,n", [("exit", 4), ("segfault", 4), ("kill", 8)])
def test_first_rank_to_die_is_named_with_how_it_died(tmp_path, how, n):
    victim = n - 2
    err = _blamed(tmp_path, how, n, victim)
    assert err.rank == victim, f"named rank {err.rank}, not {victim}: {str(err)[:300]}"
    assert f"rank {victim} failed: {DEATHS[how][1]}" in str(err)
    # the trace is written as it happens: even a rank killed without warning kept its events
    events = trace.load(err.run_dir)
    assert sum(1 for e in events if e["rank"] == victim and e["op"] == "all_reduce") == 3
    _assert_all_gone(err.run_dir)


# ---- a hang says what every rank was doing ----------------------------------------------------
def mismatched_collectives(mesh):
    import torch

    from edu3d.distributed import comm

    t = torch.ones(4)
    with trace.current().context(step=3):
        comm.all_reduce(t)  # every rank: step 3 starts in step
        if mesh.rank == 0:
            comm.all_reduce(t)
        else:
            comm.broadcast(t, src=1)


def test_hang_report_names_every_ranks_operation():
    """Named by the 4 s collective timeout and its heartbeat, not by the launch's own
    timeout (a hang guard of 240 s, for a busy machine; how soon: ``edu3d bench goals``)."""
    with pytest.raises(LaunchError) as info:
        launch(mismatched_collectives, 2, echo=False, timeout=240, env={"EDU3D_TIMEOUT": "4"})
    text = str(info.value)
    assert not isinstance(info.value, LaunchTimeout), text
    assert "rank 0 " in text and "all_reduce(world) at step 3" in text, text
    assert "rank 1 waits in broadcast(world) at step 3" in text or \
        "rank 1 failed in broadcast(world) at step 3" in text, text


def test_launcher_timeout_reports_flight(tmp_path):
    """The ranks must be in their hang when the 30 s timeout fires, so they start on a warm
    pool (torch imported before the clock starts): on a busy machine, two ranks importing
    torch cold took most of the 20 s this test once gave them."""
    launch(workers.rank_info, 2, echo=False, timeout=240, pool=True)  # the pool, warm
    try:
        with pytest.raises(LaunchTimeout) as info:
            launch(mismatched_collectives, 2, echo=False, timeout=30, pool=True,
                   env={"EDU3D_TIMEOUT": "300"})
    finally:
        pool.shutdown()
    text = str(info.value)
    assert "rank 0 waits in all_reduce(world) at step 3" in text, text
    assert "rank 1 waits in broadcast(world) at step 3" in text, text


def test_no_rank_to_blame_is_said_without_rank_minus_one(tmp_path):
    """torchrun failing before any rank did (a rendezvous, a port) was "rank -1 failed"; it is
    a LaunchError with torchrun's last lines. Forged error and exit records (no type, no
    rank, another rank's, a list) blame nobody."""
    from edu3d.launch import procs

    for name, data in (("errors/rank0.json", '{"rank": 0, "message": "x", "time_ns": 1}'),
                       ("errors/rank1.json", '{"rank": 0, "type": "E", "message": "x", '
                                             '"time_ns": 1}'),
                       ("exits/rank2.json", '[{"rank": 2, "signal": 9}]'),
                       ("exits/rank3.json", '{"rank": 3, "time_ns": "now", "signal": 9}')):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(data)
    assert procs.first_failure(tmp_path, settle_s=0.0) is None
    err = procs.rank_error(tmp_path, 2, None, [(None, "stderr", "RendezvousConnectionError: x")])
    assert not isinstance(err, RankError) and "rank -1" not in str(err)
    assert str(err).startswith("torchrun exited with an error and no rank reported one")
    assert "RendezvousConnectionError: x" in str(err)


# ---- output as under torchrun -----------------------------------------------------------------
def test_fd_writes_progress_bars_and_a_real_stdout(tmp_path):
    script = _script(tmp_path, """
        import os, sys
        os.write(1, b"straight to fd 1\\n")
        os.write(2, b"straight to fd 2\\n")
        sys.stdout.write("0%\\r50%\\r100%\\n")
        sys.stdout.reconfigure(line_buffering=True)
        print(sys.stdout.encoding, hasattr(sys.stdout.buffer, "write"))
        sys.stdout.buffer.write(b"bytes\\n")
        sys.stdout.write("no newline at the end")
    """)
    seen = []
    launch(script, 2, echo=lambda *line: seen.append(line), timeout=120)
    for r in range(2):
        assert (r, "stdout", "straight to fd 1") in seen
        assert (r, "stderr", "straight to fd 2") in seen
        assert [(r, "stdout", p) for p in ("0%", "50%", "100%")] == \
            [x for x in seen if x[0] == r and x[2].endswith("%")]
        assert (r, "stdout", "utf-8 True") in seen
        assert (r, "stdout", "bytes") in seen
        assert (r, "stdout", "no newline at the end") in seen


# ---- the trace is written as it happens -------------------------------------------------------
def test_recorder_writes_each_event_at_once(tmp_path):
    path = trace.rank_file(tmp_path, 0)
    rec = trace.Recorder(0, path)
    for i in range(1000):
        with rec.span("compute", "F", mb=i):
            pass
    assert rec.events == []  # nothing held in memory
    assert len(path.read_text().splitlines()) == 1000  # before any flush


# a killed run keeps its trace: test_first_rank_to_die_is_named_with_how_it_died (every death,
# SIGKILL and SIGSEGV included, keeps the victim's three all-reduces)


# ---- run folders ------------------------------------------------------------------------------
def test_reused_run_folder_ignores_the_old_error(tmp_path):
    run_dir = tmp_path / "reused"
    (run_dir / "errors").mkdir(parents=True)
    (run_dir / "errors" / "rank0.json").write_text(json.dumps(
        {"rank": 0, "type": "RuntimeError", "message": "old failure", "traceback": "",
         "time_ns": 1}))
    script = _script(tmp_path, "import time; time.sleep(1)\nprint('fine')\n")
    res = launch(script, 2, run_dir=run_dir, echo=False, timeout=120)
    assert res.lines(0) == ["fine"]


def test_only_the_newest_run_folders_are_kept(tmp_path, monkeypatch):
    from edu3d.launch import runs

    monkeypatch.setenv("EDU3D_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("EDU3D_KEEP_RUNS", "3")
    made = []
    for i in range(5):
        d = runs.new_run_dir(f"r{i}")
        (d / "command.json").write_text("{}")
        os.utime(d / "command.json", (1000 + i, 1000 + i))
        made.append(d)
    assert sorted(runs.list_runs()) == sorted(made[2:])


def _cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "edu3d.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def test_bad_runs_folder_is_one_clear_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    script = _script(tmp_path, "print('never')\n")
    out = _cli("run", "-n", "2", str(script), env={"EDU3D_RUNS": str(blocker / "runs")})
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and str(blocker) in out.stderr
    assert "EDU3D_RUNS" in out.stderr and len(out.stderr.strip().splitlines()) == 1


# `edu3d run` prints its run folder: test_cli's test_run_prefixes_output_and_exits_zero (the
# same launch)


# ---- Ctrl-C: one line -------------------------------------------------------------------------
def test_interrupted_cell_shows_one_line(monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    from edu3d.launch import magic

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(magic, "launch", interrupted)
    shell = InteractiveShell.instance()
    magic.register(shell)
    err = magic.Interrupted(2)
    assert err._render_traceback_() == ["interrupted: all 2 ranks were killed"]
    result = shell.run_cell("%%torchrun -n 2\nprint(1)\n")
    assert isinstance(result.error_in_exec, magic.Interrupted)


def test_runs_list_and_clean(tmp_path):
    from edu3d.launch import runs

    base = tmp_path / "runs"
    for i in range(3):  # folders edu3d made carry its marker (tests/test_launch_safety.py)
        (base / f"run{i}").mkdir(parents=True)
        (base / f"run{i}" / runs.MARKER).write_text("")
        (base / f"run{i}" / "command.json").write_text("{}")
        os.utime(base / f"run{i}" / "command.json", (1000 + i, 1000 + i))
    env = {"EDU3D_RUNS": str(base)}
    listed = _cli("runs", "list", env=env)
    assert listed.returncode == 0 and "3 run folder(s)" in listed.stdout
    assert _cli("runs", "clean", "--keep", "1", env=env).returncode == 0
    assert [p.name for p in base.iterdir()] == ["run2"]


def test_interrupted_edu3d_run_is_one_line_and_130(tmp_path):
    script = _script(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    runs_dir = tmp_path / "runs"
    # SIGINT's default disposition, as in a terminal: a test run in the background (started
    # with `&` by a shell without job control) inherits it ignored, and the SIGINT did nothing
    proc = subprocess.Popen([sys.executable, "-m", "edu3d.cli", "run", "-n", "2", str(script)],
                            env={**os.environ, "EDU3D_RUNS": str(runs_dir)}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240  # a hang guard, generous for a busy machine
    while time.monotonic() < deadline:
        dirs = list(runs_dir.glob("*")) if runs_dir.exists() else []
        if dirs and len(_pids(dirs[0])) == 2:
            break
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the ranks of edu3d run did not start within 240 s")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("edu3d run:")] == \
        ["edu3d run: interrupted; every rank was killed"]
    _assert_all_gone(dirs[0])
