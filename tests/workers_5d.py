"""Rank functions for the 5D parity tests (context and expert parallelism, launched with
edu3d.launch.api): every layout of a world size runs in one launch, on its own mesh
(:func:`launch_parity`), against the serial reference computed in the test process
(:func:`serial_reference`); :func:`assert_parity` is the comparison both
``tests/test_5d_parity.py`` and ``tests/test_aux_scope.py`` make."""

from __future__ import annotations

import torch

from edu3d.commands.train import parse
from edu3d.distributed.mesh import Mesh
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import reference_microbatches, train_step
from edu3d.train.optim import make_optimizer
from edu3d.config.sections import Run
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer
from tests.adamw_noise import beyond, beyond_records, serial_and_control, without_key_bias

SGD = ["--optimizer", "sgd", "--lr", "0.1", "--clip", "0"]
MODEL = "--layers 2 --d-model 32 --heads 4 --seq 16 --vocab 64 --global-batch 8"
MOE = "--experts 4 --topk 2"
ERRORS = ("grad_err", "norm0_err", "param_err", "loss_err", "norm_err", "final_err")


def options(argv: list[str]) -> Run:
    """``argv``'s options, checked, with the routers scored in float64 (a near-tie between
    two experts must not flip because TP or CP summed in another order)."""
    args = parse(argv).replace(router_dtype="fp64")
    check_args(args)
    return args


def argv_of(flags: str) -> list[str]:
    """The command line of the tests' model (:data:`MODEL`) with a layout's ``flags``."""
    return f"{MODEL} {flags}".split()


def world_size(argv: list[str]) -> int:
    """How many ranks ``argv``'s layout runs on."""
    return check_args(options(argv))[1].world_size


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def serial_reference(argv: list[str], steps: int, tol: float) -> dict:
    """The serial model on ``argv``'s model and data, micro-batch by micro-batch as the
    layout's ranks see them (:func:`~edu3d.train.loop.reference_microbatches`): the
    gradients of one backward (plain SGD), the weights after that SGD step, and the records
    and final weights of ``steps`` AdamW steps with what rounding can do to them: the
    control's records and each weight's allowed move (:mod:`tests.adamw_noise`, for
    gradient noise within ``tol``)."""
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

    def build():
        model = GPT(config, seed=adam.training.seed)
        return model, make_optimizer(model, adam)

    def train(model, opt):
        return [train_step(model, opt, *corpus.batch(s, adam.batch.global_batch), s, adam, m)
                for s in range(1, steps + 1)]

    return {"grads": grads, "params": params, "first_norm": first["grad_norm"],
            **serial_and_control(build, train, tol)}


def parity(mesh, argv: list[str], ref: dict) -> dict:
    """The layout ``argv`` against ``ref`` (:func:`serial_reference`): worst relative errors
    of the gradients (plain SGD, clipping off), of the weights after that SGD step, of the
    AdamW losses and norms and of the weights after the AdamW steps (beyond what rounding
    explains there, :mod:`tests.adamw_noise`)."""
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
    out["loss_err"] = beyond_records(ours, ref, out["grad_err"], ("loss",))
    out["norm_err"] = beyond_records(ours, ref, out["grad_err"], ("grad_norm",))
    final = trainer.gather("param")
    out["final_err"] = max(beyond(without_key_bias(n, final[n]), without_key_bias(n, p),
                                  ref["allowed"][n])
                           for n, p in ref["final"].items())
    out["final_raw"] = max(rel(without_key_bias(n, final[n]), without_key_bias(n, p))
                           for n, p in ref["final"].items())  # printed: what was allowed
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


def launch_parity(layouts: dict[str, str], world: int, steps: int, tol: float,
                  name: str) -> dict[str, dict]:
    """Every layout of ``layouts`` (its name to its flags, :func:`argv_of`) that runs on
    ``world`` ranks, in one launch called ``name``, against its serial reference of ``steps``
    AdamW steps: each layout's name to :func:`parity`'s errors."""
    argvs = {n: argv_of(flags) for n, flags in layouts.items()}
    names = [n for n, argv in argvs.items() if world_size(argv) == world]
    cases = [(argvs[n], serial_reference(argvs[n], steps, tol)) for n in names]
    first = check_args(options(cases[0][0]))[1]
    run = launch(parity_all, world, args=(cases,), layout=first, timeout=400, name=name)
    return dict(zip(names, run.results[0]))


def assert_parity(label: str, res: dict, tol: float) -> None:
    """Print a layout's errors (``res``, from :func:`parity`) after ``label`` and assert each
    is below ``tol``."""
    print(f"\n{label}: grad {res['grad_err']:.1e} norm {res['norm0_err']:.1e} "
          f"param {res['param_err']:.1e} loss {res['loss_err']:.1e} "
          f"final {res['final_err']:.1e} (before the allowance {res['final_raw']:.1e})")
    for key in ERRORS:
        assert res[key] < tol, (key, res[key])
