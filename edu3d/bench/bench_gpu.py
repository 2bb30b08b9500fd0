"""What only a GPU shows: the planner against ``torch.cuda.max_memory_allocated``, tokens/s, MFU.

After reading this file you should understand how the course checks its memory planner on a
real device: one process trains the GPT-2-small-sized preset with edu3d's one
:class:`~edu3d.train.trainer.Trainer` in bf16 (autocast, fp32 master weights), at two micro-batch
sizes, with and without activation recomputation. After a first step (which allocates
AdamW's moments) the allocator's peak is reset; the peak of the next steps is what
``edu3d plan`` must predict (:func:`edu3d.plan.estimate.estimate`, ``at="peak"``) for the very
same run. The step time gives tokens/s, and with the training FLOPs per token
(:func:`edu3d.model.gpt.flops_per_token`, ``6N + 12·L·h·s``) the model FLOPs utilisation
against the device's dense bf16 peak.

``python -m edu3d.bench.bench_gpu [--json]``. Needs CUDA; on a CPU-only machine it says so and
exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from edu3d.model.gpt import GPT, flops_per_token
from edu3d.plan import estimate as plan_memory
from edu3d.train.data import SyntheticCorpus
from edu3d.config.sections import Run
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s (SXM)


def peak_flops(name: str) -> float | None:
    """The dense bf16 peak of a device from its name, or None when unknown."""
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def measure(micro_batch: int, recompute: str, steps: int = 4, model: str = "gpt2-small",
            device: str = "cuda") -> dict:
    """Train ``steps`` steps of ``model`` in bf16 on one device; the measured peak of steps
    2.. against the planner's estimate, tokens/s (median of steps 2..) and MFU."""
    args = Run.of(model=model, precision="bf16", global_batch=micro_batch, microbatches=1,
                    recompute=recompute, steps=steps, lr=3e-4)
    check_args(args)
    config = model_config(args)
    torch.manual_seed(0)
    gpt = GPT(config, seed=0).to(device)
    trainer = Trainer(gpt, None, args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
    times, peak = [], 0
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in corpus.batch(step, args.batch.global_batch))
        if step == 2:  # AdamW's moments exist from here on
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        rec = trainer.step(x, y, step)
        torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    spec, setup = plan_memory.spec_of(args), args
    est = plan_memory.estimate(spec, setup, at="peak")
    tokens = micro_batch * config.seq_len
    tok_s = tokens / statistics.median(times)
    name = torch.cuda.get_device_name()
    peak_f = peak_flops(name)
    del trainer, gpt, x, y
    return {"model": model, "micro_batch": micro_batch, "recompute": recompute,
            "measured_peak_bytes": peak, "planned_bytes": est["total_bytes"],
            "planned": {k: est[f"{k}_bytes"] for k in ("params", "grads", "optimizer",
                                                        "activations", "comm")},
            "ratio_planned_to_measured": est["total_bytes"] / peak,
            "tokens_per_s": tok_s,
            "mfu": None if peak_f is None else flops_per_token(config) * tok_s / peak_f,
            "device": name, "loss": rec["loss"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edu3d.bench.bench_gpu", description=__doc__)
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--recompute", nargs="+", default=["none", "selective", "full"])
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("edu3d.bench.bench_gpu: no CUDA device here; this benchmark needs one", file=sys.stderr)
        return 2
    if args.one:  # one configuration in this process: its peak is its own
        print(json.dumps(measure(args.micro_batch[0], args.recompute[0], model=args.model)))
        return 0
    rows = []
    for b in args.micro_batch:
        for r in args.recompute:  # a fresh process each: nothing of the last one allocated
            out = subprocess.run([sys.executable, "-m", "edu3d.bench.bench_gpu", "--one",
                                  "--micro-batch", str(b), "--recompute", r,
                                  "--model", args.model], capture_output=True, text=True,
                                 check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'b':>3} {'recompute':>10} {'measured GiB':>13} {'planned GiB':>12} "
              f"{'plan/meas':>10} {'tokens/s':>10} {'MFU':>6}")
        for r in rows:
            mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            print(f"{r['micro_batch']:>3} {r['recompute']:>10} "
                  f"{r['measured_peak_bytes'] / 2**30:>13.2f} {r['planned_bytes'] / 2**30:>12.2f} "
                  f"{r['ratio_planned_to_measured']:>10.3f} {r['tokens_per_s']:>10.0f} {mfu:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
