"""``edu3d bench pp``: edu3d's 1F1B engine timed against PyTorch's ``Schedule1F1B``.

After reading this file you should know what the comparison holds equal: the same ranks and
process group, the same stages (``edu3d train --impl torch``'s construction: the same layers
cut at the same boundaries, handed to ``torch.distributed.pipelining.PipelineStage``), the
same micro-batches and the same loss (mean cross-entropy, gradients scaled by 1/m in both).
One repetition is one forward-backward step of the whole pipeline; repetitions alternate
between the two and the median of each is reported (:mod:`edu3d.bench.harness`), as
``ratio = edu3d / torch``; the goal is 1.05 or less.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from edu3d.bench import harness as bench
from edu3d.config.layout import Layout
from edu3d.launch import launch
from edu3d.model.gpt import GPT, config_from
from edu3d.production.torch_impl import TorchTrainer
from edu3d.train.data import SyntheticCorpus
from edu3d.config.sections import Run
from edu3d.train.trainer import Trainer

REFERENCE = "torch.distributed.pipelining.Schedule1F1B"


def worker(mesh, m: int = 8, layers: int = 8, d_model: int = 128, seq: int = 64,
           rows: int = 2, reps: int = 7, warmup: int = 2) -> dict | None:
    """On every rank: time both pipelines; rank 0 returns the report. PyTorch's side is
    ``edu3d train --pp N --impl torch``'s own construction
    (:class:`~edu3d.production.torch_impl.TorchTrainer`): the same cut into stages, its
    modules run by ``PipelineStage`` and ``Schedule1F1B``."""
    config = config_from("tiny", layers=layers, heads=4, d_model=d_model, seq=seq, vocab=64)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
    x, y = corpus.batch(1, m * rows)
    pp = mesh.size("pp")

    args = Run.of(schedule="1f1b", microbatches=m, pp=pp)
    ours = Trainer(GPT(config, seed=0), mesh, args)
    theirs = TorchTrainer(GPT(config, seed=0), mesh, args.replace(impl="torch"))

    def edu3d_step():
        ours.forward_backward(x, y)

    def torch_step():
        theirs.forward_backward(x, y)

    times = bench.interleaved_medians({"edu3d": edu3d_step, "torch": torch_step}, reps=reps,
                                      warmup=warmup, group=mesh.groups["world"])
    # the two computed the same thing: same weights, same batch -> same gradients
    err = max(float((a.grad - b.grad).norm() / b.grad.norm().clamp_min(1e-12))
              for a, b in zip(ours.par.module.parameters(), theirs.params))
    err_t = torch.tensor([err], dtype=torch.float64)
    dist.all_reduce(err_t, op=dist.ReduceOp.MAX)
    share = bench.comm_shares(edu3d_step)  # after the comparison: it adds to the gradients
    if mesh.rank != 0:
        return None
    return bench.report("pp", pp, layout=bench.layout_name(pp=pp), results=[bench.result(
        "1f1b", times["edu3d"], REFERENCE, times["torch"], tokens=x.numel(), comm_share=share,
        microbatches=m, layers=layers,
        d_model=d_model, seq=seq, rows_per_microbatch=rows,
        max_grad_rel_diff=float(err_t.item()))])


def run_benchmark(nprocs: int = 4, json_out: bool = False, **opts) -> dict:
    """Launch ``nprocs`` pipeline ranks (gloo on CPU), time both, return the report."""
    run = launch(worker, nprocs, kwargs=opts, layout=Layout(pp=nprocs), timeout=600,
                 echo=not json_out, name="bench-pp")
    return run.results[0]
