"""Rank functions for tests/test_launch_safety.py (a module, so the ranks can import them)."""

import atexit
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

from edu3d.distributed import comm, runtime
from edu3d.config.layout import Layout
from edu3d.parallel.dp.data_parallel import DataParallel
from edu3d.parallel.zero.sharding import Zero


def kill_the_fork_server(mesh):
    """Rank 0 kills its parent, the warm pool's fork server, while every rank is mid-job."""
    t = torch.ones(4)
    comm.all_reduce(t)
    if mesh.rank == 0:
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(3600)  # only the launcher ends the job: before its hang guard, or it failed
    return None


def dp_and_zero_steps(mesh, steps: int = 2):
    """A short run of edu3d's DataParallel, then ZeRO-1, on gloo, as a user's loop writes it;
    the sum of both models' weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    dp = DataParallel(model, mesh.dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        dp.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        dp.finish()
        opt.step()
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    zero = Zero(model2, mesh.dp, 1, optimizer_class=torch.optim.SGD, lr=0.1)
    for _ in range(steps):
        zero.zero_grad()
        model2(torch.randn(4, 8)).pow(2).mean().backward()
        zero.finish()
        zero.step()
    with torch.no_grad():
        return float(sum(p.sum() for m in (model, model2) for p in m.parameters()))


def _teardown_probe() -> None:
    """Registered before edu3d's own exit hook, so it runs after it, as the interpreter's
    teardown begins: is the process group (and with it gloo's threads) still up?"""
    print(f"at teardown: initialized={dist.is_initialized()}", file=sys.stderr, flush=True)


def exit_loop(runs: int, out_dir: str) -> None:
    """``runs`` short 2-rank DP and ZeRO runs, each rank forked from this process (torch is
    imported once) and ending as a user's script ends: through the interpreter's teardown,
    not ``os._exit``. Each rank's stderr goes to ``out_dir/r{run}-{rank}.err``; prints one
    line per rank: ``run rank exit_code``."""
    import torch._dynamo  # noqa: F401 - what an optimizer's first construction imports: once

    atexit.register(_teardown_probe)
    for i in range(runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pids = {}
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                fd = os.open(os.path.join(out_dir, f"r{i}-{rank}.err"),
                             os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 2)
                os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0",
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                dp_and_zero_steps(runtime.init(Layout(dp=2)))
                sys.exit(0)  # up through the module's top: the interpreter tears down
            pids[pid] = rank
        for pid, rank in pids.items():
            _, status = os.waitpid(pid, 0)
            print(i, rank, os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    exit_loop(int(sys.argv[1]), sys.argv[2])


def world_sum(mesh):
    t = torch.tensor([float(mesh.rank + 1)])
    dist.all_reduce(t)
    return float(t)
