"""The launcher's safety (issue 29): a warm pool whose fork server dies says so, state files
are written atomically, only a trusted runs folder is used, ``edu3d runs clean`` removes only
what edu3d made, and short DP/ZeRO runs on gloo end without an abort at process exit."""

import os
import time

import pytest

from edu3d.launch import runs
from edu3d.launch.api import LaunchError, RankError, launch
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
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(work.kill_the_fork_server, 2, timeout=60, echo=False, pool=True)
    text = str(info.value)
    assert not isinstance(info.value, RankError), text  # no rank is to blame
    assert "the warm pool's fork server died (killed by signal SIGKILL)" in text, text
    assert time.monotonic() - t0 < 30
    assert not p.alive() and p not in pool.pools()
    again = launch(work.world_sum, 2, timeout=120, echo=False, pool=True)
    assert again.results == [3.0, 3.0]
