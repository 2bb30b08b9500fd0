import os

import pytest

from edu3d import pool

# Files that test the cold launch path itself (torchrun started for this run: its pids,
# exits, sockets, timeouts) or manage pools on their own. Every other test launches its
# ranks through warm pools (edu3d.pool), the path every notebook cell takes: the same
# results and errors, without importing torch again in every rank of every launch.
COLD = {"test_launch", "test_launch_hardening", "test_pool", "test_cli", "test_browser",
        "test_failures"}


@pytest.fixture(autouse=True, scope="session")
def _quiet_machine(tmp_path_factory):
    """One thread per rank, and run folders in a temporary directory, not the checkout."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["EDU3D_RUNS"] = str(tmp_path_factory.mktemp("runs"))
    yield


@pytest.fixture(autouse=True)
def _warm_ranks(request):
    """Warm pools for this test's launches unless its file tests the cold path. Up to three
    pools per worker (world sizes 2, 4 and 8) stay warm across the tests of one worker."""
    pool.MAX_POOLS = 3
    pool.set_default(request.module.__name__.rpartition(".")[2] not in COLD)
    yield
    pool.set_default(None)
