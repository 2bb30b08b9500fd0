"""Rank functions for tests/test_batching.py: every --batching mode on a parallel layout
against the per-document reference (each document alone, no padding, no packing)."""

from __future__ import annotations

import torch

from edu3d.commands.train import parse
from edu3d.distributed.mesh import Mesh
from edu3d.model.gpt import GPT
from edu3d.train.batching import global_batch, make_corpus, per_document_loss
from edu3d.train.loop import clip_and_step
from edu3d.train.optim import make_optimizer
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer
from tests.adamw_noise import beyond, beyond_records, serial_and_control, without_key_bias

ADAM_STEPS = 3


def _options(argv):
    args = parse(argv)
    check_args(args)
    return args


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def reference_step(model, optimizer, batch, step, args) -> dict:
    """The serial reference: the per-document loss's gradient, clipped, one update."""
    optimizer.zero_grad(set_to_none=True)
    loss = per_document_loss(model, batch)
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    clip_and_step(optimizer, params, norm, step, args)
    return {"loss": loss.item(), "grad_norm": norm.item()}


def parity(mesh, argv: list[str], tol: float) -> dict:
    """Gradients of one step (plain SGD), and 3 AdamW steps' losses, gradient norms and
    weights, each against the reference; the worst relative errors (after AdamW, beyond what
    rounding explains there for gradient noise within ``tol``: :mod:`tests.adamw_noise`)."""
    sgd = _options([*argv, "--optimizer", "sgd", "--lr", "0.1"])
    config = model_config(sgd)
    corpus = make_corpus(sgd, config)
    batch, _ = global_batch(corpus, sgd, 1)
    ref = GPT(config, seed=0)
    ref_loss = per_document_loss(ref, batch)
    ref_loss.backward()
    trainer = Trainer(GPT(config, seed=0), mesh, sgd)
    loss = trainer.forward_backward(batch, None)
    grads = trainer.gather("grad")
    out = {"grad_err": max(_rel(grads[n], p.grad) for n, p in ref.named_parameters()),
           "loss0_err": abs(float(loss) - float(ref_loss.detach())) / float(ref_loss.detach())}
    adam = _options(argv)
    batches = [global_batch(corpus, adam, step)[0] for step in range(1, ADAM_STEPS + 1)]

    def build():
        model = GPT(config, seed=0)
        return model, make_optimizer(model, adam)

    def train(model, opt):
        return [reference_step(model, opt, b, step, adam) for step, b in enumerate(batches, 1)]

    ref = serial_and_control(build, train, tol)
    trainer = Trainer(GPT(config, seed=0), mesh, adam)
    ours = [trainer.step(b, None, step) for step, b in enumerate(batches, 1)]
    out["adam_err"] = beyond_records(ours, ref, out["grad_err"])
    # per tensor, beyond what rounding can move each weight through AdamW (tests/adamw_noise)
    params = trainer.gather("param")
    out["param_err"] = max(beyond(without_key_bias(n, params[n]), without_key_bias(n, w),
                                  ref["allowed"][n]) for n, w in ref["final"].items())
    out["losses"] = [r["loss"] for r in ours]
    return out


def parity_many(mesh, argvs: list[list[str]], tol: float) -> list[dict]:
    """:func:`parity` for every argv, each on a mesh of its own layout (the launched one, or
    one built here: ``new_group`` is collective, every rank builds it)."""
    out = []
    for argv in argvs:
        _, layout = check_args(parse(argv))
        here = mesh if layout == mesh.layout else Mesh.build(layout)
        out.append(parity(here, argv, tol))
        if here is not mesh:
            here.release()
    return out
