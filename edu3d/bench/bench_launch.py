"""``edu3d bench launch``: what starting ranks costs, cold and warm.

After reading this file you should understand the two numbers that decide whether a notebook
cell feels live:

* :func:`launch_overhead`: ``edu3d run -n N`` of an empty script against a bare
  ``torchrun --standalone`` of the same script, whole commands timed: what edu3d's launcher
  (rank wrapper, output prefixing, pid and error files, watchdog) adds to starting N ranks;
* :func:`warm_overhead`: one N-rank cell (join the process group, one ``all_reduce``, leave)
  launched cold (a new torchrun, every rank importing torch) and warm (a job on the kernel's
  pool of ranks, :mod:`edu3d.launch.warm.pool`). The **overhead** is the launch's wall time minus the work
  itself, the slowest rank's time from entering the cell's function to leaving it, so a
  slower machine does not hide what launching costs. Repetitions are interleaved (cold,
  warm, cold, ...) after one warm-up of each (which starts the pool); medians are reported;
* :func:`pool_start`: the first cell of a kernel, which starts the pool: its ranks forked
  from one process that imported torch (:mod:`edu3d.launch.warm.zygote`) against ranks that each import
  it, wall time and the CPU of every process of the pool.

:func:`cell` brings torch in through imports inside functions: it runs on the ranks, and the
process that times the launches must stay torch-free, or it would measure itself.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from edu3d.bench.harness import progress, progress_rep, report, result
from edu3d.launch import launch
from edu3d.launch.heartbeat import cpu_seconds
from edu3d.launch.warm import pool


def launch_overhead(nprocs: int = 8, reps: int = 7, **_) -> dict:
    """``edu3d run -n N`` of an empty script against a bare ``torchrun --standalone`` of the
    same script: what edu3d's launcher (rank wrapper, output prefixing, pid and error files,
    watchdog) adds to starting N ranks. Whole commands are timed, interleaved."""
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "empty.py")
        open(script, "w").close()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "EDU3D_RUNS": os.path.join(tmp, "runs")}
        commands = {
            "edu3d": [sys.executable, "-m", "edu3d.cli", "run", "-n", str(nprocs), script],
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         f"--nproc_per_node={nprocs}", script],
        }
        times: dict[str, list[float]] = {k: [] for k in commands}
        for i in range(reps):
            for name, cmd in commands.items():
                t0 = time.perf_counter()
                subprocess.run(cmd, env=env, check=True, capture_output=True)
                times[name].append(time.perf_counter() - t0)
            progress_rep(i, reps, times)
    med = {k: statistics.median(v) for k, v in times.items()}
    return report("launch", nprocs, [result(f"run -n {nprocs} empty script", med["edu3d"],
                                            "torch.distributed.run --standalone",
                                            med["torchrun"])])


def cell(numel: int = 1024) -> float:
    """The benchmark's notebook cell, on every rank: join the process group, all-reduce
    ``numel`` floats, leave. Returns the seconds it took (imports are done before the clock
    starts: importing torch is launch overhead, the very thing a warm pool saves)."""
    import torch
    import torch.distributed as dist

    from edu3d.distributed import runtime

    t0 = time.perf_counter()
    mesh = runtime.init()
    t = torch.ones(numel)
    dist.all_reduce(t)
    assert t[0].item() == dist.get_world_size()
    runtime.shutdown(mesh)
    return time.perf_counter() - t0


def warm_overhead(nprocs: int = 4, reps: int = 7) -> list[dict]:
    """Median wall time, work and overhead (wall minus work) of an ``nprocs``-rank
    :func:`cell` launched cold and warm; the pool is shut down afterwards."""
    walls: dict[str, list[float]] = {"cold": [], "warm": []}
    works: dict[str, list[float]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.environ.get("EDU3D_RUNS")
        os.environ["EDU3D_RUNS"] = os.path.join(tmp, "runs")
        try:
            progress(f"{nprocs}-rank cell, cold vs warm: 1 warm-up (starts the pool) and "
                     f"{reps} timed repetitions")
            for warm in (False, True):
                launch(cell, nprocs, init=False, echo=False, progress=False, pool=warm,
                       timeout=300)
            for i in range(reps):
                for name in ("cold", "warm"):
                    t0 = time.perf_counter()
                    res = launch(cell, nprocs, init=False, echo=False, progress=False,
                                 pool=name == "warm", timeout=300)
                    walls[name].append(time.perf_counter() - t0)
                    works[name].append(max(res.results))
                progress_rep(i, reps, {k: [w - s for w, s in zip(walls[k], works[k])]
                                        for k in walls})
        finally:
            pool.shutdown(nprocs)
            if saved is None:
                os.environ.pop("EDU3D_RUNS", None)
            else:
                os.environ["EDU3D_RUNS"] = saved
    med = {k: statistics.median(w - s for w, s in zip(walls[k], works[k])) for k in walls}
    return [result(f"{nprocs}-rank cell overhead", med["warm"],
                   "the same cell, cold (new torchrun)", med["cold"],
                   warm_wall_s=statistics.median(walls["warm"]),
                   cold_wall_s=statistics.median(walls["cold"]),
                   warm_work_s=statistics.median(works["warm"]),
                   cold_work_s=statistics.median(works["cold"]), reps=reps)]


def pool_start(nprocs: int = 4, reps: int = 3) -> list[dict]:
    """A notebook's *first* warm cell: a new pool of ``nprocs`` ranks started and the
    :func:`cell` run on it, with the ranks forked from the pool's zygote (one import of
    torch, :mod:`edu3d.launch.warm.zygote`) against every rank importing torch itself
    (``EDU3D_POOL_FORK=0``). Wall time and the CPU of every process of the pool (agent,
    zygote, stubs, ranks), medians of interleaved repetitions."""
    walls: dict[str, list[float]] = {"forked": [], "imports": []}
    cpus: dict[str, list[float]] = {"forked": [], "imports": []}
    saved = {k: os.environ.get(k) for k in ("EDU3D_RUNS", "EDU3D_POOL_FORK")}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["EDU3D_RUNS"] = os.path.join(tmp, "runs")
        try:
            progress(f"{nprocs}-rank pool start, ranks forked vs each importing torch: "
                     f"{reps} repetitions")
            for i in range(reps):
                for name in ("forked", "imports"):
                    pool.shutdown()
                    os.environ["EDU3D_POOL_FORK"] = "1" if name == "forked" else "0"
                    t0 = time.perf_counter()
                    launch(cell, nprocs, init=False, echo=False, progress=False, pool=True,
                           timeout=300)
                    walls[name].append(time.perf_counter() - t0)
                    started = pool.pools()[-1]
                    cpus[name].append(sum(cpu_seconds(p) or 0.0
                                          for p in pool.pool_pids(started.id)))
                progress_rep(i, reps, walls)
        finally:
            pool.shutdown()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    med = {k: statistics.median(v) for k, v in walls.items()}
    return [result(f"{nprocs}-rank pool start", med["forked"],
                   "each rank imports torch (EDU3D_POOL_FORK=0)", med["imports"],
                   forked_cpu_s=statistics.median(cpus["forked"]),
                   imports_cpu_s=statistics.median(cpus["imports"]), reps=reps)]


def run_benchmark(nprocs: int | None = None, reps: int = 7, json_out: bool = False,
                  **_) -> dict:
    """All three: the empty script on ``nprocs`` ranks (default 8) against torchrun, the
    cold-vs-warm cell on ``nprocs`` ranks (default 4), and the first cell of a kernel (a
    pool's start) with forked ranks against ranks that each import torch."""
    rows = launch_overhead(nprocs or 8, reps)["results"]
    rows += warm_overhead(nprocs or 4, max(reps, 5))
    rows += pool_start(nprocs or 4, max(3, reps // 2))
    return report("launch", nprocs or 4, rows)
