"""A warm rank of :mod:`edu3d.launch.warm.pool`: forked by the pool's zygote
(:mod:`edu3d.launch.warm.zygote`, which imported torch) for each stub torchrun started, or, with
``EDU3D_POOL_FORK=0``, started by torchrun itself as ``python -m edu3d.launch.warm.rank
POOL_FOLDER`` (and importing torch). Either way it runs :func:`main`: job after job, each
exactly as :mod:`edu3d.launch.worker` runs a cold rank's code
(:func:`edu3d.launch.worker.run_target`), on a fresh process group and in the job's own run
folder.

After reading this file you should understand what a job may change in a rank and what is
put back before the next one (the list is in :mod:`edu3d.launch.warm.pool`'s docstring): the
environment, working folder, ``sys.argv``/``sys.path``, the modules the job imported from
outside the installed packages, torch's global switches, DTensor's mesh-keyed caches; and
how a job ends on every rank's stdout and stderr: a marker line (:data:`SENTINEL`) after
everything the job wrote, so no line leaks into the next job.

It keeps its torch imports inside functions: the launcher's side imports this module too
(:mod:`edu3d.launch.warm.pool` reads :data:`SENTINEL`), and the launcher starts without torch.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

from edu3d.distributed import runtime, trace
from edu3d.launch import run_files, worker
from edu3d.launch.run_files import write_atomic

SENTINEL = "\x1eedu3d-job-end"  # the last line of every job on each stream of every rank


def _wait_for_job(pool_dir: Path, n: int) -> dict:
    """Poll for job ``n``: a few ms apart right after a job (a notebook's next cell often
    comes at once), backing off to a quarter second when idle, so a kernel's idle pools
    cost next to no CPU on a 2-core laptop (a job then waits at most that long to start)."""
    path, delay = run_files.job_file(pool_dir, n), 0.002
    while True:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(delay)
            delay = min(delay * 1.05, 0.25)


def _installed(module) -> bool:
    """True for a module of the standard library or an installed package (or edu3d): kept
    between jobs. A notebook's own modules are not, so an edited file is re-imported."""
    name = getattr(module, "__name__", "") or ""
    if name == "edu3d" or name.startswith("edu3d."):
        return True
    file = getattr(module, "__file__", None)
    if not file:
        return True  # built in, or a namespace package
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return any(os.path.abspath(file).startswith(os.path.abspath(r) + os.sep) for r in roots)


def _forget_meshes() -> None:
    """Clear what torch keeps by ``DeviceMesh`` once a job's process groups are destroyed.

    DTensor caches its sharding decisions (in Python and in its C++ dispatch fast path) keyed
    by the meshes involved, and two meshes of the same shape and dim names compare equal. A
    later job's DTensor op could then get back a spec holding the *previous* job's mesh, whose
    groups are gone: "Could not resolve the process group registered under the name 48" (or
    worse, silently the wrong group when the names happen to line up). DTensor's RNG tracker
    (CUDA meshes only) is made by a job's first random op and synced from its seed: a fresh
    process has none, so the next job gets none either."""
    if "torch.distributed.tensor._api" not in sys.modules:
        return  # no job has used DTensor in this process
    import torch
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor._api import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (propagator.propagate_op_sharding,
                   type(propagator)._propagate_tensor_meta_cached,
                   _redistribute._gen_transform_infos,
                   _collective_utils.MeshTopoInfo.build_from_mesh):
        clear = getattr(cached, "cache_clear", None)
        if clear is not None:
            clear()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:
        clear_fast_path()
    dtensor_random = sys.modules.get("torch.distributed.tensor._random")
    if dtensor_random is not None and hasattr(dtensor_random, "_rng_tracker"):
        dtensor_random._rng_tracker = None


def serve(pool_dir: Path, rank: int, pumps: list) -> None:
    """A pool rank: import torch once, then run job after job, each on a fresh process group
    and in its own run folder, until killed (never returns)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    launcher_env = json.loads((pool_dir / run_files.ENV_FILE).read_text())
    own_env = dict(os.environ)
    size = int(own_env["WORLD_SIZE"])  # the pool's ranks; a job may use fewer
    torchrun_keys = {k for k, v in own_env.items() if launcher_env.get(k) != v}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    prefix = {"job": None}
    original_init = distributed_c10d.init_process_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                           rank=-1, store_=None, **kwargs):
        """``init_process_group`` of a job: with no store of its own it meets in the job's
        prefix of the agent's store (a fresh group; ``env://`` would reuse an old one)."""
        store_ = kwargs.pop("store", store_)
        if store_ is None and init_method in (None, "env://") and prefix["job"]:
            store_ = dist.PrefixStore(prefix["job"], store)
            init_method = None
            world_size = int(os.environ["WORLD_SIZE"]) if world_size == -1 else world_size
            rank = int(os.environ["RANK"]) if rank == -1 else rank
        return original_init(backend, init_method, timeout, world_size, rank, store_, **kwargs)

    import torch.distributed.device_mesh  # noqa: F401 - imports it by name: patched below too

    for name, module in list(sys.modules.items()):  # wherever torch bound it by name
        if name.startswith("torch.distributed") and \
                getattr(module, "init_process_group", None) is original_init:
            module.init_process_group = init_process_group
    threads = torch.get_num_threads()
    write_atomic(run_files.path(pool_dir, "ready", rank), "")

    n = 0
    while True:
        job = _wait_for_job(pool_dir, n)
        world = int(job.get("nprocs", size))
        if rank >= world:  # a smaller job: this rank sits it out, and says it is done
            for fd in (1, 2):
                os.write(fd, f"{SENTINEL} {n}\n".encode())
            n += 1
            continue
        run_dir = Path(job["run_dir"])
        env = {k: v for k, v in job["env"].items() if k not in torchrun_keys}
        env.update({k: own_env[k] for k in torchrun_keys})
        if world != size:  # what torchrun would have set for a run of `world` ranks
            env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       ROLE_WORLD_SIZE=str(world))
        saved = (dict(os.environ), os.getcwd(), list(sys.argv), list(sys.path),
                 set(sys.modules))
        os.environ.clear()
        os.environ.update(env)
        os.chdir(job["cwd"])
        extra = [q for q in env.get("PYTHONPATH", "").split(os.pathsep) if q and q not in sys.path]
        sys.path[:0] = extra
        prefix["job"] = f"edu3d-job{n}/"
        store.set_timeout(timedelta(seconds=runtime.timeout_seconds()))
        torch.seed()  # a fresh process's generators start from a random seed too
        random.seed()
        worker.stack_on_signal(run_dir, rank)  # SIGUSR1 now writes into the job's folder
        write_atomic(run_files.path(run_dir, "pids", rank), str(os.getpid()))

        a = worker.parser().parse_args(job["argv"])
        rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
        error = worker.run_target(a, rest, rank, run_dir)
        if error is None:
            try:
                trace.current().close()
                trace.set_current(trace.NullRecorder())
                if dist.is_initialized():
                    dist.destroy_process_group()
            except BaseException as e:  # noqa: BLE001 - a group that cannot close is a failure
                error = {"type": type(e).__name__, "message": f"after the job: {e}",
                         "traceback": worker.user_traceback(e)}
        if error is not None:
            worker.fail(error, rank, run_dir, pumps)  # the launcher kills the pool
        write_atomic(run_files.path(run_dir, "done", rank), "")

        # back to the pool's own state for the next job
        prefix["job"] = None
        os.environ.clear()
        os.environ.update(saved[0])
        os.chdir(saved[1])
        sys.argv[:], sys.path[:] = saved[2], saved[3]
        for name in set(sys.modules) - saved[4]:
            if not _installed(sys.modules[name]):
                del sys.modules[name]
        if torch.get_default_dtype() != torch.float32:
            torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        if torch.are_deterministic_algorithms_enabled():  # the call imports much of torch
            torch.use_deterministic_algorithms(False)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        _forget_meshes()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd in (1, 2):
            os.write(fd, f"{SENTINEL} {n}\n".encode())
        n += 1


def main(argv: list[str] | None = None, stub_pid: int = 0) -> None:
    """The entry point of each rank of a pool (never returns): torchrun runs it, or the
    pool's zygote calls it in the rank it forked for the stub ``stub_pid`` that torchrun
    started (:mod:`edu3d.launch.warm.zygote`), and the rank then exits if that stub goes."""
    argv = sys.argv[1:] if argv is None else argv
    pool_dir = Path(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    pumps = worker.start_rank(rank, pool_dir, also_watch=stub_pid)
    serve(pool_dir, rank, pumps)


if __name__ == "__main__":
    main()
