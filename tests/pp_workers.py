"""Rank functions for the pipeline tests (launched with edu3d.launch)."""

from __future__ import annotations

from argparse import Namespace

import torch

from edu3d.data import SyntheticCorpus
from edu3d.model import GPT, config_from
from edu3d.course import unscaled_loss
from edu3d.trainer import Trainer
from edu3d.train import make_optimizer, train_step


def _args(optimizer: str) -> Namespace:
    # AdamW turns fp32 rounding in tiny gradients into full-size updates; lr 1e-3 with 10
    # warmup steps keeps that floor below 1e-5 (see tests/test_dp.py, same convention).
    if optimizer == "sgd":
        return Namespace(lr=0.1, clip=1.0, weight_decay=0.1, optimizer="sgd", warmup=0)
    return Namespace(lr=1e-3, clip=1.0, weight_decay=0.1, optimizer="adamw", warmup=10)


def _pipeline(args: Namespace, cfg: dict) -> Namespace:
    """``args`` with the pipeline options of ``cfg``."""
    return Namespace(**vars(args), schedule=cfg["schedule"], microbatches=cfg["m"],
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


def _errors(trainer, par, ref, what: str) -> float:
    mine = {id(p) for p in trainer.par.module.parameters()}
    refs = dict(ref.named_parameters())
    worst = 0.0
    for name, p in par.named_parameters():
        if id(p) in mine:
            a, b = (p.grad, refs[name].grad) if what == "grad" else (p.data, refs[name].data)
            worst = max(worst, _rel(_comparable(name, a), _comparable(name, b)))
    return worst


def parity(mesh, configs: list[dict], adam_steps: int = 10) -> list[dict]:
    """For each config: gradient error after one step and weight error after
    ``adam_steps`` AdamW steps, relative to the serial GPT, on this rank's parameters."""
    out = []
    for cfg in configs:
        config = config_from("tiny", layers=cfg["layers"], heads=2, d_model=16, seq=8,
                             vocab=32)
        corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
        batch = mesh.size("dp") * cfg["m"] * cfg.get("rows", 1)
        row = dict(cfg)
        # 1) gradients, plain SGD (Adam would hide a wrong scale)
        par, ref = GPT(config, seed=0), GPT(config, seed=0)
        tr = Trainer(par, mesh, _pipeline(_args("sgd"), cfg),
                     microbatch_loss=None if cfg.get("scale_loss", True) else unscaled_loss)
        x, y = corpus.batch(1, batch)
        loss = tr.forward_backward(x, y)
        _, ref_loss = ref(x, y)
        ref_loss.backward()
        row["grad_err"] = _errors(tr, par, ref, "grad")
        row["loss_err"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        row["peak_in_flight"] = tr.engine.peak_in_flight
        # 2) weights after AdamW steps
        if adam_steps:
            par, ref = GPT(config, seed=0), GPT(config, seed=0)
            args = _args("adamw")
            tr = Trainer(par, mesh, _pipeline(args, cfg))
            opt = make_optimizer(ref, args)
            for step in range(1, adam_steps + 1):
                x, y = corpus.batch(step, batch)
                rec = tr.step(x, y, step)
                ref_rec = train_step(ref, opt, x, y, step, args)
            row["weight_err"] = _errors(tr, par, ref, "weight")
            row["norm_err"] = abs(rec["grad_norm"] - ref_rec["grad_norm"]) / ref_rec["grad_norm"]
        out.append(row)
    return out


def train_records(mesh, argv: list[str], steps: int) -> list[dict]:
    """``edu3d train``'s per-step records through :func:`build_trainer` (what the lead wires)."""
    import argparse

    from edu3d.train import add_arguments, build_trainer, check_args, config_from_args

    args = add_arguments(argparse.ArgumentParser()).parse_args(argv)
    check_args(args)
    config = config_from_args(args)
    trainer = build_trainer(GPT(config, seed=args.seed), mesh, args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.seed)
    out = []
    for step in range(1, steps + 1):
        x, y = corpus.batch(step, args.global_batch)
        out.append(trainer.step(x, y, step))
    return out
