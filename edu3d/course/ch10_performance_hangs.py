"""Chapter 10 (performance and debugging), its debugging half: the three classic hangs.

After reading this file you should know what a hang looks like from the launcher's side:
:func:`hang` reproduces one of the three classic hangs on 2 ranks (a rank skipping a
collective, mismatched shapes, a send without its receive) with a short collective timeout
and heartbeat, and returns the launcher's verdict: which rank it names, and that rank's
stack; :func:`hangs` runs all three at once, :func:`stack_lines` keeps the learner's frames
of a verdict's stack.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from edu3d.distributed import comm, trace
from edu3d.launch.api import LaunchError, RankError, launch


def wait_for_next_batch() -> None:
    """Stands for a data loader that never delivers (the rank blocks outside any collective)."""
    time.sleep(120)


def skipped_collective(mesh) -> None:
    """Rank 1 skips the gradient all-reduce (a rank-dependent ``if``) and goes on to wait for
    its next batch; rank 0 waits in the all-reduce for it."""
    grad = torch.ones(1024)
    with trace.current().context(step=1):
        if mesh.rank != 1:  # e.g. "skip the sync when my loss is NaN"
            comm.all_reduce(grad)
        wait_for_next_batch()


def mismatched_shapes(mesh) -> None:
    """Rank 0 all-reduces 4 numbers, rank 1 eight (a shape computed from rank-local data)."""
    with trace.current().context(step=1):
        comm.all_reduce(torch.ones(4 if mesh.rank == 0 else 8))


def unmatched_send(mesh) -> None:
    """Rank 0 sends an activation to rank 1, which never posts the receive: it goes straight
    to the loss all-reduce."""
    with trace.current().context(step=1):
        if mesh.rank == 0:
            comm.send(torch.ones(4096), 1)
        comm.all_reduce(torch.ones(1))


HANGS = {"skipped collective": skipped_collective, "mismatched shapes": mismatched_shapes,
         "send without receive": unmatched_send}


def hang(kind: str, timeout_s: float = 6.0, heartbeat: float = 2.0) -> dict:
    """Launch one of :data:`HANGS` on 2 ranks with a short collective timeout and heartbeat;
    return the launcher's verdict: the error's class, the rank it names, its first line and
    the named rank's stack (or traceback)."""
    t0 = time.perf_counter()
    try:
        launch(HANGS[kind], 2, env={"EDU3D_TIMEOUT": str(timeout_s)}, heartbeat=heartbeat,
               echo=False, timeout=60, progress=False, name="hang", pool=False)
    except RankError as err:
        return {"kind": kind, "error": type(err).__name__, "rank": err.rank,
                "message": str(err).splitlines()[0], "traceback": err.traceback,
                "seconds": time.perf_counter() - t0}
    except LaunchError as err:
        return {"kind": kind, "error": type(err).__name__, "rank": None,
                "message": str(err).splitlines()[0], "traceback": "",
                "seconds": time.perf_counter() - t0}
    raise AssertionError(f"{kind} finished without hanging")


def hangs(kinds=tuple(HANGS), **kw) -> dict[str, dict]:
    """Every hang of ``kinds`` at once, each its own launch in its own thread: waiting for a
    heartbeat costs no CPU. Each starts its ranks cold (a run that fails kills the warm pool
    it ran on, and the chapter's pool is kept for the runs after these)."""
    with ThreadPoolExecutor(len(kinds)) as pool:
        futures = {k: pool.submit(hang, k, **kw) for k in kinds}
        return {k: f.result() for k, f in futures.items()}


def stack_lines(verdict: dict, keep: int = 6) -> list[str]:
    """The first lines of the named rank's stack or traceback, the launcher's own frames
    (worker, warm pool, runpy) left out."""
    launcher = ("edu3d/launch/worker.py", "edu3d/launch/warm/pool.py", "<frozen runpy>")
    lines = [ln for ln in verdict["traceback"].splitlines()
             if ln.strip() and not any(f in ln for f in launcher)]
    return lines[:keep]
