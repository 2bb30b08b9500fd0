"""Functions the launcher tests run on every rank (called as fn(mesh, ...))."""

import os
import time

import torch
import torch.distributed as dist

from edu3d.distributed import comm, trace


def rank_info(mesh, numel: int = 10):
    """Who am I, and does a traced all-reduce over every rank give N(N+1)/2?"""
    t = torch.full((numel,), float(mesh.rank + 1))
    comm.all_reduce(t, mesh.groups["world"])
    return {"rank": mesh.rank, "world": dist.get_world_size(), "coord": tuple(mesh.coord),
            "sum": t[0].item(), "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"), "traced": trace.current().enabled}


def group_members(mesh):
    """Each group's members as the ranks themselves report them through a real all-gather."""
    out = {}
    for dim in ("tp", "dp", "pp", "mp"):
        group = mesh.group(dim)
        got = torch.zeros(dist.get_world_size(group), dtype=torch.long)
        comm.all_gather(got, torch.tensor([mesh.rank]), group)
        out[dim] = got.tolist()
    return out


def device_mesh_groups(mesh):
    """The groups of torch's own init_device_mesh with mesh_dim_names (pp, dp, tp)."""
    from torch.distributed.device_mesh import init_device_mesh

    layout = mesh.layout
    dm = init_device_mesh("cpu", (layout.pp, layout.dp, layout.tp),
                          mesh_dim_names=("pp", "dp", "tp"))
    return {dim: dist.get_process_group_ranks(dm.get_group(dim)) for dim in ("pp", "dp", "tp")}


def raise_on(mesh, bad_rank: int):
    if mesh.rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()  # the others wait in a collective, as real code would
    return mesh.rank


def sleep_forever(mesh):
    time.sleep(3600)


def comm_ops(mesh):
    """Each traced collective once, with results so the test can check values and events."""
    n, r = dist.get_world_size(), mesh.rank
    world = mesh.groups["world"]
    x = torch.arange(4, dtype=torch.float32) + 10 * r
    gathered = torch.empty(4 * n)
    comm.all_gather(gathered, x, world)
    scattered = torch.empty(2)
    comm.reduce_scatter(scattered, torch.ones(2 * n) * (r + 1), world)
    b = torch.full((3,), float(r))
    comm.broadcast(b, src=n - 1, group=world)
    got = torch.empty(5, dtype=torch.float64)
    send = comm.send(torch.full((5,), float(r), dtype=torch.float64), (r + 1) % n, world,
                     async_op=True)
    comm.recv(got, (r - 1) % n, world)
    send.wait()
    h = comm.all_reduce(torch.ones(6), world, async_op=True)
    h.wait()
    return {"gathered": gathered.tolist(), "scattered": scattered.tolist(),
            "broadcast": b.tolist(), "received": got[0].item()}


def cuda_all_reduce(mesh, numel: int = 1 << 20):
    """An all-reduce on each rank's own GPU (NCCL), timed by CUDA events in the trace."""
    from edu3d.distributed import runtime

    dev = runtime.device()
    t = torch.full((numel,), float(mesh.rank + 1), device=dev)
    comm.all_reduce(t, mesh.groups["world"])
    torch.cuda.synchronize()
    return {"backend": dist.get_backend(), "device": str(dev), "value": t[0].item()}


def dtensor_norm(mesh, extra_groups: int = 0):
    """A DTensor reduction on a fresh 2-D DeviceMesh (its groups are proper subgroups: a 1-D
    mesh would reuse the world group), after `extra_groups` other new groups, which shift the
    names torch gives the mesh's groups."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    for _ in range(extra_groups):
        dist.new_group(list(range(dist.get_world_size())))
    dm = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("pp", "dp"))
    x = distribute_tensor(torch.arange(8, dtype=torch.float32), dm, [Shard(0), Shard(0)])
    y = distribute_tensor(torch.ones(4), dm, [Shard(0), Shard(0)])
    # a norm over a list of DTensors, as clip_grad_norm_ computes over a sharded model's grads
    return float(torch.nn.utils.get_total_norm([x, y]).full_tensor())


def process_info(mesh):
    """This rank's process: pid, parent, session, and the CPU it has used (forked pool ranks
    start at zero: the zygote's imports are not theirs)."""
    return {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
            "cpu": time.process_time(), "rank": mesh.rank}
