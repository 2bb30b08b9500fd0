"""Rank functions for tests/test_freeze.py: a layout with ``--freeze`` against the serial GPT
frozen by hand (``requires_grad_(False)`` on the names ``fnmatch`` picks), which shares no code
with edu3d's ``--freeze``."""

from __future__ import annotations

import fnmatch

import torch

from edu3d.model.gpt import GPT
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import train_step
from edu3d.train.optim import make_optimizer
from edu3d.train.preflight import model_config
from edu3d.train.trainer import Trainer
from tests.adamw_noise import beyond, beyond_records, serial_and_control, without_key_bias
from tests.workers_3d import options

# bad --freeze inputs and the one-line refusal each gets, from edu3d train and edu3d plan alike
BAD_FREEZE = [
    (["--freeze", "tok.*"], "--freeze 'tok.*' matches no parameter"),
    (["--freeze", "lm_head.*", "--tie"], "matches no parameter"),
    (["--freeze", "*"], "nothing would train"),
    (["--freeze", "tok_emb.*,"], "no empty glob"),
]


def frozen_serial(args) -> GPT:
    model = GPT(model_config(args), seed=args.training.seed)
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, g.strip()) for g in args.memory.freeze):
            p.requires_grad_(False)
    return model


def serial_reference(argv: list[str], steps: int, tol: float = 1e-5) -> dict:
    """Gradients of one backward (None for a frozen parameter), weights after one plain-SGD
    step, and the records and weights after ``steps`` AdamW steps, of the hand-frozen GPT,
    with what rounding can do to the latter (:mod:`tests.adamw_noise`, for gradient noise
    within ``tol``)."""
    sgd = options([*argv, "--optimizer", "sgd", "--lr", "0.1"])
    corpus = SyntheticCorpus(model_config(sgd).vocab_size, model_config(sgd).seq_len,
                             seed=sgd.training.seed)
    x, y = corpus.batch(1, sgd.batch.global_batch)
    model = frozen_serial(sgd)
    model(x, y)[1].backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model = frozen_serial(sgd)
    train_step(model, make_optimizer(model, sgd), x, y, 1, sgd)
    sgd_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    adam = options(argv)

    def build():
        model = frozen_serial(adam)
        return model, make_optimizer(model, adam)

    def train(model, opt):
        return [train_step(model, opt, *corpus.batch(s, adam.batch.global_batch), s, adam)
                for s in range(1, steps + 1)]

    adamw = serial_and_control(build, train, tol)
    return {"grads": grads, "sgd_params": sgd_params, "records": adamw["records"],
            "control": adamw["control"], "tol": tol, "adam_params": adamw["final"],
            "allowed": adamw["allowed"],
            "init": {n: p.detach().clone() for n, p in GPT(model_config(adam),
                                                            seed=adam.training.seed).named_parameters()}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def parity(mesh, argv: list[str], ref: dict) -> dict:
    """The layout ``argv`` against ``ref``: worst relative errors of the trainable gradients
    (a frozen one must be absent: zero here), of the weights after SGD and after the AdamW
    steps, of the losses and norms (after AdamW, beyond what rounding explains there:
    :mod:`tests.adamw_noise`); and whether every frozen weight is bitwise its init."""
    sgd = options([*argv, "--optimizer", "sgd", "--lr", "0.1"])
    config = model_config(sgd)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=sgd.training.seed)
    x, y = corpus.batch(1, sgd.batch.global_batch)
    trainer = Trainer(GPT(config, seed=sgd.training.seed), mesh, sgd)
    trainer.forward_backward(x, y)
    grads = trainer.gather("grad")
    grad_err = max(_rel(grads[n], g) for n, g in ref["grads"].items() if g is not None)
    frozen = [n for n, g in ref["grads"].items() if g is None]
    frozen_grad_zero = all(not grads[n].any() for n in frozen)
    trainer = Trainer(GPT(config, seed=sgd.training.seed), mesh, sgd)
    trainer.step(x, y, 1)
    params = trainer.gather("param")
    sgd_err = max(_rel(params[n], p) for n, p in ref["sgd_params"].items())
    adam = options(argv)
    trainer = Trainer(GPT(config, seed=adam.training.seed), mesh, adam)
    ours = [trainer.step(*corpus.batch(s, adam.batch.global_batch), s)
            for s in range(1, len(ref["records"]) + 1)]
    params = trainer.gather("param")
    adam_err = max(beyond(without_key_bias(n, params[n]), without_key_bias(n, p),
                          ref["allowed"][n]) for n, p in ref["adam_params"].items())
    return {"grad_err": grad_err, "sgd_err": sgd_err, "adam_err": adam_err,
            "loss_err": beyond_records(ours, ref, grad_err, ("loss",)),
            "norm_err": beyond_records(ours, ref, grad_err, ("grad_norm",)),
            "frozen": frozen, "frozen_grad_zero": frozen_grad_zero,
            "frozen_bitwise": all(torch.equal(params[n], ref["init"][n]) for n in frozen),
            "optimizer_state_of_frozen": _state_of_frozen(trainer)}


def _state_of_frozen(trainer) -> int:
    """Optimizer-state tensors this rank holds for frozen parameters (must be 0)."""
    frozen = [p for p in trainer.par.module.parameters() if not p.requires_grad]
    held = [p for opt in trainer._optimizers() for p in opt.state]
    return sum(1 for p in frozen for q in held if q is p)


def parity_many(mesh, argvs: list[list[str]], refs: list[dict]) -> list[dict]:
    return [parity(mesh, argv, ref) for argv, ref in zip(argvs, refs, strict=True)]
