"""Rank functions for the recomputation tests (launched with edu3d.launch.api, or called with
``mesh=None`` for one process)."""

from __future__ import annotations

import torch

from edu3d.train.data import SyntheticCorpus
from edu3d.model.gpt import GPT
from edu3d.train.optim import make_optimizer
from edu3d.train.preflight import model_config
from edu3d.train.loop import train_step
from edu3d.train.trainer import Trainer
from tests.workers_3d import options

MODES = ("none", "selective", "full")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def compare(mesh, argv: list[str], steps: int = 2) -> dict:
    """The layout ``argv`` with each recompute mode against the same layout without it:
    gradients of one plain-SGD step (worst relative error over every tensor, and whether
    they are bitwise equal), and the losses and norms of ``steps`` AdamW steps; plus the
    serial reference's gradients, for the whole chain. Also the activation bytes the
    trainer reports (its pipeline engine's peak, this rank) per mode."""
    sgd = options([*argv, "--optimizer", "sgd", "--lr", "0.1"])
    config = model_config(sgd)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=sgd.training.seed)
    x, y = corpus.batch(1, sgd.batch.global_batch)
    serial = GPT(config, seed=sgd.training.seed)
    serial(x, y)[1].backward()

    grads, runs, act = {}, {}, {}
    for mode in MODES:
        sgd = sgd.replace(recompute=mode)
        trainer = Trainer(GPT(config, seed=sgd.training.seed), mesh, sgd)
        trainer.forward_backward(x, y)
        grads[mode] = trainer.gather("grad")
        act[mode] = trainer.engine.peak_activation_bytes
        adam = options(argv)
        adam = adam.replace(recompute=mode)
        trainer = Trainer(GPT(config, seed=adam.training.seed), mesh, adam)
        runs[mode] = [trainer.step(*corpus.batch(s, adam.batch.global_batch), s)
                      for s in range(1, steps + 1)]
    out = {"activations": act,
           "serial_grad_err": max(_rel(grads["none"][n], p.grad)
                                  for n, p in serial.named_parameters())}
    ref = grads["none"]
    for mode in MODES[1:]:
        out[mode] = {
            "grad_err": max(_rel(grads[mode][n], ref[n]) for n in ref),
            "grad_exact": all(torch.equal(grads[mode][n], ref[n]) for n in ref),
            "loss_err": max(abs(a["loss"] - b["loss"]) / abs(b["loss"])
                            for a, b in zip(runs[mode], runs["none"])),
            "norm_err": max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"]
                            for a, b in zip(runs[mode], runs["none"])),
        }
    out["losses"] = [r["loss"] for r in runs["full"]]
    return out


def compare_many(mesh, argvs: list[list[str]], steps: int = 2) -> list[dict]:
    """:func:`compare` for several option sets on the same mesh, in one launch."""
    return [compare(mesh, argv, steps) for argv in argvs]


def serial_adamw(argv: list[str], mode: str, steps: int = 3) -> list[dict]:
    """``steps`` AdamW steps of the serial reference model with ``mode`` applied directly
    (no Trainer), for the serial test."""
    from edu3d.parallel.recompute import apply_recompute

    args = options(argv)
    config = model_config(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    model = apply_recompute(GPT(config, seed=args.training.seed), mode)
    opt = make_optimizer(model, args)
    return [train_step(model, opt, *corpus.batch(s, args.batch.global_batch), s, args)
            for s in range(1, steps + 1)]


def all_checks(mesh, argvs: list[list[str]], dp4_argvs: list[list[str]], config) -> dict:
    """Everything the launched recompute test checks, in one launch of 8 ranks:
    :func:`compare_many` on the dp2-tp2-pp2 ``mesh``, then on a dp4-tp2 mesh of the same
    ranks; one layer's saved bytes at tp = 1, 2, 4 (:func:`edu3d.course.ch07_memory.recompute_sweep`,
    untimed); the tp collectives of one layer per mode (:func:`tp_comm_counts`); and ``edu3d
    bench recompute`` at tp 2, one repetition (it refuses to time unless edu3d's gradients
    equal PyTorch's checkpoint wrappers')."""
    from edu3d.course.ch07_memory import recompute_sweep
    from edu3d.config.layout import Layout
    from edu3d.distributed.mesh import Mesh

    from edu3d.bench.bench_recompute import recompute_benchmark

    flat = Mesh.build(Layout(dp=4, tp=2))
    return {"3d": compare_many(mesh, argvs), "dp4": compare_many(flat, dp4_argvs),
            "sweep": recompute_sweep(flat, config, batch=2, time_repeats=0, max_tp=4),
            "comm": tp_comm_counts(flat, config),
            "bench": recompute_benchmark(flat, reps=1, batch=2, config=config)}


def tp_comm_counts(mesh, config, batch: int = 2) -> dict:
    """The tp collectives of one layer's forward and backward (from the trace), for SP off
    and on and each recompute mode: a recomputed block repeats its forward's collectives in
    backward (as far as the last tensor it has to re-save)."""
    from collections import Counter

    from edu3d.distributed import trace
    from edu3d.course.ch07_memory import _input, _model
    from edu3d.parallel.tp import ops

    out = {}
    for sp in (False, True):
        for mode in MODES:
            block = _model(config, mesh.tp, sp, mode).blocks[0]
            x = _input(config, batch, mesh.size("tp"), ops.group_rank(mesh.tp), sp)
            with trace.use(trace.Recorder(mesh.rank)) as rec:
                y = block(x)
                fwd = Counter(e["op"] for e in rec.events if e["lane"] == "comm")
                rec.events.clear()
                y.backward(torch.ones_like(y))
                bwd = Counter(e["op"] for e in rec.events if e["lane"] == "comm")
            out[f"{'sp' if sp else 'tp'} {mode}"] = {"forward": dict(fwd), "backward": dict(bwd)}
    return out
