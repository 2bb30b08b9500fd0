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

from edu3d.data import SyntheticCorpus
from edu3d.model import GPT, PRESETS, config_from, num_params

RECORD_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_s")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


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
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per step and nothing else on stdout")
    return parser


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


def train_step(model, optimizer, x, y, step: int, args: argparse.Namespace) -> dict:
    """One optimizer step on the global batch ``(x, y)``; returns the step's record."""
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    # clip_grad_norm_ returns the norm *before* clipping; an infinite max never clips.
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                               args.clip if args.clip > 0 else float("inf"))
    lr = lr_at(step, args)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    seconds = time.perf_counter() - t0
    return {"step": step, "loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr,
            "tokens_per_s": x.numel() / seconds}


def run(args: argparse.Namespace, out=None) -> list[dict]:
    """Train serially for ``args.steps`` steps; print to ``out`` (default: the current
    ``sys.stdout``) and return one record per step."""
    out = out or sys.stdout
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # the course's runs are multi-process; one thread each
    config = config_from_args(args)
    model = GPT(config, seed=args.seed)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.seed)
    optimizer = make_optimizer(model, args)
    print(f"{args.model} {config}: {num_params(model):,} parameters; loss at init ~ "
          f"ln(vocab) = {math.log(config.vocab_size):.2f}, best possible "
          f"{corpus.entropy_floor():.2f} nats", file=sys.stderr, flush=True)
    if not args.json:
        print(f"{'step':>5} {'loss':>8} {'grad norm':>10} {'lr':>9} {'tok/s':>9}", file=out)
    records = []
    for step in range(1, args.steps + 1):
        x, y = corpus.batch(step, args.global_batch)
        rec = train_step(model, optimizer, x, y, step, args)
        records.append(rec)
        if args.json:
            print(json.dumps(rec), file=out, flush=True)
        else:
            print(f"{rec['step']:>5} {rec['loss']:>8.4f} {rec['grad_norm']:>10.4f} "
                  f"{rec['lr']:>9.2e} {rec['tokens_per_s']:>9.0f}", file=out, flush=True)
    return records


def main_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check the arguments (before any process starts), then train."""
    try:
        config_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    run(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="edu3d train", description="Train the reference GPT on the synthetic corpus."))
    return main_from_args(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
