import os

import pytest

from edu3d.launch.warm import pool

# Files that test the cold launch path itself (torchrun started for this run: its pids,
# exits, sockets, timeouts) or manage pools on their own. Every other test launches its
# ranks through warm pools (edu3d.launch.warm.pool), the path every notebook cell takes: the same
# results and errors, without importing torch again in every rank of every launch.
COLD = {"test_launch", "test_launch_hardening", "test_pool", "test_zygote", "test_cli",
        "test_failures", "test_browser", "test_browser_late", "test_browser_exercises",
        "test_multinode"}


@pytest.fixture(autouse=True, scope="session")
def _quiet_machine(tmp_path_factory):
    """One thread per rank, run folders and prepared text in a temporary directory, not the
    checkout or the home folder, and no calibration of this machine (edu3d calibrate's
    profile would change predictions)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["EDU3D_RUNS"] = str(tmp_path_factory.mktemp("runs"))
    os.environ["EDU3D_DATA"] = str(tmp_path_factory.mktemp("data"))  # prepared text corpora
    os.environ["EDU3D_PROFILES"] = str(tmp_path_factory.mktemp("profiles"))
    yield


def _warm(request) -> bool:
    return request.module.__name__.rpartition(".")[2] not in COLD


@pytest.fixture(autouse=True, scope="module")
def _warm_ranks_for_the_module(request):
    """Warm pools for this file's launches unless it tests the cold path. Up to three pools
    per worker (world sizes 2, 4 and 8) stay warm across the files of one worker. Module
    scope, because a file's module-scoped fixtures (a launch shared by its tests) are set up
    before any function-scoped fixture: with the default set per test only, those launches
    started cold ranks (8 imports of torch for an 8-rank fixture). The first warm file of a
    worker starts one 8-rank pool: a job of fewer ranks runs on an idle larger pool, so the
    worker's 2- and 4-rank jobs need no pools of their own (each would import torch again
    in each of its ranks)."""
    pool.MAX_POOLS = 3
    warm = _warm(request)
    pool.set_default(warm)
    if warm:
        pool.prewarm(8)  # returns at once; nothing if an 8-rank pool is already warm
    yield
    pool.set_default(None)


@pytest.fixture(autouse=True)
def _warm_ranks(request):
    """The same default again for each test, whatever the test before it set."""
    pool.set_default(_warm(request))


# The slowest files first (seconds on a 2-core machine under the other worker's load, from
# `--durations=0`): pytest-xdist's `--dist loadfile` hands out whole files in collection
# order, one more to a worker as it runs dry, so running the longest first is what keeps
# both workers busy to the end instead of one of them finishing a long file alone. Files not
# named keep their order after these.
SLOWEST_FIRST = (  # seconds from stop 48's full run, the other worker busy
    "tests/test_browser.py",            # 363: chapters 00-06 in Chromium
    "tests/test_browser_late.py",       # 359: chapters 07-13 in Chromium
    "tests/test_every_control.py",      # 201: every knob of every panel, headless
    "tests/test_browser_exercises.py",  # 167: every exercise in Chromium
    "tests/test_launch_safety.py",      # 131
    "tests/test_multinode.py",          # 93: two 4-rank nodes, twice
    "tests/test_bad_input.py",          # 85
    "tests/test_failures.py",           # 81
    "tests/test_grading.py",            # 81: edu3d grade on every untouched stub
    "tests/test_launch_hardening.py",   # 72
    "tests/test_zygote.py",             # 68
    "tests/test_pool.py",               # 61
    "tests/test_grade_robust.py",       # 59
    "tests/test_5d_parity.py",          # 55
    "tests/test_panels_ch08_11.py",     # 52
    "tests/test_batching.py",           # 49
    "tests/test_planner_5d.py",         # 49
    "tests/test_zero_grad_reduce.py",   # 46
    "tests/test_3d_parity.py",          # 39
    "tests/test_wrong_answers.py",      # 36
    "tests/test_launch.py",             # 35
    "tests/test_cli.py",                # 34
    "tests/test_ckpt_untrusted.py",     # 34
    "tests/test_zero.py",               # 33
    "tests/test_impl_torch.py",         # 32
    "tests/test_library_parity.py",     # 32: one 2-rank launch, 70 plain-loop cases
    "tests/test_recompute.py",          # 31
    "tests/test_train_layouts.py",      # 28
    "tests/test_charts_grammar.py",     # 28
    "tests/test_pp_parity.py",          # 27
    "tests/test_pp_bubble.py",          # 27
    "tests/test_hints_tiered.py",       # 27
    "tests/test_validation.py",         # 26
)


def pytest_configure(config):
    # xdist would otherwise reorder files by their number of tests, not their duration
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# The long files, marked slow as a whole (besides the world-size-8 tests marked in their own
# files): the browser, every layout held against the serial model, and the runs of the
# launcher, the pools and the grader that wait for failures. `-m "not slow"` leaves them out:
# README's quick check of an install (Tests), every other file in a few minutes.
SLOW_FILES = {
    "tests/test_browser.py", "tests/test_browser_late.py", "tests/test_browser_exercises.py",
    "tests/test_3d_parity.py", "tests/test_5d_parity.py", "tests/test_pp_parity.py",
    "tests/test_tp_parity.py", "tests/test_dp.py", "tests/test_zero.py",
    "tests/test_impl_torch.py", "tests/test_freeze.py", "tests/test_batching.py",
    "tests/test_zero_grad_reduce.py", "tests/test_recompute.py", "tests/test_precision.py",
    "tests/test_multinode.py", "tests/test_launch_hardening.py", "tests/test_failures.py",
    "tests/test_fp8_parity.py",
    "tests/test_pool.py", "tests/test_zygote.py", "tests/test_grading.py",
    "tests/test_grade_robust.py", "tests/test_hints_tiered.py", "tests/test_wrong_answers.py",
    "tests/test_every_control.py", "tests/test_compile.py",
}


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: tests keep their order inside a file
    for item in items:
        if item.nodeid.split("::", 1)[0] in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
