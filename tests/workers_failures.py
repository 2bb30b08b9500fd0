"""Functions the failure tests run on every rank (called as fn(mesh, ...))."""

import time

import torch

from edu3d import comm, trace


def hang_at(mesh, victim: int, step: int, steps: int = 6):
    """Every rank all-reduces once per step; ``victim`` stops at ``step`` (alive, silent,
    outside any collective), as ``--inject-fault kind=hang`` does."""
    t = torch.ones(8)
    for s in range(1, steps + 1):
        with trace.current().context(step=s):
            if mesh.rank == victim and s == step:
                print(f"hanging at {time.time():.3f}", flush=True)
                while True:
                    time.sleep(1.0)
            comm.all_reduce(t)
    return t[0].item()


def slow_at(mesh, victim: int, step: int, busy_s: float, steps: int = 4):
    """``victim`` computes for ``busy_s`` seconds at ``step`` without a single note (a long
    step, not a hang: it uses the CPU) while the others wait for it in a collective."""
    t = torch.ones(8)
    a = torch.randn(64, 64)
    for s in range(1, steps + 1):
        with trace.current().context(step=s):
            if mesh.rank == victim and s == step:
                end = time.monotonic() + busy_s
                while time.monotonic() < end:
                    a = torch.tanh(a @ a)
            comm.all_reduce(t)
    return t[0].item()


def mismatched(mesh):
    """Rank 0 calls all_reduce where the others call broadcast: every rank waits forever."""
    t = torch.ones(4)
    with trace.current().context(step=3):
        comm.all_reduce(t)
        if mesh.rank == 0:
            comm.all_reduce(t)
        else:
            comm.broadcast(t, src=1)
