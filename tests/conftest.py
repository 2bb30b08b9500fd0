import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _quiet_machine(tmp_path_factory):
    """One thread per rank, and run folders in a temporary directory, not the checkout."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["EDU3D_RUNS"] = str(tmp_path_factory.mktemp("runs"))
    yield
