"""``edu3d bench comm``: collectives' bandwidth against message size, and an alpha-beta model.

After reading this file you should understand how collectives are measured:

* **algorithm bandwidth** ``algbw = S / t``: the buffer size over the time;
* **bus bandwidth** ``busbw = algbw · 2(N-1)/N`` for all-reduce (``(N-1)/N`` for all-gather and
  reduce-scatter): what each rank's link actually carried in a ring, comparable across N
  (NCCL-tests' definition);
* the **alpha-beta** cost model of a ring all-reduce, ``t = 2(N-1)·α + 2(N-1)/N · S · β``:
  ``α`` is the latency of one step, ``β`` the seconds per byte. A least-squares fit over the
  message sizes gives both; small messages are latency-bound, large ones bandwidth-bound.

Every row compares edu3d's hand-written ring (:mod:`edu3d.distributed.algorithms`) with the library collective
(``torch.distributed``'s, gloo here), medians of interleaved repetitions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.bench import harness as bench
from edu3d.distributed import algorithms as ring
from edu3d.launch import launch

SIZES = tuple(2**k for k in range(10, 27, 2))  # 1 KiB .. 64 MiB in bytes
REFERENCES = {"all_reduce": "torch.distributed.all_reduce",
              "all_gather": "torch.distributed.all_gather_into_tensor",
              "reduce_scatter": "torch.distributed.reduce_scatter_tensor"}
BUS_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


def fit_alpha_beta(sizes: list[int], times: list[float], n: int) -> tuple[float, float]:
    """Least-squares ``α, β`` of ``t = 2(N-1)α + 2(N-1)/N · S · β`` (ring all-reduce)."""
    a = torch.tensor([[2.0 * (n - 1), 2.0 * (n - 1) / n * s] for s in sizes], dtype=torch.float64)
    t = torch.tensor(times, dtype=torch.float64).unsqueeze(1)
    sol = torch.linalg.lstsq(a, t).solution.squeeze(1)
    return float(sol[0]), float(sol[1])


def _ops(op: str, numel: int, n: int):
    x = torch.randn(numel)
    if op == "all_reduce":
        return (lambda: ring.ring_all_reduce(x.clone()),
                lambda: dist.all_reduce(x.clone()))
    shard = torch.randn(numel // n)
    out = torch.empty(numel // n * n)
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if op == "all_gather":
        return (lambda: ring.ring_all_gather(out), lambda: ag(out, shard))
    return (lambda: ring.ring_reduce_scatter(out.clone()), lambda: rs(shard.clone(), out))


def worker(mesh, sizes=SIZES, reps: int = 3, ops=("all_reduce", "all_gather", "reduce_scatter")):
    n = dist.get_world_size()
    rows = []
    for op in ops:
        for size in sizes:
            numel = max(size // 4, n)
            mine, ref = _ops(op, numel, n)
            t = bench.interleaved_medians({"edu3d": mine, "ref": ref}, reps=reps, warmup=1)
            s = numel * 4
            rows.append(bench.result(
                f"{op} {s / 2**10:,.0f} KiB", t["edu3d"], REFERENCES[op], t["ref"], op=op,
                bytes=s, edu3d_algbw_GBps=s / t["edu3d"] / 1e9,
                edu3d_busbw_GBps=s / t["edu3d"] / 1e9 * BUS_FACTOR[op] * (n - 1) / n,
                reference_busbw_GBps=s / t["ref"] / 1e9 * BUS_FACTOR[op] * (n - 1) / n))
    ar = [r for r in rows if r["op"] == "all_reduce"]
    if len(ar) >= 2:
        for key, col in (("edu3d", "edu3d_s"), ("reference", "reference_s")):
            alpha, beta = fit_alpha_beta([r["bytes"] for r in ar], [r[col] for r in ar], n)
            for r in ar:
                r[f"{key}_alpha_s"], r[f"{key}_beta_s_per_byte"] = alpha, beta
                r[f"{key}_model_s"] = 2 * (n - 1) * alpha + 2 * (n - 1) / n * r["bytes"] * beta
    return bench.report("comm", n, rows) if dist.get_rank() == 0 else None


def describe(rep: dict) -> str:
    """The fitted cost model in words (printed under the table)."""
    r = next((r for r in rep["results"] if "edu3d_alpha_s" in r), None)
    if r is None:
        return ""
    n = rep["world_size"]
    lines = [f"ring all-reduce cost model t = 2(N-1)·α + 2(N-1)/N·S·β, N = {n}:"]
    for key, label in (("edu3d", "edu3d ring"), ("reference", r["reference"])):
        lines.append(f"  {label:<30} α = {r[f'{key}_alpha_s'] * 1e6:8.1f} µs, "
                     f"1/β = {1 / max(r[f'{key}_beta_s_per_byte'], 1e-30) / 1e9:6.2f} GB/s")
    return "\n".join(lines)


def run_benchmark(nprocs: int = 4, json_out: bool = False, **opts) -> dict:
    """Launch ``nprocs`` ranks, time edu3d's rings against the library collectives."""
    run = launch(worker, nprocs, kwargs=opts, timeout=600, echo=not json_out,
                 name="bench-comm")
    rep = run.results[0]
    if not json_out:
        print(describe(rep))
    return rep
