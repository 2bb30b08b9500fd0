"""Warm rank pools (edu3d.launch.warm.pool): a warm job gives what a cold run gives, in its own run folder;
every failure raises the cold path's error and kills the whole pool; the pool dies with the
kernel (shutdown, restart, SIGKILL)."""

import json
import os
import signal
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from edu3d.launch.warm import pool
from edu3d.launch.api import LaunchTimeout, RankError, launch
from edu3d.launch.procs import running
from tests import workers

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import os, sys
from edu3d.distributed import runtime
mesh = runtime.init()
r = mesh.rank
print("out from", r)
print("err from", r, file=sys.stderr)
sys.stdout.write("partial " + str(r))  # no newline: still one whole line, before the marker
runtime.shutdown(mesh)
"""


def _script(tmp_path, body: str, name: str = "script.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _wait_gone(pids, wait_s: float = 60.0) -> list[int]:  # a hang guard: busy machines
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if running(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if running(p)]


def _no_process_of(pool_id: str, wait_s: float = 60.0) -> bool:
    """True once no process carries ``EDU3D_POOL_ID=pool_id`` (the agent and every rank)."""
    deadline = time.monotonic() + wait_s
    while pool.pool_pids(pool_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not pool.pool_pids(pool_id)


def _pool_of(res) -> str | None:
    return json.loads((res.run_dir / "command.json").read_text()).get("pool")


@pytest.fixture(autouse=True)
def _no_pools_left():
    yield
    pool.shutdown()


def test_policy_without_processes(monkeypatch):
    monkeypatch.delenv("EDU3D_POOL", raising=False)
    assert pool.wanted(None) is False  # no Jupyter kernel here
    assert pool.wanted(True) and not pool.wanted(False)
    monkeypatch.setenv("EDU3D_POOL", "1")
    assert pool.wanted(None)
    pool.disable()
    assert pool.wanted(None)  # the variable, set on purpose, wins
    monkeypatch.setenv("EDU3D_POOL", "0")
    assert not pool.wanted(None) and pool.wanted(True)
    pool.enable()
    fake = pool.Pool.__new__(pool.Pool)
    fake.env = {"OMP_NUM_THREADS": "1", "EDU3D_RUN_DIR": "/a", "EDU3D_TIMEOUT": "60"}
    assert fake.compatible({"OMP_NUM_THREADS": "1", "EDU3D_RUN_DIR": "/b", "EDU3D_TIMEOUT": "5"})
    assert not fake.compatible({"OMP_NUM_THREADS": "2"})
    assert not fake.compatible({"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "INFO"})
    # a launch that sets a start-only variable itself runs cold (and starts no pool)
    assert pool.acquire(2, {}, True, overrides={"GLOO_SOCKET_IFNAME": "eth9"}) is None
    assert not pool.pools()


@pytest.fixture(scope="module")
def cold_two():
    """One cold run of rank_info on 2 ranks, the reference of both warm tests below (a warm
    job on a pool of its size, and on a larger pool)."""
    return launch(workers.rank_info, 2, kwargs={"numel": 7}, timeout=120, echo=False,
                  pool=False)


# 2 ranks: a pool of 4 takes no other path (the larger pool's test below runs 2-, 3- and
# 4-rank jobs on one, and test_a_job_never_gets_the_previous_jobs_device_mesh 4-rank jobs)
def test_warm_job_equals_cold_run_in_its_own_run_folder(tmp_path, cold_two):
    script = _script(tmp_path, SCRIPT)
    cold = cold_two
    assert _pool_of(cold) is None
    seen = []
    out1 = launch(script, 2, timeout=240, echo=lambda *line: seen.append(line), pool=True)
    warm = launch(workers.rank_info, 2, kwargs={"numel": 7}, timeout=240, echo=False, pool=True)
    out2 = launch(script, 2, timeout=240, echo=False, pool=True)
    assert _pool_of(out1) == _pool_of(warm) == _pool_of(out2) is not None  # one warm pool
    assert len({cold.run_dir, out1.run_dir, warm.run_dir, out2.run_dir}) == 4

    assert warm.results == cold.results
    key = lambda e: (e["rank"], e["op"], e.get("group"), e.get("n"), e.get("bytes"))  # noqa: E731
    assert sorted(map(key, warm.events())) == sorted(map(key, cold.events()))
    for res in (warm, out1, out2):
        d = res.run_dir
        assert sorted(p.name for p in (d / "done").iterdir()) == [f"rank{r}" for r in range(2)]
        assert len(list((d / "pids").glob("rank*.pid"))) == 2
        assert not (d / "errors").exists()
    assert len(list((warm.run_dir / "results").glob("rank*.pkl"))) == 2

    for res in (out1, out2):  # each job's output, whole, prefixed, and only its own
        for r in range(2):
            assert res.lines(r) == [f"out from {r}", f"partial {r}"]
            assert res.lines(r, "stderr") == [f"err from {r}"]
    assert (1, "stdout", "out from 1") in seen and (0, "stderr", "err from 0") in seen
    assert not any("edu3d-job-end" in text for _, _, text in out1.output + out2.output)


def test_a_job_never_gets_the_previous_jobs_device_mesh():
    """DTensor caches its sharding decisions by DeviceMesh, and meshes of one shape compare
    equal: without the pool clearing those caches between jobs, a job's DTensor reduction
    was handed the previous job's mesh, whose destroyed groups' names now belong to other
    groups of the new job: it hung (or failed with "Could not resolve the process group")."""
    want = float(torch.cat([torch.arange(8.0), torch.ones(4)]).norm())
    runs = [launch(workers.dtensor_norm, 4, kwargs={"extra_groups": k}, timeout=240,
                   echo=False, pool=True) for k in (0, 3, 1)]
    assert len({_pool_of(r) for r in runs}) == 1  # one warm pool ran all three
    for run in runs:
        assert run.results == [pytest.approx(want)] * 4


def test_failures_name_the_rank_and_never_poison_the_next_job(tmp_path):
    ok = launch(workers.rank_info, 2, timeout=120, echo=False, pool=True)
    first = _pool_of(ok)
    pids = pool.pools()[0].pids()
    with pytest.raises(RankError, match="rank 1 failed: ValueError: deliberate failure") as info:
        launch(workers.raise_on, 2, args=(1,), timeout=240, echo=False, pool=True)
    assert info.value.rank == 1 and "raise ValueError" in info.value.traceback
    assert not _wait_gone(pids) and not pool.pools()  # the whole pool, agent included
    assert _no_process_of(first)

    again = launch(workers.rank_info, 2, timeout=120, echo=False, pool=True)  # a fresh pool
    assert again.results == ok.results and _pool_of(again) not in (None, first)

    killer = _script(tmp_path, """
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    pids = pool.pools()[0].pids()
    with pytest.raises(RankError) as info:
        launch(killer, 2, timeout=240, echo=False, pool=True)
    assert info.value.rank == 1 and "killed by signal SIGKILL" in str(info.value)
    assert not _wait_gone(pids) and _no_process_of(_pool_of(again))


def test_a_smaller_job_runs_on_a_larger_warm_pool(tmp_path, cold_two):
    """prewarm starts a pool in the background; jobs of that many ranks or fewer run on it
    (the ranks above sit out) and give what a cold run of their size gives; a failure in a
    smaller job still names its rank and kills the whole pool."""
    assert pool.prewarm(4, pool=True) is True
    assert pool.prewarm(2, pool=True) is False  # the 4-rank pool can run a 2-rank job
    assert [p.nprocs for p in pool.pools()] == [4]
    # at once, while ranks 2 and 3 may still be importing torch: they sit it out late
    two = launch(workers.rank_info, 2, kwargs={"numel": 7}, timeout=120, echo=False, pool=True)
    cold = cold_two
    three = launch(workers.rank_info, 3, timeout=240, echo=False, pool=True)
    four = launch(workers.rank_info, 4, timeout=240, echo=False, pool=True)
    assert _pool_of(two) == _pool_of(three) == _pool_of(four) is not None
    assert [p.nprocs for p in pool.pools()] == [4]  # no other pool was started
    assert two.results == cold.results and [r["world"] for r in two.results] == [2, 2]
    assert [r["sum"] for r in three.results] == [6.0] * 3
    assert [r["sum"] for r in four.results] == [10.0] * 4
    for res, n in ((two, 2), (three, 3), (four, 4)):  # only the job's ranks left a trace
        assert sorted(p.name for p in (res.run_dir / "done").iterdir()) == \
            [f"rank{r}" for r in range(n)]
        assert len(list((res.run_dir / "pids").glob("rank*.pid"))) == n
        assert {e["rank"] for e in res.events()} == set(range(n))
    script = _script(tmp_path, SCRIPT)
    out = launch(script, 3, timeout=240, echo=False, pool=True)
    for r in range(3):
        assert out.lines(r) == [f"out from {r}", f"partial {r}"]
    assert out.lines(3) == [] and not any("edu3d-job-end" in t for _, _, t in out.output)

    pids = pool.pools()[0].pids()
    with pytest.raises(RankError, match="rank 1 failed: ValueError: deliberate failure"):
        launch(workers.raise_on, 2, args=(1,), timeout=240, echo=False, pool=True)
    assert not _wait_gone(pids) and not pool.pools()
    assert _no_process_of(_pool_of(two))


def test_timeout_and_interrupt_kill_every_pool_process():
    launch(workers.rank_info, 2, timeout=120, echo=False, pool=True)
    pids = pool.pools()[0].pids()
    with pytest.raises(LaunchTimeout, match=r"within 2 s; rank\(s\) \[0, 1\]"):
        launch(workers.sleep_forever, 2, timeout=2, echo=False, pool=True)
    # its ranks sleep forever: returning at all proves the kill (how soon: edu3d bench goals)
    assert not _wait_gone(pids) and not pool.pools()

    def interrupt(elapsed, done):  # what Ctrl-C (a kernel interrupt) does mid-run
        if elapsed > 0.5:
            raise KeyboardInterrupt

    launch(workers.rank_info, 2, timeout=120, echo=False, pool=True)
    pids = pool.pools()[0].pids()
    with pytest.raises(KeyboardInterrupt):
        launch(workers.sleep_forever, 2, timeout=240, echo=False, pool=True, on_poll=interrupt)
    assert not _wait_gone(pids) and not pool.pools()


# ---- a real Jupyter kernel ---------------------------------------------------------------
def _marked(mark: str) -> list[int]:
    """Pool processes (agent and ranks) started from the test's kernel: their environment
    carries both the test's marker and an EDU3D_POOL_ID."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"EDU3D_TEST_MARK={mark}".encode() in env and any(
                v.startswith(b"EDU3D_POOL_ID=") for v in env):
            found.append(int(entry.name))
    return found


def _pool_dirs(mark: str) -> set[Path]:
    """The pool folders of the test kernel's pools (the agent's EDU3D_RUN_DIR)."""
    dirs = set()
    for pid in _marked(mark):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        dirs |= {Path(v.split(b"=", 1)[1].decode()) for v in env
                 if v.startswith(b"EDU3D_RUN_DIR=") and b"edu3d-pool-" in v}
    return dirs


def _processes(n: int) -> int:
    """The processes of a warm pool of ``n`` ranks: the agent and its ranks; with the zygote
    (the default), the zygote too, and each rank is a stub torchrun started plus the rank the
    zygote forked for it."""
    return 2 + 2 * n if os.environ.get("EDU3D_POOL_FORK", "1") != "0" else 1 + n


def _none_left(mark: str, wait_s: float) -> list[int]:
    deadline = time.monotonic() + wait_s
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in _marked(mark) if running(p)]


def _launch_cell(n: int) -> str:
    """A cell that launches rank_info on ``n`` ranks: [the last rank's sum, its pool]."""
    return ("import json\nfrom edu3d.launch.api import launch\nfrom tests import workers\n"
            f"r = launch(workers.rank_info, {n}, echo=False, progress=False, timeout=240)\n"
            "print(json.dumps([r.results[-1]['sum'], "
            "json.loads((r.run_dir / 'command.json').read_text()).get('pool')]))\n")


def _run(kc, code: str, timeout: float = 300) -> list:  # a hang guard: busy machines
    out = []

    def hook(msg):
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("ERROR " + "\n".join(msg["content"]["traceback"]))

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    assert reply["content"]["status"] == "ok", "".join(out)
    return json.loads("".join(out).strip().splitlines()[-1])


@pytest.mark.timeout(1200)  # a kernel started three times, ranks cold each: busy machines
def test_pool_dies_with_the_kernel(tmp_path):
    jupyter_client = pytest.importorskip("jupyter_client")
    mark = uuid.uuid4().hex
    env = {**os.environ, "EDU3D_TEST_MARK": mark, "EDU3D_RUNS": str(tmp_path / "runs"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                         if p)}
    env.pop("EDU3D_POOL", None)  # the default inside a kernel: on
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(env=env, cwd=str(tmp_path))
    kc = None
    try:
        def client():
            c = km.client()
            c.start_channels()
            c.wait_for_ready(timeout=240)
            return c

        kc = client()
        first, second = _run(kc, _launch_cell(2)), _run(kc, _launch_cell(2))
        assert first[0] == second[0] == 3.0
        assert first[1] is not None and first[1] == second[1]  # the second ran warm
        assert len(_marked(mark)) == _processes(2)
        # every rank dies the same way (its watchdog sees the agent go): the pools of the
        # SIGKILL and shutdown legs below have one rank, one torch import less each

        kc.stop_channels()
        dirs = _pool_dirs(mark)
        km.restart_kernel(now=False)  # a clean exit: the kernel's atexit shuts the pool down
        assert not _none_left(mark, 60)
        assert dirs and not any(d.exists() for d in dirs)
        kc = client()
        assert _run(kc, _launch_cell(1))[0] == 1.0
        assert len(_marked(mark)) == _processes(1)

        kc.stop_channels()
        dirs = _pool_dirs(mark)
        os.kill(km.provisioner.process.pid, signal.SIGKILL)  # no chance to clean up
        assert not _none_left(mark, 60), "the pool outlived a SIGKILLed kernel"
        assert dirs and not any(d.exists() for d in dirs)  # the agent removed its folder
        km.restart_kernel(now=True)
        kc = client()
        assert _run(kc, _launch_cell(1))[0] == 1.0
        assert len(_marked(mark)) == _processes(1)
        kc.stop_channels()
        kc = None
        dirs = _pool_dirs(mark)
        km.shutdown_kernel(now=False)
        assert not _none_left(mark, 60)
        assert dirs and not any(d.exists() for d in dirs)
    finally:
        if kc is not None:
            kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)
        for pid in _marked(mark):  # never leave anything behind, even on failure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
