"""``edu3d bench overhead``: what edu3d's training machinery costs over a bare PyTorch loop.

After reading this file you should understand how the cost of a framework is measured: the
same model (edu3d's GPT, the same seed), the same optimizer (AdamW, betas 0.9/0.95, weight
decay on matrices only, the same kernel), the same learning rate, clipping and data, run

* through ``edu3d train``'s own path: :func:`edu3d.train.loop.loop` driving the one
  :class:`~edu3d.train.trainer.Trainer` (a one-stage pipeline, the gradient fix-ups, the
  global norm, the records), at world size 1, as ``edu3d train`` runs one process;
* through :func:`bare_steps`, the loop every PyTorch tutorial writes (nanoGPT's ``train.py``
  shape): batch, forward, backward, ``clip_grad_norm_``, ``optimizer.step()``, ``zero_grad``.

The default model is the tiny preset, where a step is a few milliseconds of arithmetic and
the machinery's Python weighs the most: the worst case for edu3d.

One repetition is ``steps`` steps of one side; repetitions alternate ``A B A B`` in this one
process, so a busy phase of a shared machine hurts both. The report gives the medians and
``ratio = edu3d / bare`` (goal: 1.03 or less), and the spread of the per-pair ratios (each
``A`` over the ``B`` beside it), which says how much the machine's noise moved it, and two
ratios other processes' load moves least: of the process's CPU time, and of each side's
fastest repetition (``timeit``'s estimator).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from edu3d.bench import harness as bench
from edu3d.model.gpt import GPT
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import loop
from edu3d.train.optim import kernel_for, lr_at, param_groups
from edu3d.config.sections import Run
from edu3d.train.preflight import check_args
from edu3d.train.trainer import Trainer

REFERENCE = "a bare PyTorch loop (nanoGPT's train.py shape)"


def bare_steps(model, optimizer, corpus, args) -> float:
    """``args.training.steps`` steps the way a PyTorch tutorial writes them; returns the last loss
    (read every ``args.launch.log_every`` steps, as edu3d's loop reads it)."""
    loss_value = float("nan")
    for step in range(1, args.training.steps + 1):
        x, y = corpus.batch(step, args.batch.global_batch)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.training.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.launch.log_every == 0 or step == args.training.steps:
            loss_value = loss.item()
    return loss_value


def measure(model: str = "tiny", steps: int = 20, global_batch: int = 8, reps: int = 11,
            warmup: int = 1) -> dict:
    """Time both sides, interleaved; returns the report's row."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as edu3d train runs one process
    args = Run.of(model=model, steps=steps, global_batch=global_batch, log_every=steps)
    config, _ = check_args(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    trainer = Trainer(GPT(config, seed=args.training.seed), None, args)
    bare = GPT(config, seed=args.training.seed)
    groups = param_groups(bare.parameters(), args.training.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=args.training.lr, betas=(0.9, 0.95), **kernel_for(groups))
    last = {}

    def edu3d_side():
        last["edu3d"] = loop(trainer, corpus, args)[-1]["loss"]

    def bare_side():
        last["bare"] = bare_steps(bare, optimizer, corpus, args)

    sides = {"edu3d": edu3d_side, "bare": bare_side}
    bench.progress(f"edu3d vs bare loop: {model}, {steps} steps per repetition, {warmup} "
                   f"warm-up and {reps} timed repetitions")
    times: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(warmup + reps):
        for name, fn in sides.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        if i >= warmup:
            bench.progress_rep(i - warmup, reps, times)
    pairs = sorted(a / b for a, b in zip(times["edu3d"], times["bare"]))
    a, b = statistics.median(times["edu3d"]), statistics.median(times["bare"])
    return bench.result(f"trainer ({model})", a, REFERENCE, b, steps=steps,
                        global_batch=global_batch, reps=reps,
                        pair_ratio_median=statistics.median(pairs),
                        pair_ratio_min=pairs[0], pair_ratio_max=pairs[-1],
                        cpu_ratio=statistics.median(cpu["edu3d"]) / statistics.median(cpu["bare"]),
                        fastest_ratio=min(times["edu3d"]) / min(times["bare"]),
                        loss_diff=abs(last["edu3d"] - last["bare"]))


def run_benchmark(nprocs: int = 1, json_out: bool = False, reps: int = 11, **opts) -> dict:
    """World size 1 (``nprocs`` must be 1): both sides in this process."""
    if nprocs != 1:
        raise ValueError(f"-n {nprocs}: the overhead benchmark runs one process; use -n 1")
    row = measure(reps=reps, **opts)
    if not json_out:
        bench.progress(f"per-pair ratios: median {row['pair_ratio_median']:.3f}, "
                       f"min {row['pair_ratio_min']:.3f}, max {row['pair_ratio_max']:.3f}; "
                       f"process CPU time ratio {row['cpu_ratio']:.3f}, fastest repetitions' "
                       f"ratio {row['fastest_ratio']:.3f} (what other processes' load moves "
                       "least); "
                       f"last losses differ by {row['loss_diff']:.2e}")
    return bench.report("overhead", 1, [row])
