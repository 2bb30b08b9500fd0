"""Rank functions for the FP8 parity tests (launched with edu3d.launch.api): every layout
against its own emulated serial FP8 reference, and ZeRO-3's all-gather bytes."""

from __future__ import annotations

import torch

from edu3d.commands.train import parse
from edu3d.config.sections import Run
from edu3d.distributed import trace
from edu3d.model.gpt import GPT
from edu3d.parallel.fp8 import apply_fp8, end_step, split_units
from edu3d.parallel.fp8.fp8_linear import BLOCK_LINEARS
from edu3d.parallel.fp8.fp8_linear import to_fp8
from edu3d.parallel.tp import ColumnParallelLinear, RowParallelLinear, ops, shard
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import reference_microbatches, train_step
from edu3d.train.optim import make_optimizer
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer
from edu3d.parallel.zero.sharding import Zero
from edu3d.parallel.zero.units import model_units

SGD = ["--optimizer", "sgd", "--lr", "0.1"]


def options(argv: list[str]) -> Run:
    args = parse(argv)
    check_args(args)
    return args


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def serial_model(args: Run) -> GPT:
    """The serial reference model of ``args``: the GPT, its blocks in FP8 when asked."""
    model = GPT(model_config(args), seed=args.training.seed)
    if args.precision.dtype == "fp8":
        apply_fp8(model, args.precision)
    return model


def reference(argv: list[str], steps: int) -> dict:
    """The emulated serial FP8 run of ``argv``'s model, data and optimizer: one micro-batch
    per micro-batch of every data-parallel rank (an FP8 scale is a micro-batch's), so the
    casts are the layout's. Gradients of one backward, weights after one SGD step, records
    of ``steps`` AdamW steps."""
    sgd, adam = options([*argv, *SGD]), options(argv)
    micro = reference_microbatches(sgd)
    config = model_config(sgd)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=sgd.training.seed)
    x, y = corpus.batch(1, sgd.batch.global_batch)
    model = serial_model(sgd)
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        (model(xs, ys)[1] / micro).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model = serial_model(sgd)
    train_step(model, make_optimizer(model, sgd), x, y, 1, sgd, micro)
    params = {n: p.detach() for n, p in model.named_parameters()}
    model = serial_model(adam)
    opt = make_optimizer(model, adam)
    records = [train_step(model, opt, *corpus.batch(s, adam.batch.global_batch), s, adam, micro)
               for s in range(1, steps + 1)]
    return {"grads": grads, "params": params, "records": records}


def parity(mesh, argv: list[str], ref: dict) -> dict:
    """``argv``'s layout against :func:`reference`: worst relative errors of the gradients,
    of the weights after SGD, and of the AdamW losses and norms."""
    sgd, adam = options([*argv, *SGD]), options(argv)
    config = model_config(sgd)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=sgd.training.seed)
    x, y = corpus.batch(1, sgd.batch.global_batch)
    trainer = Trainer(GPT(config, seed=sgd.training.seed), mesh, sgd)
    trainer.forward_backward(x, y)
    grads = trainer.gather("grad")
    trainer = Trainer(GPT(config, seed=sgd.training.seed), mesh, sgd)
    trainer.step(x, y, 1)
    params = trainer.gather("param")
    trainer = Trainer(GPT(config, seed=adam.training.seed), mesh, adam)
    ours = [trainer.step(*corpus.batch(s, adam.batch.global_batch), s)
            for s in range(1, len(ref["records"]) + 1)]
    pairs = list(zip(ours, ref["records"], strict=True))
    return {"grad_err": max(_rel(grads[n], g) for n, g in ref["grads"].items()),
            "param_err": max(_rel(params[n], p) for n, p in ref["params"].items()),
            "loss_err": max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in pairs),
            "norm_err": max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"]
                            for a, b in pairs),
            "losses": [r["loss"] for r in ours]}


def parity_many(mesh, argvs: list[list[str]], refs: list[dict]) -> list[dict]:
    """:func:`parity` for several option sets of one layout, in one launch."""
    return [parity(mesh, argv, ref) for argv, ref in zip(argvs, refs, strict=True)]


def gather_bytes(mesh, cases: dict) -> dict:
    """One ZeRO-3 step per case (``name -> argv``) on the trainer, traced as ``case=name``,
    and the control ``case="bf16"``: the first case's model without FP8 layers, its units
    cut as FP8 cuts them, under FSDP2's mixed-precision policy (``param_dtype=bf16``: every
    gather in 2 bytes), one forward and backward. Returns each case's units
    ``[(name, numel, padded)]`` in ZeRO's order (the trace's ``chunk``)."""
    out = {}
    for name, argv in cases.items():
        args = options(argv)
        config = model_config(args)
        x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0).batch(1, 8)
        trainer = Trainer(GPT(config, seed=0), mesh, args)
        with trace.current().context(case=name):
            trainer.step(x, y, 1)
        out[name] = [(u.name, u.numel, u.padded) for u in trainer.par.zero.units]
    args = options(next(iter(cases.values())))
    config = model_config(args)
    x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0).batch(1, 8)
    model = GPT(config, seed=0)
    weights = {getattr(getattr(b, part), attr).weight for b in model.blocks
               for part, attr in BLOCK_LINEARS}
    zero = Zero(model, mesh.group("dpcp"), 3, units=split_units(model_units(model), weights),
                reduce_scatter=True, param_dtype=torch.bfloat16)
    with trace.current().context(case="bf16"):
        model(x[:4], y[:4])[1].float().backward()
        zero.finish()
    out["bf16"] = [(u.name, u.numel, u.padded) for u in zero.units]
    return out


def noise_floor(argv: list[str], steps: int, ref: dict, seeds: int = 2) -> dict:
    """What rounding alone does to an FP8 run: the serial reference again with every weight
    multiplied by ``1 + 2^-24·N(0, 1)`` (fp32's rounding, the size of the differences a
    layout's sums in another order make), the worst of ``seeds`` draws of each error
    :func:`parity` measures. FP8 amplifies such differences: an element within a rounding
    step's width of a midpoint between two FP8 numbers casts to the other one, and a flip
    in a gradient's amax element rescales the whole tensor."""
    sgd, adam = options([*argv, *SGD]), options(argv)
    micro = reference_microbatches(sgd)
    config = model_config(sgd)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=sgd.training.seed)
    x, y = corpus.batch(1, sgd.batch.global_batch)
    worst = {"grad_err": 0.0, "loss_err": 0.0, "norm_err": 0.0}

    def perturbed(args, seed):
        model = serial_model(args)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 2.0**-24 * torch.randn(p.shape, generator=g))
        return model

    for seed in range(seeds):
        model = perturbed(sgd, seed)
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            (model(xs, ys)[1] / micro).backward()
        grads = dict(model.named_parameters())
        worst["grad_err"] = max(worst["grad_err"], max(_rel(grads[n].grad, g)
                                                       for n, g in ref["grads"].items()))
        model = perturbed(adam, seed)
        opt = make_optimizer(model, adam)
        recs = [train_step(model, opt, *corpus.batch(s, adam.batch.global_batch), s, adam,
                           micro) for s in range(1, steps + 1)]
        for a, b in zip(recs, ref["records"]):
            worst["loss_err"] = max(worst["loss_err"], abs(a["loss"] - b["loss"]) / b["loss"])
            worst["norm_err"] = max(worst["norm_err"],
                                    abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"])
    return worst


def tp_layers(mesh, cases: list[dict]) -> list[dict]:
    """Each FP8 TP layer against the serial FP8 layer on the same input, weight and output
    gradient (tp = the world): worst relative error of the output, the input gradient and
    the weight gradient over two steps (delayed scaling's second step reads the history).
    ``cases``: ``{"precision": {...}, "kind": "column"|"row", "sp": bool}``."""
    out = []
    for case in cases:
        precision = Run.of(precision="fp8", **case["precision"]).precision
        out.append(_tp_layer(mesh.group("tp"), mesh.index("tp"), mesh.size("tp"), precision,
                             case["kind"], case["sp"]))
    return out


def _tp_layer(group, rank: int, t: int, precision, kind: str, sp: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    serial = torch.nn.Linear(64, 128) if kind == "column" else torch.nn.Linear(128, 64)
    with torch.no_grad():
        serial.weight.normal_(0, 0.02, generator=g)
        serial.bias.normal_(0, 0.02, generator=g)
    cut = ColumnParallelLinear if kind == "column" else RowParallelLinear
    parallel = to_fp8(cut.from_linear(serial, group, sequence_parallel=sp), precision)
    serial = to_fp8(serial, precision)
    worst = {"out_err": 0.0, "dx_err": 0.0, "dw_err": 0.0}
    for step in range(2):  # delayed scaling: the second step's scales are the history's
        x = torch.randn(4, 16, serial.in_features, generator=g) * (1 + step)
        gy = torch.randn(4, 16, serial.out_features, generator=g) * 1e-3
        xs = x.clone().requires_grad_()
        ys = serial(xs)
        ys.backward(gy)
        if kind == "column":  # the whole input (SP: as the gather before it gives it)
            xp = x.clone().requires_grad_()
            yp = parallel(xp)
            yp.backward(shard(gy, -1, rank, t))
            y = ops.all_gather(yp.detach().contiguous(), group, -1)
            dx = ops.all_reduce(xp.grad, group) if sp else xp.grad  # SP: the gather's sum
        else:  # this rank's input features; SP: its tokens of the output
            xp = shard(x, -1, rank, t).requires_grad_()
            yp = parallel(xp)
            yp.backward(gy.chunk(t, 1)[rank] if sp else gy)
            y = ops.all_gather(yp.detach().contiguous(), group, 1) if sp else yp.detach()
            dx = ops.all_gather(xp.grad.contiguous(), group, -1)
        dw = ops.all_gather(parallel.weight.grad.contiguous(), group, 0 if kind == "column" else 1)
        worst["out_err"] = max(worst["out_err"], _rel(y, ys.detach()))
        worst["dx_err"] = max(worst["dx_err"], _rel(dx, xs.grad))
        worst["dw_err"] = max(worst["dw_err"], _rel(dw, serial.weight.grad))
        for m in (serial, parallel):
            m.weight.grad = m.bias.grad = None
        end_step(serial)
        end_step(parallel, [group])
    return worst
