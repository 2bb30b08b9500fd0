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


def parity(mesh, argv: list[str]) -> dict:
    """Gradients of one step (plain SGD), the weights after it, and 3 AdamW steps' losses,
    gradient norms and weights, each against the reference; the worst relative errors."""
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
    ref = GPT(config, seed=0)
    opt = make_optimizer(ref, adam)
    trainer = Trainer(GPT(config, seed=0), mesh, adam)
    errs, losses = [], []
    for step in range(1, ADAM_STEPS + 1):
        batch, _ = global_batch(corpus, adam, step)
        want = reference_step(ref, opt, batch, step, adam)
        got = trainer.step(batch, None, step)
        errs.append(abs(got["loss"] - want["loss"]) / want["loss"])
        errs.append(abs(got["grad_norm"] - want["grad_norm"]) / want["grad_norm"])
        losses.append(got["loss"])
    params = trainer.gather("param")
    out["adam_err"] = max(errs)
    # over the whole model, not per tensor: the key bias's gradient is exactly 0 in exact
    # arithmetic (softmax ignores a constant added to every key's score), so a run and its
    # reference differ there only by rounding, which AdamW's g / sqrt(v) scales up to a
    # visible share of a bias that starts at 0 (3.5e-6 absolute after 3 steps, serially)
    names = [n for n, _ in ref.named_parameters()]
    out["param_err"] = _rel(torch.cat([params[n].flatten() for n in names]),
                            torch.cat([p.detach().flatten() for p in ref.parameters()]))
    out["losses"] = losses
    return out


def parity_many(mesh, argvs: list[list[str]]) -> list[dict]:
    """:func:`parity` for every argv, each on a mesh of its own layout (the launched one, or
    one built here: ``new_group`` is collective, every rank builds it)."""
    out = []
    for argv in argvs:
        _, layout = check_args(parse(argv))
        here = mesh if layout == mesh.layout else Mesh.build(layout)
        out.append(parity(here, argv))
        if here is not mesh:
            here.release()
    return out
