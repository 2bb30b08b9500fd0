"""Small real runs that the first chapter launches: who am I, who are my partners, first sum.

After reading this file you should understand that a rank learns its place in the mesh by
*talking*: each function runs on every rank (``launch(fn, n, layout=...)`` calls
``fn(mesh, ...)``), uses only the instrumented collectives of :mod:`edu3d.distributed.comm`, and returns a
small dict that the notebook draws.

* :func:`mesh_report` — every rank all-gathers its global rank over each of its groups (TP,
  DP, PP, MP); the gathered list is the group's membership, proven by a real collective rather
  than computed from a formula.
* :func:`first_all_reduce` — rank ``r`` contributes ``r + 1``; after one all-reduce (SUM)
  every rank holds ``1 + 2 + ... + N = N(N+1)/2``.
* :func:`groups_table` and :func:`coords_table` — the reports as stable, sorted text, for
  checked notebook cells.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.distributed import comm, runtime, trace

DIMS = ("tp", "dp", "pp", "mp")


def mesh_report(mesh) -> dict:
    """This rank's coordinates and the members of each of its groups, learned by all-gathering
    the global rank over the group."""
    dev = runtime.device()  # NCCL only moves tensors that live on this rank's GPU
    me = torch.tensor([mesh.rank], dtype=torch.int64, device=dev)
    groups = {}
    for dim in DIMS:
        pg = mesh.group(dim)
        members = torch.empty(dist.get_world_size(pg), dtype=torch.int64, device=dev)
        comm.all_gather(members, me, group=pg)
        groups[dim] = members.tolist()
    return {"rank": mesh.rank, "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "coords": mesh.coord._asdict(), "groups": groups}


def first_all_reduce(mesh, numel: int = 1 << 18, repeats: int = 2) -> dict:
    """All-reduce (SUM) a tensor of ``numel`` float32 values in which rank ``r`` put ``r + 1``.

    It runs ``repeats`` times, each round traced as a compute span ``fill`` (making the
    tensor), the all-reduce, and a barrier, so the timeline shows both lanes of every rank.
    """
    rec = trace.current()
    dev = runtime.device()
    world = dist.get_world_size()
    comm.barrier()
    for step in range(repeats):
        with rec.context(step=step):
            with rec.span("compute", "fill"):
                t = torch.full((numel,), float(mesh.rank + 1), device=dev)
            comm.all_reduce(t)
            comm.barrier()
    return {"rank": mesh.rank, "world_size": world, "backend": dist.get_backend(),
            "contributed": mesh.rank + 1,
            "result": float(t[0]), "all_equal": bool((t == t[0]).all()),
            "bytes": t.numel() * t.element_size()}


def groups_table(reports: list[dict]) -> str:
    """The groups the ranks reported, one line per dimension, e.g.
    ``TP groups [0,1][2,3][4,5][6,7]`` (deterministic: sorted, no timings)."""
    lines = []
    for dim in DIMS:
        groups = sorted({tuple(r["groups"][dim]) for r in reports})
        lines.append(f"{dim.upper()} groups " + "".join(
            "[" + ",".join(map(str, g)) + "]" for g in groups))
    return "\n".join(lines)


def coords_table(reports: list[dict]) -> str:
    """One line per rank: its global rank and its (pp, dp, tp) coordinates."""
    rows = ["rank  pp dp tp"]
    for r in sorted(reports, key=lambda r: r["rank"]):
        c = r["coords"]
        rows.append(f"{r['rank']:>4}  {c['pp']:>2} {c['dp']:>2} {c['tp']:>2}")
    return "\n".join(rows)
