"""``edu3d bench dp`` and ``edu3d bench zero``: edu3d's data parallelism and ZeRO against
PyTorch's, one training step each, on the same ranks.

After reading this file you should know what is compared:

* ``dp``: edu3d's bucketed, overlapped :class:`~edu3d.parallel.dp.DataParallel` against
  ``torch.nn.parallel.DistributedDataParallel`` (both 25 MB buckets), each a full step:
  forward, backward with gradient averaging, clipping, AdamW;
* ``zero``: edu3d's ZeRO-1 against ``torch.distributed.optim.ZeroRedundancyOptimizer``, and
  edu3d's ZeRO-3 against FSDP2's ``torch.distributed.fsdp.fully_shard`` (one unit per
  transformer block plus the root, as edu3d cuts it).

Both sides train the same model from the same weights on the same rows; times are medians of
interleaved repetitions, ``ratio = edu3d / reference``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d import bench
from edu3d.data import SyntheticCorpus, shard_rows
from edu3d.model import GPT

DDP = "torch.nn.parallel.DistributedDataParallel"
ZERO_OPT = "torch.distributed.optim.ZeroRedundancyOptimizer"
FSDP2 = "torch.distributed.fsdp.fully_shard"


def _setup(model: str, global_batch: int, **overrides):
    from edu3d.options import defaults
    from edu3d.train import config_from_args

    args = defaults(model=model, global_batch=global_batch, **overrides)
    config = config_from_args(args)
    x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0).batch(1, global_batch)
    return args, config, x, y


def _torch_step(model, optimizer, x, y, clip: float):
    optimizer.zero_grad(set_to_none=True)
    model(x, y)[1].backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


def _dp_step(dp, model, optimizer, x, y, clip: float):
    """edu3d's side of the DDP comparison: exactly the work of :func:`_torch_step`."""
    dp.zero_grad()
    model(x, y)[1].backward()
    dp.finish()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


def _zero_trainer(mesh, config, args, stage: int):
    """edu3d's side of the ZeRO comparisons: ``edu3d train --dp N --zero S``'s own trainer,
    whose step is the work of :func:`_torch_step` (global norm, clipping, AdamW)."""
    from edu3d.trainer import Trainer

    args.dp, args.zero = mesh.size("dp"), stage
    return Trainer(GPT(config, seed=0), mesh, args)


def dp_worker(mesh, model: str = "small", global_batch: int = 16, reps: int = 5,
              bucket_mb: float = 25.0):
    from edu3d.parallel.dp import DataParallel
    from edu3d.train import make_optimizer

    args, config, x, y = _setup(model, global_batch)
    n, i = mesh.size("dp"), mesh.index("dp")
    xs, ys = shard_rows(x, i, n), shard_rows(y, i, n)
    my_model = GPT(config, seed=0)
    dp = DataParallel(my_model, mesh.dp, "bucketed", bucket_mb)
    my_opt = make_optimizer(my_model, args)
    ref_model = torch.nn.parallel.DistributedDataParallel(GPT(config, seed=0),
                                                          bucket_cap_mb=bucket_mb)
    ref_opt = make_optimizer(ref_model.module, args)
    t = bench.interleaved_medians(
        {"edu3d": lambda: _dp_step(dp, my_model, my_opt, xs, ys, args.clip),
         "ref": lambda: _torch_step(ref_model, ref_opt, xs, ys, args.clip)}, reps=reps)
    rows = [bench.result(f"bucketed DDP step ({model})", t["edu3d"], DDP, t["ref"],
                         goal=1.05)]
    return bench.report("dp", n, rows) if dist.get_rank() == 0 else None


def zero_worker(mesh, model: str = "small", global_batch: int = 16, reps: int = 5):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer


    args, config, x, y = _setup(model, global_batch)
    n, i = mesh.size("dp"), mesh.index("dp")
    xs, ys = shard_rows(x, i, n), shard_rows(y, i, n)
    rows = []

    # ZeRO-1 against ZeroRedundancyOptimizer (wrapping DDP, its intended use)
    mine = _zero_trainer(mesh, config, args, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(GPT(config, seed=0))
    zro = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                  lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    t = bench.interleaved_medians(
        {"edu3d": lambda: mine.step(x, y, 1),
         "ref": lambda: _torch_step(ddp, zro, xs, ys, args.clip)}, reps=reps)
    rows.append(bench.result(f"ZeRO-1 step ({model})", t["edu3d"], ZERO_OPT, t["ref"]))
    del mine, ddp, zro

    # ZeRO-3 against FSDP2
    mine = _zero_trainer(mesh, config, args, 3)
    ref = GPT(config, seed=0)
    device_mesh = init_device_mesh("cpu", (n,))
    for block in ref.blocks:
        fully_shard(block, mesh=device_mesh)
    fully_shard(ref, mesh=device_mesh)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                weight_decay=args.weight_decay)
    t = bench.interleaved_medians(
        {"edu3d": lambda: mine.step(x, y, 1),
         "ref": lambda: _torch_step(ref, ref_opt, xs, ys, args.clip)}, reps=reps)
    rows.append(bench.result(f"ZeRO-3 step ({model})", t["edu3d"], FSDP2, t["ref"],
                             goal=1.25))
    return bench.report("zero", n, rows) if dist.get_rank() == 0 else None


def _run(worker, name: str, nprocs: int, json_out: bool, opts: dict) -> dict:
    from edu3d.launch import launch

    run = launch(worker, nprocs, kwargs=opts, timeout=600, echo=not json_out, name=name)
    return run.results[0]


def run_dp_benchmark(nprocs: int = 4, json_out: bool = False, **opts) -> dict:
    """Launch ``nprocs`` ranks: edu3d bucketed DDP against torch DDP."""
    return _run(dp_worker, "bench-dp", nprocs, json_out, opts)


def run_zero_benchmark(nprocs: int = 4, json_out: bool = False, **opts) -> dict:
    """Launch ``nprocs`` ranks: edu3d ZeRO-1 against ZeroRedundancyOptimizer, ZeRO-3 against
    FSDP2 ``fully_shard``."""
    return _run(zero_worker, "bench-zero", nprocs, json_out, opts)
