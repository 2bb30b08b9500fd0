"""The fork server behind warm pools (edu3d.launch.warm.zygote): each pool rank is a fork of one process
that imported torch once; torchrun still starts, watches and stops every rank through its
stub, and nothing outlives a kill of any of the three (stub, rank, zygote)."""

import os
import signal
import time
from pathlib import Path

import pytest

from edu3d.launch.warm import pool
from edu3d.launch.heartbeat import cpu_seconds
from edu3d.launch.api import RankError, launch
from edu3d.launch.procs import running
from tests import workers


@pytest.fixture(autouse=True)
def _no_pools_left():
    pool.shutdown()
    yield
    pool.shutdown()


def _stubs(p: pool.Pool) -> dict[int, int]:
    """{rank: pid} of the stubs torchrun started (children of the agent)."""
    found = {}
    for pid in pool.pool_pids(p.id):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2:].split()[1]) == p.proc.pid:
            rank = [v for v in env if v.startswith(b"RANK=")]
            if rank:
                found[int(rank[0][5:])] = pid
    return found


def _gone(pids, wait_s: float = 60.0) -> bool:  # a hang guard: busy machines
    deadline = time.monotonic() + wait_s
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(running(p) for p in pids)


def test_pool_ranks_are_forks_of_one_zygote_and_import_nothing():
    res = launch(workers.process_info, 4, timeout=120, echo=False, pool=True)
    p = pool.pools()[0]
    assert p.zygote is not None and p.alive()
    info = {r["rank"]: r for r in res.results}
    assert sorted(info) == [0, 1, 2, 3]
    for r in info.values():
        assert r["ppid"] == p.zygote.pid  # forked by the zygote...
        assert r["sid"] == r["pid"]  # ...leading a session of its own, as every edu3d rank
    assert {r: i["pid"] for r, i in info.items()} == {
        r: pid for r, pid in pool.runs.pid_files(res.run_dir).items()}
    stubs = _stubs(p)
    assert sorted(stubs) == [0, 1, 2, 3] and not set(stubs.values()) & {
        i["pid"] for i in info.values()}
    # the zygote paid for torch (its libraries are mapped in it); a rank's own CPU starts at
    # its fork, so it stays under the zygote's, which includes importing torch
    assert "libtorch" in Path(f"/proc/{p.zygote.pid}/maps").read_text()
    zygote_cpu = cpu_seconds(p.zygote.pid)
    assert max(r["cpu"] for r in info.values()) < zygote_cpu / 2, (info, zygote_cpu)
    # the same pool runs the next job (warm), on the same forked processes
    again = launch(workers.process_info, 4, timeout=120, echo=False, pool=True)
    assert [r["pid"] for r in again.results] == [info[r]["pid"] for r in range(4)]


def test_a_rank_and_its_stub_live_and_die_together(tmp_path):
    launch(workers.rank_info, 2, timeout=120, echo=False, pool=True)
    p = pool.pools()[0]
    ranks, stubs = pool.runs.pid_files(p.dir), _stubs(p)
    os.kill(stubs[1], signal.SIGKILL)  # torchrun's process goes: its rank follows
    assert _gone([ranks[1]]), "a rank outlived its stub"
    assert not p.alive()
    again = launch(workers.rank_info, 2, timeout=120, echo=False, pool=True)  # a fresh pool
    assert again.results[1]["sum"] == 3.0 and pool.pools()[0] is not p
    assert _gone(p.pids()) and not pool.pool_pids(p.id)

    # a rank's death by a signal is its stub's: torchrun reports it as such
    script = tmp_path / "term.py"
    script.write_text("import os, signal, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    os.kill(os.getpid(), signal.SIGTERM)\n"
                      "time.sleep(3600)\n")
    with pytest.raises(RankError) as info:
        launch(script, 2, timeout=240, echo=False, pool=True)
    assert info.value.rank == 1 and "SIGTERM" in str(info.value)


def test_torchrun_stopping_a_stub_stops_its_rank():
    launch(workers.rank_info, 2, timeout=120, echo=False, pool=True)
    p = pool.pools()[0]
    ranks, stubs = pool.runs.pid_files(p.dir), _stubs(p)
    os.killpg(stubs[0], signal.SIGTERM)  # what torchrun's shutdown sends each worker
    assert _gone([ranks[0], stubs[0]]), "SIGTERM to the stub did not reach the rank"
    pool.shutdown()
    assert _gone(p.pids()) and not pool.pool_pids(p.id)


def test_killing_the_zygote_ends_every_rank_and_stub():
    launch(workers.rank_info, 4, timeout=120, echo=False, pool=True)
    p = pool.pools()[0]
    ranks, stubs = pool.runs.pid_files(p.dir), _stubs(p)
    os.kill(p.zygote.pid, signal.SIGKILL)
    assert _gone([*ranks.values(), *stubs.values()])
    assert not p.alive()
    again = launch(workers.rank_info, 4, timeout=120, echo=False, pool=True)
    assert [r["sum"] for r in again.results] == [10.0] * 4
    pool.shutdown()
    assert _gone([p.proc.pid]) and not pool.pool_pids(p.id)


def test_fork_off_starts_ranks_the_old_way(monkeypatch):
    monkeypatch.setenv("EDU3D_POOL_FORK", "0")
    res = launch(workers.process_info, 2, timeout=120, echo=False, pool=True)
    p = pool.pools()[0]
    assert p.zygote is None
    assert all(r["ppid"] == p.proc.pid for r in res.results)  # torchrun's own children


def test_a_forked_rank_killed_mid_collective_is_named_not_its_partners(tmp_path):
    """Its partners fail at once with a lost connection; the killed rank leaves no error file.
    The agent records how it died from its stub (torchrun's child, which ends the same way),
    so the report names it, as for a cold rank."""
    script = tmp_path / "kill_in_collective.py"
    script.write_text(
        "import os, signal, time\n"
        "import torch, torch.distributed as dist\n"
        "from edu3d.distributed import runtime\n"
        "mesh = runtime.init()\n"
        "t = torch.ones(4)\n"
        "dist.all_reduce(t)\n"
        "if mesh.rank == 1:\n"
        "    time.sleep(0.5)  # the others are inside the next all_reduce\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.all_reduce(t)\n")
    launch(workers.rank_info, 4, timeout=120, echo=False, pool=True)  # warm first
    with pytest.raises(RankError) as info:
        launch(script, 4, timeout=240, echo=False, pool=True)
    assert info.value.rank == 1 and "killed by signal SIGKILL" in str(info.value)
    record = info.value.run_dir / "exits" / "rank1.json"
    assert record.exists() and '"signal": 9' in record.read_text()


def test_bench_pool_start_measures_both_ways():
    """``edu3d bench launch``'s pool-start row (a shape check, not a timing: benchmarks are
    commands): both pools ran the cell; the forked pool's processes used less CPU, since
    four ranks importing torch cost more than one zygote doing it once."""
    from edu3d.bench.bench_launch import pool_start

    (row,) = pool_start(4, reps=1)
    assert row["name"] == "4-rank pool start" and row["edu3d_s"] > 0 and row["reference_s"] > 0
    assert 0 < row["forked_cpu_s"] < row["imports_cpu_s"], row
    assert not pool.pools()
