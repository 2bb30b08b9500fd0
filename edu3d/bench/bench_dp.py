"""``edu3d bench dp`` and ``edu3d bench zero``: edu3d's data parallelism and ZeRO against
PyTorch's, one training step each, on the same ranks.

After reading this file you should know what is compared:

* ``dp``: edu3d's bucketed, overlapped :class:`~edu3d.parallel.dp.data_parallel.DataParallel` against
  ``torch.nn.parallel.DistributedDataParallel`` (both 25 MB buckets), each a full step:
  forward, backward with gradient averaging, the global norm, clipping, AdamW;
* ``zero``: edu3d's ZeRO-1 against ``torch.distributed.optim.ZeroRedundancyOptimizer``, and
  edu3d's ZeRO-3 against FSDP2's ``torch.distributed.fsdp.fully_shard`` (one unit per
  transformer block plus the root, as edu3d cuts it).

Both sides are ``edu3d train``'s own step for the layout, ``--impl edu3d`` against
``--impl torch`` (:mod:`edu3d.production.torch_impl`): the same model from the same weights
on the same rows; times are medians of interleaved repetitions, ``ratio = edu3d / reference``.
"""

from __future__ import annotations


import torch.distributed as dist

from edu3d.bench import harness as bench
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.production.torch_impl import TorchTrainer
from edu3d.train.data import SyntheticCorpus
from edu3d.config.sections import Run
from edu3d.train.preflight import model_config
from edu3d.train.trainer import Trainer

DDP = "torch.nn.parallel.DistributedDataParallel"
ZERO_OPT = "torch.distributed.optim.ZeroRedundancyOptimizer"
FSDP2 = "torch.distributed.fsdp.fully_shard"


def _setup(model: str, global_batch: int, **overrides):
    args = Run.of(model=model, global_batch=global_batch, **overrides)
    config = model_config(args)
    x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0).batch(1, global_batch)
    return args, config, x, y


def _trainers(mesh, config, args, **layout):
    """The same layout both ways: ``edu3d train``'s :class:`~edu3d.train.trainer.Trainer` and
    ``--impl torch``'s :class:`~edu3d.production.torch_impl.TorchTrainer` (DDP,
    ZeroRedundancyOptimizer or FSDP2 ``fully_shard``), each from the same weights; one
    repetition is one full step of each: forward, backward with the gradient reduction,
    the global norm, clipping, AdamW."""
    args = args.replace(dp=mesh.size("dp"), **layout)
    return (Trainer(GPT(config, seed=0), mesh, args),
            TorchTrainer(GPT(config, seed=0), mesh, args.replace(impl="torch")))


def _timed(mine, ref, x, y, reps: int) -> dict:
    return bench.interleaved_medians({"edu3d": lambda: mine.step(x, y, 1),
                                      "ref": lambda: ref.step(x, y, 1)}, reps=reps)


def _row(name: str, mine, ref, x, y, reps: int, reference: str, **extra) -> dict:
    """Both sides timed, then one traced step of edu3d's for its communication share."""
    t = _timed(mine, ref, x, y, reps)
    share = bench.comm_shares(lambda: mine.step(x, y, 1))
    return bench.result(name, t["edu3d"], reference, t["ref"], tokens=x.numel(),
                        comm_share=share, **extra)


def dp_worker(mesh, model: str = "small", global_batch: int = 16, reps: int = 5,
              bucket_mb: float = 25.0):
    args, config, x, y = _setup(model, global_batch, bucket_mb=bucket_mb)
    rows = [_row(f"bucketed DDP step ({model})", *_trainers(mesh, config, args), x, y, reps,
                 DDP, goal=1.05)]
    return (bench.report("dp", mesh.size("dp"), rows, bench.layout_name(dp=mesh.size("dp")))
            if dist.get_rank() == 0 else None)


def zero_worker(mesh, model: str = "small", global_batch: int = 16, reps: int = 5):
    args, config, x, y = _setup(model, global_batch)
    rows = [  # ZeRO-1 against ZeroRedundancyOptimizer (wrapping DDP, its intended use)
        _row(f"ZeRO-1 step ({model})", *_trainers(mesh, config, args, zero=1), x, y, reps,
             ZERO_OPT),
        # ZeRO-3 against FSDP2 (one unit per block plus the root)
        _row(f"ZeRO-3 step ({model})", *_trainers(mesh, config, args, zero=3), x, y, reps,
             FSDP2, goal=1.25)]
    return (bench.report("zero", mesh.size("dp"), rows, bench.layout_name(dp=mesh.size("dp")))
            if dist.get_rank() == 0 else None)


def _run(worker, name: str, nprocs: int, json_out: bool, opts: dict) -> dict:
    run = launch(worker, nprocs, kwargs=opts, timeout=600, echo=not json_out, name=name)
    return run.results[0]


def run_dp_benchmark(nprocs: int = 4, json_out: bool = False, **opts) -> dict:
    """Launch ``nprocs`` ranks: edu3d bucketed DDP against torch DDP."""
    return _run(dp_worker, "bench-dp", nprocs, json_out, opts)


def run_zero_benchmark(nprocs: int = 4, json_out: bool = False, **opts) -> dict:
    """Launch ``nprocs`` ranks: edu3d ZeRO-1 against ZeroRedundancyOptimizer, ZeRO-3 against
    FSDP2 ``fully_shard``."""
    return _run(zero_worker, "bench-zero", nprocs, json_out, opts)
