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
from tests.adamw_noise import beyond, beyond_records, serial_and_control, without_key_bias

TOL = 1e-5  # the gradient noise the parity checks accept, relative (tests/adamw_noise.py)


def _args(optimizer: str) -> Run:
    # AdamW turns fp32 rounding in tiny gradients into large updates (tests/adamw_noise.py
    # allows for it, entry by entry); lr 1e-3 with 10 warmup steps keeps those first updates
    # small, so what it allows stays small (see tests/test_dp.py, same convention)
    if optimizer == "sgd":
        return Run.of(lr=0.1, clip=1.0, weight_decay=0.1, optimizer="sgd", warmup=0)
    return Run.of(lr=1e-3, clip=1.0, weight_decay=0.1, optimizer="adamw", warmup=10)


def _pipeline(args: Run, cfg: dict) -> Run:
    """``args`` with the pipeline options of ``cfg``."""
    return args.replace(schedule=cfg["schedule"], microbatches=cfg["m"],
                               vpp=cfg.get("vpp", 1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@functools.lru_cache(maxsize=None)
def serial_reference(layers: int, batch: int, adam_steps: int) -> dict:
    """The serial GPT's reference for one model and global batch: its loss and gradients
    after one backward on batch 1, and its records and weights after ``adam_steps`` AdamW
    steps (the serial loop of :mod:`edu3d.train.loop`) with what rounding can do to them
    (:func:`tests.adamw_noise.serial_and_control`). It depends on
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
        args = _args("adamw")

        def build():
            model = GPT(config, seed=0)
            return model, make_optimizer(model, args)

        def train(model, opt):
            return [train_step(model, opt, *corpus.batch(step, batch), step, args)
                    for step in range(1, adam_steps + 1)]

        out["adamw"] = serial_and_control(build, train, TOL)
    return out


def _errors(trainer, par, ref: dict, what: str, allowed: dict | None = None) -> float:
    """Worst relative error of this rank's gradients or weights of ``par`` against the
    serial tensors ``ref`` (by name); with ``allowed`` (weights after AdamW), of what is left
    beyond each entry's allowed move (:mod:`tests.adamw_noise`)."""
    mine = {id(p) for p in trainer.par.module.parameters()}
    worst = 0.0
    for name, p in par.named_parameters():
        if id(p) in mine:
            a, b = (p.grad if what == "grad" else p.data), ref[name]
            err = _rel(a, b) if allowed is None else beyond(
                without_key_bias(name, a), without_key_bias(name, b), allowed[name])
            worst = max(worst, err)
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
            par, adamw = GPT(config, seed=0), ref["adamw"]
            tr = Trainer(par, mesh, _pipeline(_args("adamw"), cfg))
            ours = [tr.step(*corpus.batch(step, batch), step)
                    for step in range(1, adam_steps + 1)]
            row["weight_err"] = _errors(tr, par, adamw["final"], "weight", adamw["allowed"])
            row["norm_err"] = beyond_records(ours, adamw, row["grad_err"], ("grad_norm",))
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
