"""``edu3d bench recompute``: what recomputation costs, edu3d's against PyTorch's wrappers.

After reading this file you should understand what is compared:

* both sides run the **same transformer blocks** (the serial GPT's, same weights, made
  tensor-parallel by :func:`edu3d.parallel.tp.apply_tp` when ``-n`` > 1) on the same input,
  forward and backward, repetitions interleaved (:mod:`edu3d.bench.harness`);
* **full**: edu3d's :func:`~edu3d.parallel.recompute.apply_recompute` (each block's
  ``forward`` under ``torch.utils.checkpoint``) against ``checkpoint_wrapper`` with
  ``CheckpointImpl.NO_REENTRANT``, the wrapper torchtitan applies per block;
* **selective**: edu3d checkpoints the attention core alone; the reference is PyTorch's
  *selective activation checkpointing* (``create_selective_checkpoint_contexts``) over the
  whole block with a policy that recomputes only the attention kernel and saves every other
  op's output (torchtitan's op-level SAC, with the attention as the one op left out);
* **none**: the plain blocks on both sides, the same code: its ratio is the noise floor.

Each row also carries ``slowdown``, the mode's time over edu3d's time without recomputation
(the price of the memory it saves), and ``saved_bytes_per_layer``, what one layer keeps
for backward (measured; :func:`edu3d.plan.formulas.layer_activation_bytes` predicts it
exactly).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         checkpoint_wrapper)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from edu3d.bench.harness import layout_name, report, result, timed_blocks
from edu3d.config.layout import Layout
from edu3d.distributed.meter import measure_activations
from edu3d.launch import launch
from edu3d.model.gpt import GPT, GPTConfig
from edu3d.parallel.recompute import MODES, apply_recompute
from edu3d.parallel.tp.apply import apply_tp

CONFIG = GPTConfig(n_layers=4, n_heads=8, d_model=256, seq_len=128, vocab_size=256)
REFERENCE = {
    "none": "the same blocks, no recomputation",
    "selective": "torch.utils.checkpoint.create_selective_checkpoint_contexts (SDPA recomputed)",
    "full": "torch checkpoint_wrapper(CheckpointImpl.NO_REENTRANT) per block",
}


def _sdpa_policy(ctx, op, *args, **kwargs):
    """Recompute the attention kernel, save everything else (selective recomputation as an
    op-level policy)."""
    name = str(op)
    if "scaled_dot_product" in name or "flash_attention" in name:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _torch_blocks(model: GPT, mode: str):
    for i, block in enumerate(model.blocks):
        if mode == "full":
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        elif mode == "selective":
            model.blocks[i] = checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                context_fn=functools.partial(create_selective_checkpoint_contexts, _sdpa_policy))
    return model.blocks


def _blocks(config: GPTConfig, mesh, mode: str, ours: bool):
    model = GPT(config, 0)
    if mesh.size("tp") > 1:
        apply_tp(model, mesh)
    return apply_recompute(model, mode).blocks if ours else _torch_blocks(model, mode)


def saved_bytes(block, x: torch.Tensor) -> int:
    """Bytes ``block`` saves for backward on this rank (its parameters left out)."""
    inp = x.detach().requires_grad_()
    return measure_activations(lambda: block(inp), exclude=block.parameters())


def recompute_benchmark(mesh, reps: int = 7, batch: int = 4, config: GPTConfig = CONFIG):
    """Launch target: every mode both ways, timed in one interleaved round; rank 0 reports."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, config.seq_len, config.d_model, generator=g)
    sides = {(m, ours): _blocks(config, mesh, m, ours) for m in MODES for ours in (True, False)}
    times = timed_blocks(sides, x, reps, group=mesh.tp)
    rows = []
    for m in MODES:
        ours, theirs = times[f"{m}/edu3d"], times[f"{m}/torch"]
        rows.append(result(f"{config.n_layers} blocks {m}", ours, REFERENCE[m], theirs,
                           tokens=batch * config.seq_len,
                           slowdown=ours / times["none/edu3d"],
                           saved_bytes_per_layer=saved_bytes(sides[(m, True)][0], x)))
    return (report("recompute", mesh.layout.world_size, rows, layout_name(tp=mesh.size("tp")))
            if mesh.rank == 0 else None)


def run_benchmark(nprocs: int = 1, reps: int = 7, json_out: bool = False, **_) -> dict:
    """``edu3d bench recompute [-n N]``: none, selective and full on ``N`` tp ranks."""
    Layout(tp=nprocs).validate(config=CONFIG)
    res = launch(recompute_benchmark, nprocs, args=(reps,), layout=Layout(tp=nprocs),
                 timeout=600)
    return res.results[0]
