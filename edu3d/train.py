"""The training loop behind ``edu3d train``: the serial reference run.

After reading this file you should understand one training step end to end: fetch global
batch ``step`` (the same tokens whatever the layout), forward and backward, measure the
gradient norm and clip it, set the learning rate, update. Each step is recorded as
``{"step", "loss", "grad_norm", "lr", "tokens_per_s"}``; a parallel layout must reproduce
these records step by step, which is how the course proves it is the same computation.

Weight decay follows nanoGPT: it applies to matrices (and embeddings), not to biases or
LayerNorm gains, which only shift and scale.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from edu3d.cli import positive_int
from edu3d.data import SyntheticCorpus
from edu3d.model import GPT, PRESETS, config_from, num_params

RECORD_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_s")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the model, data and optimizer options of ``edu3d train`` to ``parser``."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="tiny", choices=list(PRESETS), help="preset")
    model.add_argument("--layers", type=positive_int, help="override the preset's n_layers")
    model.add_argument("--heads", type=positive_int, help="override n_heads")
    model.add_argument("--d-model", type=positive_int, help="override d_model")
    model.add_argument("--seq", type=positive_int, help="override seq_len")
    model.add_argument("--vocab", type=positive_int, help="override vocab_size")
    model.add_argument("--tie", action="store_true", default=None,
                       help="tie lm_head to the token embedding")
    opt = parser.add_argument_group("training")
    opt.add_argument("--steps", type=positive_int, default=60)
    opt.add_argument("--seed", type=int, default=0, help="seeds the weights and the data")
    opt.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    opt.add_argument("--global-batch", type=positive_int, default=8, help="sequences per step")
    opt.add_argument("--warmup", type=int, default=0, help="steps of linear learning-rate warmup")
    opt.add_argument("--weight-decay", type=float, default=0.1)
    opt.add_argument("--clip", type=float, default=1.0, help="max gradient norm; 0 disables")
    opt.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                     help="sgd is plain SGD, the honest check of gradient scale")
    par = parser.add_argument_group("parallelism (ranks = dp * tp * pp, launched with torchrun)")
    par.add_argument("--dp", type=positive_int, default=1, help="data-parallel degree")
    par.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                     help="ZeRO stage over the data-parallel group")
    par.add_argument("--grad-accum", type=positive_int, default=1,
                     help="micro-batches accumulated per step (data parallelism)")
    par.add_argument("--dp-impl", choices=("naive", "flat", "overlap", "bucketed"),
                     default="bucketed", help="how gradients are averaged")
    par.add_argument("--bucket-mb", type=float, default=25.0,
                     help="bucket size in MB for --dp-impl bucketed (PyTorch DDP's default: 25)")
    par.add_argument("--prefetch", action="store_true", help="ZeRO-3: gather the next layer early")
    par.add_argument("--offload", action="store_true",
                     help="ZeRO: keep the optimizer state (and its update) on the CPU")
    par.add_argument("--compress", choices=("fp16", "bf16", "int8", "topk"), default=None,
                     help="compress data-parallel gradients (lossy: losses drift from serial)")
    par.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree")
    par.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp)")
    par.add_argument("--tp-overlap", action="store_true",
                     help="overlap the input-gradient all-reduce with weight gradients")
    par.add_argument("--pp", type=positive_int, default=1, help="pipeline stages")
    par.add_argument("--vpp", type=positive_int, default=1, help="model chunks per pipeline rank")
    par.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "zb-h1"),
                     default="1f1b", help="pipeline schedule")
    par.add_argument("--microbatches", type=positive_int, default=None,
                     help="pipeline micro-batches per step (default: pp)")
    par.add_argument("--partition", choices=("uniform", "balanced"), default="uniform",
                     help="how layers are cut into pipeline stages")
    par.add_argument("--timeout", type=float, default=600.0,
                     help="seconds before a parallel run is killed")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per step and nothing else on stdout")
    return parser


def layout_from_args(args: argparse.Namespace):
    from edu3d.mesh import Layout

    return Layout(dp=args.dp, tp=args.tp, pp=args.pp, vpp=args.vpp)


# Which module's build_trainer(model, mesh, args) runs a layout; the first that applies wins.
STRATEGIES = (
    (lambda a: a.pp > 1, "edu3d.parallel.pp.trainer"),
    (lambda a: a.tp > 1, "edu3d.parallel.tp.parallelize"),
    (lambda a: True, "edu3d.parallel.dp"),
)


def check_args(args: argparse.Namespace):
    """Every check that can fail, done before any process starts; returns (config, layout)."""
    from edu3d.mesh import LayoutError

    config = config_from_args(args)
    layout = layout_from_args(args)
    if args.pp > 1 and args.microbatches is None:
        args.microbatches = args.pp
    mb = (args.microbatches or 1) if args.pp > 1 else args.grad_accum
    layout.validate(config=config, global_batch=args.global_batch, microbatches=mb)
    if args.tp > 1:
        from edu3d.parallel.tp import check_layout

        check_layout(layout, config, args.sp)
    if args.sp and args.tp == 1:
        raise LayoutError("--sp splits the sequence across the tensor-parallel group; "
                          "add --tp 2 (or more)")
    if args.vpp > 1 and args.schedule != "interleaved":
        raise LayoutError(f"--vpp {args.vpp} needs --schedule interleaved")
    if args.schedule == "interleaved" and args.pp > 1 and args.microbatches % args.pp:
        raise LayoutError(f"interleaved 1F1B groups micro-batches by pp: --microbatches "
                          f"{args.microbatches} must be a multiple of --pp {args.pp}")
    if args.pp > 1 and args.tp > 1:
        raise LayoutError("--pp with --tp (3D) is not available yet: the pipeline trainer "
                          "cuts whole layers; use --pp with --dp, or --tp with --dp")
    if args.zero and (args.tp > 1 or args.pp > 1):
        raise LayoutError(f"--zero {args.zero} runs with pure data parallelism; drop --tp/--pp")
    if args.grad_accum > 1 and (args.tp > 1 or args.pp > 1):
        raise LayoutError("--grad-accum is data parallelism's; pipelines accumulate over "
                          "--microbatches")
    if args.offload and not args.zero:
        raise LayoutError("--offload moves ZeRO's sharded optimizer state; add --zero 1 (or 2, 3)")
    if args.compress and (args.zero or args.dp == 1 or args.tp > 1 or args.pp > 1):
        raise LayoutError("--compress applies to plain data parallelism: use it with --dp N "
                          "and no --zero/--tp/--pp")
    if args.zero and args.dp == 1:
        raise LayoutError(f"--zero {args.zero} shards over the data-parallel group; "
                          "add --dp 2 (or more)")
    return config, layout


def build_trainer(model: torch.nn.Module, mesh, args: argparse.Namespace):
    """The trainer for ``args``' layout: serial for one rank, else the strategy's own."""
    if mesh is None or mesh.layout.world_size == 1 and not args.zero:
        return SerialTrainer(model, args)
    import importlib

    module = next(m for applies, m in STRATEGIES if applies(args))
    return importlib.import_module(module).build_trainer(model, mesh, args)


def worker(mesh, options: dict) -> list[dict]:
    """What every rank of ``edu3d train --dp/--tp/--pp`` runs (called by the launcher)."""
    args = argparse.Namespace(**options)
    config = config_from_args(args)
    model = GPT(config, seed=args.seed)  # the full serial init: shards are cut from it
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.seed)
    trainer = build_trainer(model, mesh, args)
    return loop(trainer, corpus, args, out=sys.stdout if mesh.rank == 0 else None)


def config_from_args(args: argparse.Namespace):
    return config_from(args.model, layers=args.layers, heads=args.heads, d_model=args.d_model,
                       seq=args.seq, vocab=args.vocab, tie=args.tie)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW (betas 0.9, 0.95) or plain SGD; weight decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if args.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=args.lr)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup from ``lr/warmup`` at step 1 to ``lr`` at step ``warmup``, then constant."""
    if args.warmup > 0 and step < args.warmup:
        return args.lr * step / args.warmup
    return args.lr


def clip_and_step(optimizer: torch.optim.Optimizer, params, grad_norm: torch.Tensor | float,
                  step: int, args: argparse.Namespace) -> float:
    """Clip by a *given* total gradient norm, set the learning rate, update; returns the lr.

    The same arithmetic as ``torch.nn.utils.clip_grad_norm_`` (scale ``max/(norm+1e-6)``,
    capped at 1), so a parallel trainer that computes the global norm from its shards updates
    exactly like the serial run.
    """
    if args.clip > 0:
        coef = torch.clamp(args.clip / (torch.as_tensor(grad_norm) + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    lr = lr_at(step, args)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return lr


def serial_step(model, optimizer, x, y, step: int, args: argparse.Namespace) -> dict:
    """The reference step: forward and backward on the whole global batch, the total
    gradient norm, clip, learning rate, update. Returns ``{"loss", "grad_norm"}``."""
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    clip_and_step(optimizer, params, grad_norm, step, args)
    return {"loss": loss.item(), "grad_norm": grad_norm.item()}


class SerialTrainer:
    """The reference: the whole model and the whole global batch on one process."""

    def __init__(self, model: torch.nn.Module, args: argparse.Namespace):
        self.model, self.args = model, args
        self.optimizer = make_optimizer(model, args)

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> dict:
        return serial_step(self.model, self.optimizer, x, y, step, self.args)


def train_step(model, optimizer, x, y, step: int, args: argparse.Namespace) -> dict:
    """One serial step on the global batch ``(x, y)``, returned as a full record."""
    t0 = time.perf_counter()
    out = serial_step(model, optimizer, x, y, step, args)
    return _record(step, out, lr_at(step, args), x.numel(), time.perf_counter() - t0)


def _record(step: int, out: dict, lr: float, tokens: int, seconds: float) -> dict:
    return {"step": step, "loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]),
            "lr": lr, "tokens_per_s": tokens / seconds}


def _emit(rec: dict, args: argparse.Namespace, out) -> None:
    if out is None:
        return
    if args.json:
        print(json.dumps(rec), file=out, flush=True)
    else:
        print(f"{rec['step']:>5} {rec['loss']:>8.4f} {rec['grad_norm']:>10.4f} "
              f"{rec['lr']:>9.2e} {rec['tokens_per_s']:>9.0f}", file=out, flush=True)


def loop(trainer, corpus: SyntheticCorpus, args: argparse.Namespace, out=None) -> list[dict]:
    """Feed global batch ``step`` to ``trainer.step`` for every step; record and print."""
    if out is not None and not args.json:
        print(f"{'step':>5} {'loss':>8} {'grad norm':>10} {'lr':>9} {'tok/s':>9}", file=out)
    records = []
    for step in range(1, args.steps + 1):
        x, y = corpus.batch(step, args.global_batch)
        t0 = time.perf_counter()
        result = trainer.step(x, y, step)
        rec = _record(step, result, lr_at(step, args), x.numel(), time.perf_counter() - t0)
        records.append(rec)
        _emit(rec, args, out)
    return records


def _describe(args, config, corpus, model) -> None:
    print(f"{args.model} {config}: {num_params(model):,} parameters; loss at init ~ "
          f"ln(vocab) = {math.log(config.vocab_size):.2f}, best possible "
          f"{corpus.entropy_floor():.2f} nats", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, out=None) -> list[dict]:
    """Train serially for ``args.steps`` steps; print to ``out`` (default: the current
    ``sys.stdout``) and return one record per step."""
    out = out or sys.stdout
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # the course's runs are multi-process; one thread each
    config, layout = check_args(args)
    model = GPT(config, seed=args.seed)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.seed)
    _describe(args, config, corpus, model)
    if layout.world_size == 1:
        return loop(SerialTrainer(model, args), corpus, args, out)
    return _run_parallel(args, layout, out)


def _run_parallel(args: argparse.Namespace, layout, out) -> list[dict]:
    """Launch ``layout.world_size`` ranks; rank 0's stdout (the records) goes to ``out``
    untouched, everything else to stderr with its rank prefix."""
    from edu3d.launch import launch

    def echo(rank, stream, line):
        if rank == 0 and stream == "stdout":
            print(line, file=out, flush=True)
        else:
            print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)

    print(f"launching {layout.world_size} ranks ({layout})", file=sys.stderr, flush=True)
    options = {k: v for k, v in vars(args).items() if not callable(v)}  # argparse's func
    res = launch(worker, layout.world_size, args=(options,), layout=layout, echo=echo,
                 timeout=args.timeout, name="train")
    return res.results[0]


def main_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check the arguments (before any process starts), then train."""
    from edu3d.launch import LaunchError

    try:
        check_args(args)
    except ValueError as err:
        parser.error(str(err))
    try:
        run(args)
    except LaunchError as err:
        print(f"edu3d train: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="edu3d train", description="Train the reference GPT on the synthetic corpus."))
    return main_from_args(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
