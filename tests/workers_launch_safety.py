"""Rank functions for tests/test_launch_safety.py (a module, so the ranks can import them)."""

import os
import signal
import time

import torch
import torch.distributed as dist

from edu3d.distributed import comm


def kill_the_fork_server(mesh):
    """Rank 0 kills its parent, the warm pool's fork server, while every rank is mid-job."""
    t = torch.ones(4)
    comm.all_reduce(t)
    if mesh.rank == 0:
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(60)  # the launcher ends the job long before
    return None


def dp_and_zero_steps(mesh, steps: int = 2):
    """A short run of edu3d's DataParallel and ZeRO-1 on gloo, as a user's loop writes it."""
    from edu3d.parallel.dp.data_parallel import DataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    dp = DataParallel(model, mesh.dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        dp.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        dp.finish()
        opt.step()
    return float(sum(p.sum() for p in model.parameters()))


def world_sum(mesh):
    t = torch.tensor([float(mesh.rank + 1)])
    dist.all_reduce(t)
    return float(t)
