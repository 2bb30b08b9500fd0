"""Rank functions for the 3D parity tests (launched with edu3d.launch.api)."""

from __future__ import annotations


import torch

from edu3d.train.data import SyntheticCorpus
from edu3d.model.gpt import GPT
from edu3d.train.optim import make_optimizer
from edu3d.commands.train import parse
from edu3d.config.sections import Run
from edu3d.train.preflight import check_args, model_config
from edu3d.train.loop import train_step
from edu3d.train.trainer import Trainer
from tests.adamw_noise import beyond_records, serial_and_control

TOL = 1e-5  # the gradient noise the parity checks accept, relative (tests/adamw_noise.py)


def options(argv: list[str]) -> Run:
    args = parse(argv)
    check_args(args)
    return args


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def zero_traffic(mesh, configs: list[tuple[int, int]]) -> list[dict]:
    """One step of dp2 x pp2 with ZeRO ``stage`` and ``m`` micro-batches per config, traced as
    ``case="zero{stage}/m{m}"``; returns each config's Ψ of this rank's stage."""
    from edu3d.distributed import trace

    out = []
    for stage, m in configs:
        args = options(["--dp", "2", "--pp", "2", "--zero", str(stage), "--microbatches",
                        str(m), "--grad-reduce", "per-step"])
        config = model_config(args)
        x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0).batch(1, 8)
        trainer = Trainer(GPT(config, seed=0), mesh, args)
        with trace.current().context(case=f"zero{stage}/m{m}"):
            trainer.step(x, y, 1)
        out.append({"stage": stage, "m": m,
                    "psi": sum(u.numel for u in trainer.par.zero.units)})
    return out


# ---- the serial reference computed once, outside the ranks ---------------------------------
def serial_key(argv: list[str]) -> tuple:
    """What the serial reference reads of the options ``argv``: the model, the
    data and the optimizer (with the SGD variant's overrides), never the layout. Layouts with
    the same key share one serial reference."""
    out = []
    for args in (options([*argv, "--optimizer", "sgd", "--lr", "0.1"]), options(argv)):
        out.append((repr(model_config(args)), args.training.seed, args.batch.global_batch, args.training.optimizer,
                    args.training.lr, args.training.clip, args.training.warmup, args.training.weight_decay,
                    args.training.lr_schedule, args.training.steps))
    return tuple(out)


def serial_reference(argv: list[str], steps: int) -> dict:
    """The serial half of the parity check for the options ``argv``: the gradients of one
    backward, the weights after one plain-SGD step, and the records of ``steps`` AdamW
    steps with those of their control (what rounding can do through AdamW,
    :mod:`tests.adamw_noise`), all from :mod:`edu3d.train.loop`'s serial reference step."""
    sgd = options([*argv, "--optimizer", "sgd", "--lr", "0.1"])
    config = model_config(sgd)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=sgd.training.seed)
    x, y = corpus.batch(1, sgd.batch.global_batch)
    serial = GPT(config, seed=sgd.training.seed)
    serial(x, y)[1].backward()
    grads = {n: p.grad for n, p in serial.named_parameters()}
    serial = GPT(config, seed=sgd.training.seed)
    train_step(serial, make_optimizer(serial, sgd), x, y, 1, sgd)
    params = {n: p.detach() for n, p in serial.named_parameters()}
    adam = options(argv)

    def build():
        model = GPT(config, seed=adam.training.seed)
        return model, make_optimizer(model, adam)

    def train(model, opt):
        return [train_step(model, opt, *corpus.batch(s, adam.batch.global_batch), s, adam)
                for s in range(1, steps + 1)]

    adamw = serial_and_control(build, train, TOL)
    return {"grads": grads, "params": params, "records": adamw["records"],
            "control": adamw["control"], "tol": TOL}


def parity(mesh, argv: list[str], ref: dict) -> dict:
    """The layout ``argv`` against the serial reference ``ref`` (:func:`serial_reference`'s
    result for the same model, data and optimizer, computed once outside the ranks):
    gradients (plain SGD, before and after one step: the weights it produced), and the
    losses and norms of the AdamW steps (beyond what rounding explains there,
    :func:`tests.adamw_noise.beyond_records`). Worst relative errors over every tensor, and
    the losses themselves."""
    sgd = options([*argv, "--optimizer", "sgd", "--lr", "0.1"])
    config = model_config(sgd)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=sgd.training.seed)
    x, y = corpus.batch(1, sgd.batch.global_batch)

    trainer = Trainer(GPT(config, seed=sgd.training.seed), mesh, sgd)
    trainer.forward_backward(x, y)
    grads = trainer.gather("grad")
    grad_err = max(_rel(grads[n], g) for n, g in ref["grads"].items())

    trainer = Trainer(GPT(config, seed=sgd.training.seed), mesh, sgd)
    trainer.step(x, y, 1)
    params = trainer.gather("param")
    param_err = max(_rel(params[n], p) for n, p in ref["params"].items())

    adam = options(argv)
    trainer = Trainer(GPT(config, seed=adam.training.seed), mesh, adam)
    ours = [trainer.step(*corpus.batch(s, adam.batch.global_batch), s)
            for s in range(1, len(ref["records"]) + 1)]
    loss_err = beyond_records(ours, ref, grad_err, ("loss",))
    norm_err = beyond_records(ours, ref, grad_err, ("grad_norm",))
    return {"grad_err": grad_err, "param_err": param_err, "loss_err": loss_err,
            "norm_err": norm_err, "losses": [r["loss"] for r in ours],
            "serial_losses": [r["loss"] for r in ref["records"]]}


def parity_many(mesh, argvs: list[list[str]], refs: list[dict]) -> list[dict]:
    """:func:`parity` for several option sets of the same layout, in one launch."""
    return [parity(mesh, argv, ref) for argv, ref in zip(argvs, refs, strict=True)]
