"""Rank functions for the pipeline tests (launched with edu3d.launch.api)."""

from __future__ import annotations

import functools

import torch

from edu3d.train.data import SyntheticCorpus
from edu3d.model.gpt import GPT, config_from
from edu3d.course import unscaled_loss
from edu3d.train.trainer import Trainer
from edu3d.train.loop import train_step
from edu3d.train.optim import make_optimizer
from edu3d.config.sections import Run
from edu3d.train.preflight import check_args, model_config


def _args(optimizer: str) -> Run:
    # AdamW turns fp32 rounding in tiny gradients into full-size updates; lr 1e-3 with 10
    # warmup steps keeps that floor below 1e-5 (see tests/test_dp.py, same convention).
    if optimizer == "sgd":
        return Run.of(lr=0.1, clip=1.0, weight_decay=0.1, optimizer="sgd", warmup=0)
    return Run.of(lr=1e-3, clip=1.0, weight_decay=0.1, optimizer="adamw", warmup=10)


def _pipeline(args: Run, cfg: dict) -> Run:
    """``args`` with the pipeline options of ``cfg``."""
    return args.replace(schedule=cfg["schedule"], microbatches=cfg["m"],
                               vpp=cfg.get("vpp", 1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _comparable(name: str, t: torch.Tensor) -> torch.Tensor:
    """Leave out the key bias: its true gradient is exactly zero (adding ``q·b_k`` to every
    score of a row does not change the softmax), so what is computed is rounding noise that
    Adam blows up to full-size updates, in the serial model split into micro-batches too."""
    if name.endswith("attn.qkv.bias"):
        q, _, v = t.chunk(3)
        return torch.cat([q, v])
    return t


@functools.lru_cache(maxsize=None)
def serial_reference(layers: int, batch: int, adam_steps: int) -> dict:
    """The serial GPT's reference for one model and global batch: its loss and gradients
    after one backward on batch 1, and its weights and last gradient norm after
    ``adam_steps`` AdamW steps (the serial loop of :mod:`edu3d.train.loop`). It depends on
    neither the schedule nor the layout, so the tests compute it once, in the test process,
    and hand it to the ranks (every rank computing the whole serial model for every config
    cost more than the pipeline runs under test)."""
    config = config_from("tiny", layers=layers, heads=2, d_model=16, seq=8, vocab=32)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
    ref = GPT(config, seed=0)
    x, y = corpus.batch(1, batch)
    _, loss = ref(x, y)
    loss.backward()
    out = {"loss": loss.item(), "grads": {n: p.grad for n, p in ref.named_parameters()}}
    if adam_steps:
        ref, args = GPT(config, seed=0), _args("adamw")
        opt = make_optimizer(ref, args)
        for step in range(1, adam_steps + 1):
            x, y = corpus.batch(step, batch)
            rec = train_step(ref, opt, x, y, step, args)
        out["weights"] = {n: p.data for n, p in ref.named_parameters()}
        out["grad_norm"] = rec["grad_norm"]
    return out


def _errors(trainer, par, ref: dict, what: str) -> float:
    """Worst relative error of this rank's gradients or weights of ``par`` against the
    serial tensors ``ref`` (by name)."""
    mine = {id(p) for p in trainer.par.module.parameters()}
    worst = 0.0
    for name, p in par.named_parameters():
        if id(p) in mine:
            a = p.grad if what == "grad" else p.data
            worst = max(worst, _rel(_comparable(name, a), _comparable(name, ref[name])))
    return worst


def global_batch(cfg: dict, dp: int) -> int:
    return dp * cfg["m"] * cfg.get("rows", 1)


def parity(mesh, configs: list[dict], refs: list[dict], adam_steps: int = 3) -> list[dict]:
    """For each config: gradient error after one step and weight error after
    ``adam_steps`` AdamW steps, relative to the serial GPT (``refs``, one
    :func:`serial_reference` per config), on this rank's parameters. (Three steps carry
    AdamW's state through two updates after the first: later steps run the same code on the
    same state.)"""
    out = []
    for cfg, ref in zip(configs, refs, strict=True):
        config = config_from("tiny", layers=cfg["layers"], heads=2, d_model=16, seq=8,
                             vocab=32)
        corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
        batch = global_batch(cfg, mesh.size("dp"))
        row = dict(cfg)
        # 1) gradients, plain SGD (Adam would hide a wrong scale)
        par = GPT(config, seed=0)
        tr = Trainer(par, mesh, _pipeline(_args("sgd"), cfg),
                     microbatch_loss=None if cfg.get("scale_loss", True) else unscaled_loss)
        x, y = corpus.batch(1, batch)
        loss = tr.forward_backward(x, y)
        row["grad_err"] = _errors(tr, par, ref["grads"], "grad")
        row["loss_err"] = abs(loss.item() - ref["loss"]) / abs(ref["loss"])
        row["peak_in_flight"] = tr.engine.peak_in_flight
        # 2) weights after AdamW steps
        if adam_steps:
            par = GPT(config, seed=0)
            args = _args("adamw")
            tr = Trainer(par, mesh, _pipeline(args, cfg))
            for step in range(1, adam_steps + 1):
                x, y = corpus.batch(step, batch)
                rec = tr.step(x, y, step)
            row["weight_err"] = _errors(tr, par, ref["weights"], "weight")
            row["norm_err"] = abs(rec["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
        out.append(row)
    return out


def train_records(mesh, argv: list[str], steps: int) -> list[dict]:
    """``edu3d train``'s per-step records through the :class:`Trainer` (what the lead wires)."""
    from edu3d.commands.train import parse

    args = parse(argv)
    check_args(args)
    config = model_config(args)
    trainer = Trainer(GPT(config, seed=args.training.seed), mesh, args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    out = []
    for step in range(1, steps + 1):
        x, y = corpus.batch(step, args.batch.global_batch)
        out.append(trainer.step(x, y, step))
    return out
