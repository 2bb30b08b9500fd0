"""Rank functions for the 5D parity tests (context and expert parallelism, launched with
edu3d.launch.api): every layout of a world size runs in one launch, on its own mesh."""

from __future__ import annotations


import torch

from edu3d.commands.train import parse
from edu3d.distributed.mesh import Mesh
from edu3d.model.gpt import GPT
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import reference_microbatches, train_step
from edu3d.train.optim import make_optimizer
from edu3d.config.sections import Run
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer

SGD = ["--optimizer", "sgd", "--lr", "0.1", "--clip", "0"]


def options(argv: list[str]) -> Run:
    """``argv``'s options, checked, with the routers scored in float64 (a near-tie between
    two experts must not flip because TP or CP summed in another order)."""
    args = parse(argv).replace(router_dtype="fp64")
    check_args(args)
    return args


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def without_key_bias(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t``, with the key third of an attention's qkv bias set to 0. That bias adds the same
    ``q·b_k`` to every score of a query, which softmax cancels: its true gradient is exactly
    0, so what any run computes there is rounding noise, and AdamW divides noise by its own
    root mean square into steps of size lr. Compared after AdamW steps, it is left out."""
    if not name.endswith("attn.qkv.bias"):
        return t
    t = t.clone()
    third = t.shape[0] // 3
    t[third:2 * third] = 0
    return t


def serial_reference(argv: list[str], steps: int) -> dict:
    """The serial model on ``argv``'s model and data, micro-batch by micro-batch as the
    layout's ranks see them (:func:`~edu3d.train.loop.reference_microbatches`): the
    gradients of one backward (plain SGD), the weights after that SGD step, and the records
    and final weights of ``steps`` AdamW steps."""
    sgd = options([*argv, *SGD])
    m = reference_microbatches(sgd)
    config = model_config(sgd)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=sgd.training.seed)
    x, y = corpus.batch(1, sgd.batch.global_batch)
    serial = GPT(config, seed=sgd.training.seed)
    first = train_step(serial, torch.optim.SGD(serial.parameters(), lr=0.0), x, y, 1, sgd, m)
    grads = {n: p.grad.clone() for n, p in serial.named_parameters()}
    serial = GPT(config, seed=sgd.training.seed)
    train_step(serial, make_optimizer(serial, sgd), x, y, 1, sgd, m)
    params = {n: p.detach().clone() for n, p in serial.named_parameters()}
    adam = options(argv)
    serial = GPT(config, seed=adam.training.seed)
    opt = make_optimizer(serial, adam)
    records = [train_step(serial, opt, *corpus.batch(s, adam.batch.global_batch), s, adam, m)
               for s in range(1, steps + 1)]
    final = {n: p.detach().clone() for n, p in serial.named_parameters()}
    return {"grads": grads, "params": params, "records": records, "final": final,
            "first_norm": first["grad_norm"]}


def parity(mesh, argv: list[str], ref: dict) -> dict:
    """The layout ``argv`` against ``ref`` (:func:`serial_reference`): worst relative errors
    of the gradients (plain SGD, clipping off), of the weights after that SGD step, of the
    AdamW losses and norms, and of the weights after the AdamW steps."""
    sgd = options([*argv, *SGD])
    config = model_config(sgd)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=sgd.training.seed)
    x, y = corpus.batch(1, sgd.batch.global_batch)
    out = {}

    trainer = Trainer(GPT(config, seed=sgd.training.seed), mesh, sgd)
    trainer.forward_backward(x, y)
    grads = trainer.gather("grad")
    out["grad_err"] = max(rel(grads[n], g) for n, g in ref["grads"].items())
    out["norm0_err"] = abs(float(trainer.grads.norm()) - ref["first_norm"]) / ref["first_norm"]
    if trainer.par.expert_dp is not None and mesh.size("edp") > 1:
        # the rule under test: experts summed over edp but divided by dp x cp. Divide by edp
        # instead and the experts' gradients come out ep times too large.
        trainer = Trainer(GPT(config, seed=sgd.training.seed), mesh, sgd)
        trainer.par.expert_dp.n = mesh.size("edp")
        trainer.forward_backward(x, y)
        wrong = trainer.gather("grad")
        out["wrong_divisor_err"] = max(rel(wrong[n], g) for n, g in ref["grads"].items())

    trainer = Trainer(GPT(config, seed=sgd.training.seed), mesh, sgd)
    trainer.step(x, y, 1)
    params = trainer.gather("param")
    out["param_err"] = max(rel(params[n], p) for n, p in ref["params"].items())

    adam = options(argv)
    trainer = Trainer(GPT(config, seed=adam.training.seed), mesh, adam)
    ours = [trainer.step(*corpus.batch(s, adam.batch.global_batch), s)
            for s in range(1, len(ref["records"]) + 1)]
    pairs = list(zip(ours, ref["records"], strict=True))
    out["loss_err"] = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in pairs)
    out["norm_err"] = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"]
                          for a, b in pairs)
    final = trainer.gather("param")
    out["final_err"] = max(rel(without_key_bias(n, final[n]), without_key_bias(n, p))
                           for n, p in ref["final"].items())
    out["record"] = {k: v for k, v in ours[-1].items() if k not in ("loss", "grad_norm")}
    return out


def parity_all(mesh, cases: list[tuple[list[str], dict]]) -> list[dict]:
    """:func:`parity` for every ``(argv, ref)``, each on a mesh of its own layout (the
    launched one, or one built here: ``new_group`` is collective, every rank builds it)."""
    out = []
    for argv, ref in cases:
        _, layout = check_args(options(argv))
        here = mesh if layout == mesh.layout else Mesh.build(layout)
        out.append(parity(here, argv, ref))
    return out
