"""Failures and recovery: a hang is named within the heartbeat, a dead or hung rank is
restarted from the last complete checkpoint with the very same records, and a process killed
in the middle of writing a checkpoint never leaves a folder that loads as complete."""

import io
import json
import os
import signal
import time
from pathlib import Path

import pytest

from edu3d.ckpt import format as checkpoint
from edu3d.launch import heartbeat, runs
from edu3d.commands.train import main as train_main
from edu3d.train import loop as train
from edu3d.launch.api import RankHung, launch
from edu3d.config.sections import Run
from tests import workers_failures

KEYS = ("step", "loss", "grad_norm", "lr")


def _survivors(runs_root: Path) -> list[int]:
    """Pids of every process (rank, torchrun agent) of any run under ``runs_root``."""
    ids = {runs.run_id(d) for d in runs.list_runs(runs_root)} - {None}
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if any(runs.belongs_to(int(pid), rid) for rid in ids):
            alive.append(int(pid))
    return alive


def _assert_nothing_left(runs_root: Path, wait_s: float = 60.0) -> None:  # busy machines
    deadline = time.monotonic() + wait_s
    while _survivors(runs_root) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _survivors(runs_root), "a process of the run survived"


def _same(records, reference):
    return [{k: r[k] for k in KEYS} for r in records] == \
        [{k: r[k] for k in KEYS} for r in reference]


# ---- the heartbeat -----------------------------------------------------------------------------
def test_a_long_step_is_no_hang_and_a_hang_is_named_within_the_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setenv("EDU3D_RUNS", str(tmp_path))
    beat, hung_at = 1.5, {}

    def echo(rank, stream, line):
        if line.startswith("hanging at"):
            hung_at["t"] = float(line.split()[-1])

    # rank 1 computes for 2.5 heartbeats at step 2 (others wait): a long step, not a hang;
    # at step 4 it stops for good. Named by the heartbeat, so before the 60 s collective
    # timeout (which would end the run as a RankError, not RankHung) and the launch's hang
    # guard (240 s, LaunchTimeout); how soon after the hang began: edu3d bench goals
    with pytest.raises(RankHung) as info:
        launch(workers_failures.slow_then_hang, 3, args=(1, 2, 2.5 * beat, 4), heartbeat=beat,
               echo=echo, timeout=240, env={"EDU3D_TIMEOUT": "60"})
    detected = time.time() - hung_at["t"]
    err = info.value
    text = str(err)
    assert err.rank == 1 and err.ranks == [1], text
    assert "rank 1 failed: hung: no progress for" in text and "outside any collective" in text
    assert "rank 0 waits in all_reduce(world) at step 4" in text, text
    assert "rank 2 waits in all_reduce(world) at step 4" in text, text
    assert "in slow_then_hang" in err.traceback, err.traceback  # its own Python stack
    # never before a heartbeat without progress, on the watcher's own clock
    idle = float(text.split("no progress for ")[1].split(" s")[0])
    assert idle >= beat, text
    print(f"hang detected {detected:.2f} s after it began (heartbeat {beat} s)")
    _assert_nothing_left(tmp_path)


def test_a_rank_starved_of_cpu_is_busy_not_hung():
    """20 busy loops on one core: each gets less than CPU_BUSY of it, so by its CPU time
    alone it would look stalled (the heartbeat named such ranks hung at load 25), yet it is
    ready to run all the time, and its demand counts that; a sleeping process has neither."""
    import subprocess
    import sys

    from edu3d.launch import heartbeat

    core = min(os.sched_getaffinity(0))
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(20)]
    procs.append(subprocess.Popen(["sleep", "60"]))
    try:
        time.sleep(1.0)  # every loop started and pinned
        spinner, sleeper = procs[0].pid, procs[-1].pid
        before = [f(pid) for pid in (spinner, sleeper)
                  for f in (heartbeat.cpu_seconds, heartbeat.demand_seconds)]
        t0 = time.monotonic()
        time.sleep(1.5)
        after = [f(pid) for pid in (spinner, sleeper)
                 for f in (heartbeat.cpu_seconds, heartbeat.demand_seconds)]
        dt = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    cpu, demand, sleeper_cpu, sleeper_demand = (a - b for a, b in zip(after, before))
    assert cpu < heartbeat.CPU_BUSY * dt, f"the loop got {cpu / dt:.0%} of a core: not starved"
    assert demand > 0.8 * dt, f"demand {demand:.2f} s in {dt:.2f} s"
    assert sleeper_cpu + sleeper_demand < heartbeat.CPU_BUSY * dt


def test_heartbeat_must_be_shorter_than_the_collective_timeout():
    from edu3d.launch.api import LaunchError

    with pytest.raises(LaunchError, match="shorter than the collective timeout 10 s"):
        launch(workers_failures.slow_then_hang, 2, heartbeat=10, env={"EDU3D_TIMEOUT": "10"})


def test_a_stopped_rank_is_named_as_stopped_not_a_deadlock(tmp_path, monkeypatch):
    """``kill -STOP`` on rank 1 of three that all-reduce in a loop: wherever its flight record
    says it is (often inside the all-reduce, where the others wait too: once read as a
    deadlock blaming rank 0), it stopped beating, and it alone is named, within the heartbeat."""
    monkeypatch.setenv("EDU3D_RUNS", str(tmp_path))
    run_dir, beat, stopped = tmp_path / "stopped", 3.0, {}

    def stop_rank_1(elapsed, done):
        pid = runs.pid_files(run_dir).get(1)
        if not stopped and pid and (run_dir / "flight" / "rank1.json").exists():
            os.kill(pid, signal.SIGSTOP)
            stopped["t"] = time.monotonic()

    with pytest.raises(RankHung) as info:
        launch(workers_failures.all_reduce_for_ever, 3, run_dir=run_dir, heartbeat=beat,
               on_poll=stop_rank_1, echo=False, timeout=120, env={"EDU3D_TIMEOUT": "60"})
    named = time.monotonic() - stopped["t"]
    text = str(info.value)
    assert info.value.rank == 1 and info.value.ranks == [1], text
    assert "its flight record stopped beating: the process is stopped by a signal" in text, text
    assert "deadlock" not in text and info.value.traceback == ""  # a stopped rank cannot answer
    print(f"stopped rank named {named:.2f} s after kill -STOP (heartbeat {beat} s)")
    _assert_nothing_left(tmp_path)


# ---- the heartbeat's rules on a folder of records written by hand ------------------------------
def _note(run_dir: Path, rank: int, beat: float, n: int = 1, **fields) -> None:
    rec = {"n": n, "state": "in", "op": "all_reduce", "lane": "comm", "group": "world",
           "step": 3, "t": 1.0, "beat": beat, **fields}
    (run_dir / "flight").mkdir(parents=True, exist_ok=True)
    (run_dir / "flight" / f"rank{rank}.json").write_text(json.dumps(rec))


def test_the_rank_that_stopped_beating_is_named_before_any_deadlock(tmp_path):
    watch = heartbeat.Watch(tmp_path, 3, seconds=4.0)
    for now in (0.0, 1.0, 1.5, 2.5):  # all in all_reduce; ranks 0 and 2 beat, rank 1 not after 0
        for r in (0, 1, 2):
            if r != 1 or now == 0.0:
                _note(tmp_path, r, beat=now)
        hung = watch.check(now)
    assert hung is not None and hung["ranks"] == [1], hung
    assert "stopped beating" in hung["message"] and "deadlock" not in hung["message"]


def test_a_node_watches_its_own_ranks_and_waits_longer_before_a_deadlock(tmp_path):
    """Node 1 of two runs ranks 2 and 3 (its pid files say so); both beat and wait in a
    collective. One node would call it a deadlock after the heartbeat; with several, another
    node may be naming its own rank meanwhile, so it waits ``deadlock_s``."""
    (tmp_path / "pids").mkdir()
    for r in (2, 3):
        (tmp_path / "pids" / f"rank{r}.pid").write_text("999999999")  # no such process
    alone = heartbeat.Watch(tmp_path, 2, 4.0)
    nodes = heartbeat.Watch(tmp_path, 2, 4.0, heartbeat.deadlock_seconds(4.0, 2, {}))
    assert nodes.deadlock_s == (4.0 + 60.0) / 2
    verdicts = {}
    for now in (0.0, 5.0, 33.0):
        for r in (2, 3):
            _note(tmp_path, r, beat=now)
        verdicts[now] = (alone.check(now), nodes.check(now))
    assert verdicts[0.0] == (None, None)
    assert verdicts[5.0][0]["rank"] == 2 and "deadlock" in verdicts[5.0][0]["message"]
    assert verdicts[5.0][1] is None and verdicts[33.0][1]["rank"] == 2
    assert "rank 0" not in verdicts[5.0][0]["message"]  # ranks 0 and 1 live on the other node


def test_what_another_process_writes_into_flight_records_is_no_record(tmp_path):
    """A list, a record with no operation, nesting too deep, a FIFO: the heartbeat reads no
    record there and goes on (a list once ended the run with a traceback)."""
    watch = heartbeat.Watch(tmp_path, 4, 4.0)
    _note(tmp_path, 0, beat=0.0)
    flight = tmp_path / "flight"
    (flight / "rank1.json").write_text("[1, 2, 3]")
    (flight / "rank2.json").write_text(json.dumps({"state": "in", "step": "x", "n": [1]}))
    (flight / "rank3.json").write_text("[" * 100_000)
    assert watch.check(0.0) is None
    os.unlink(flight / "rank3.json")
    os.mkfifo(flight / "rank3.json")  # would block a plain read for ever
    assert watch.check(1.0) is None
    assert [runs.read_flight(tmp_path, r) for r in (1, 2, 3)] == [None, None, None]
    _note(tmp_path, 1, beat=time.time() - 30)
    assert "rank 1 waits in all_reduce(world) at step 3 (silent for 3" in \
        runs.flight_report(tmp_path, 2)  # what a timeout reports


# ---- restarts: exit, kill, hang ----------------------------------------------------------------
def _train_args(tmp_path, **kw):
    base = dict(dp=2, zero=1, layers=2, steps=4, json=True, timeout=180.0)
    return Run.of(**{**base, **kw})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return train.run(_train_args(tmp_path_factory.mktemp("ref")), out=io.StringIO())


# kind=exit takes the same restart path as kill (a RankError); the launcher's report of a
# Python error is tests/test_launch.py's. A death without a Python error, and a hang, here.
@pytest.mark.parametrize("kind", ["kill", "hang"])
def test_max_restarts_recovers_with_the_same_records(tmp_path, monkeypatch, capfd, kind,
                                                     uninterrupted):
    monkeypatch.setenv("EDU3D_RUNS", str(tmp_path / "runs"))
    ckpt = tmp_path / "ckpt"
    args = _train_args(tmp_path, ckpt_dir=str(ckpt), save_every=2, max_restarts=1,
                       inject_fault={"rank": 1, "step": 3, "kind": kind}, heartbeat=2.0)
    records = train.run(args, out=io.StringIO())
    err = capfd.readouterr().err
    assert "restart 1 of 1: every rank starts again from the checkpoint of step 2" in err, err
    said = {"exit": "InjectedFault", "kill": "killed by signal SIGKILL",
            "hang": "hung: no progress for"}[kind]
    assert f"rank 1 failed: {said}" in err, err
    assert checkpoint.steps(ckpt) == [2, 4]
    assert _same(records, uninterrupted), (records, uninterrupted)
    _assert_nothing_left(tmp_path / "runs")


def test_json_shows_each_step_once_across_a_restart(tmp_path, monkeypatch, capfd, uninterrupted):
    """The checkpoint is of step 2 and rank 0 printed step 3 before rank 1 hung at step 4:
    the restart replays step 3, and ``--json``'s reader still sees steps 1..4 once each, with
    the values of the uninterrupted run."""
    monkeypatch.setenv("EDU3D_RUNS", str(tmp_path / "runs"))
    out = io.StringIO()
    args = _train_args(tmp_path, ckpt_dir=str(tmp_path / "ckpt"), save_every=2, max_restarts=1,
                       inject_fault={"rank": 1, "step": 4, "kind": "hang"}, heartbeat=2.0)
    records = train.run(args, out=out)
    err = capfd.readouterr().err
    assert "restart 1 of 1: every rank starts again from the checkpoint of step 2" in err, err
    printed = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["step"] for r in printed] == [1, 2, 3, 4], out.getvalue()
    assert _same(printed, uninterrupted) and _same(records, uninterrupted)
    assert "replayed" not in err  # the replayed step 3 equals the one printed


# ---- a kill in the middle of writing a checkpoint ----------------------------------------------
@pytest.fixture(scope="module")
def serial_reference(tmp_path_factory):
    return train.run(Run.of(layers=2, steps=3, json=True), out=io.StringIO())


def _train_killed_during_save(point: str, step: int, opts: list[str]) -> int:
    """``edu3d train opts`` (serial) in a forked copy of this process, which SIGKILLs itself
    at ``point`` of the save of ``step`` (as ``python -m tests.workers_failures`` does, less
    a new interpreter's start-up and torch import); its wait status."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest, whatever happens
        try:
            workers_failures.kill_during_save(point, step)
            train_main(opts)
        except BaseException:
            import traceback

            traceback.print_exc()  # shown in the test's captured stderr
        finally:
            os._exit(1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the training process was not killed at {point} within 120 s")


@pytest.mark.parametrize("point", workers_failures.POINTS)
def test_a_save_killed_midway_is_never_loaded(tmp_path, point, serial_reference):
    ckpt = tmp_path / "ckpt"
    opts = ["--layers", "2", "--steps", "3", "--json", "--ckpt-dir", str(ckpt), "--save-every", "1"]
    status = _train_killed_during_save(point, 2, opts)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status  # mid-save
    folder = checkpoint.step_dir(ckpt, 2)
    assert folder.is_dir() and not (folder / checkpoint.MANIFEST).exists(), \
        sorted(p.name for p in folder.iterdir())
    assert checkpoint.latest_step(ckpt) == 1  # the half-written step 2 is no checkpoint
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint of step 2"):
        checkpoint.read_manifest(ckpt, 2)
    # the run resumes from step 1 and ends as if nothing had happened
    args = Run.of(layers=2, steps=3, json=True, ckpt_dir=str(ckpt), save_every=1, resume=True)
    records = train.run(args, out=io.StringIO())
    assert _same(records, serial_reference)
    assert checkpoint.steps(ckpt) == [1, 2, 3]
    assert json.loads((folder / checkpoint.MANIFEST).read_text())["step"] == 2
