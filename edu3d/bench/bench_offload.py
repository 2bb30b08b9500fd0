"""``edu3d bench offload``: what activation offloading costs, against PyTorch's own
``save_on_cpu`` and beside recomputation.

After reading this file you should understand what is compared:

* every side runs the **same transformer blocks** (the serial GPT's, same weights, made
  tensor-parallel by :func:`edu3d.parallel.tp.apply_tp` when ``-n`` > 1) on the same input,
  forward and backward, repetitions interleaved (:mod:`edu3d.bench.harness`); each side's
  input gradient must equal the plain blocks' bit for bit, or nothing is timed;
* **offload**: edu3d's :class:`~edu3d.parallel.offload_activations.ActivationOffload` on every
  block against ``torch.autograd.graph.save_on_cpu`` around each block's forward (PyTorch's
  own offloading: every saved tensor, weights included, copied to the CPU one by one,
  pinned on a GPU; no side stream, no prefetch). On a CPU its ``tensor.cpu()`` returns the
  tensor itself: it copies nothing, so there it times the hooks alone, a floor under
  edu3d's, which copies every byte;
* **full**: recomputation, the other way to free the same memory: edu3d's
  :func:`~edu3d.parallel.recompute.apply_recompute` against ``checkpoint_wrapper``;
* **full + offload**: both, each side's pair (what is offloaded is what recomputation keeps);
* **none**: the plain blocks on both sides, the same code: its ratio is the noise floor.

Each row carries ``slowdown`` (its time over the plain blocks': the price of the memory it
saves) and what one layer leaves on the device (``device_bytes_per_layer``, measured as
what the forward saves outside the offloader plus what it keeps) and moves to the host pool
(``host_bytes_per_layer``). On a CPU the "host" is the same memory and the copies are
``memcpy``s: the slowdown is a floor of a GPU's, whose copies cross PCIe (about 25 GB/s
each way on a Gen4 x16 link, on a side stream that overlaps compute).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         checkpoint_wrapper)

from edu3d.bench.harness import layout_name, report, result, timed_blocks
from edu3d.bench.bench_recompute import CONFIG
from edu3d.config.layout import Layout
from edu3d.config.sections import Memory
from edu3d.distributed.meter import measure_activations
from edu3d.launch import launch
from edu3d.model.gpt import GPT, GPTConfig
from edu3d.parallel.offload_activations import ActivationOffload, apply_offload
from edu3d.parallel.recompute import apply_recompute
from edu3d.parallel.tp.apply import apply_tp

SIDES = ("none", "offload", "full", "full + offload")
REFERENCE = {
    "none": "the same blocks, nothing offloaded",
    "offload": "torch.autograd.graph.save_on_cpu around each block",
    "full": "torch checkpoint_wrapper(CheckpointImpl.NO_REENTRANT) per block",
    "full + offload": "save_on_cpu around each checkpoint_wrapper block",
}
EVERY_BLOCK = Memory(offload_activations=True, offload_last=True)


def _save_on_cpu(forward, *args, **kwargs):
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        return forward(*args, **kwargs)


def _model(config: GPTConfig, mesh, side: str, ours: bool):
    """``(blocks, offloader or None)`` of one side."""
    model = GPT(config, 0)
    if mesh.size("tp") > 1:
        apply_tp(model, mesh)
    full = side.startswith("full")
    if ours:
        apply_recompute(model, "full" if full else "none")
        return model.blocks, apply_offload(model, EVERY_BLOCK) if "offload" in side else None
    for i, block in enumerate(model.blocks):
        if full:
            block = model.blocks[i] = checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if "offload" in side:
            block.forward = functools.partial(_save_on_cpu, block.forward)
    return model.blocks, None


def device_bytes(blocks, offload: ActivationOffload | None, x: torch.Tensor) -> int:
    """Bytes the blocks' forward leaves on this rank's device for backward: what it saves
    outside an offloader (parameters left out) and what the offloader keeps there."""
    inp = x.detach().requires_grad_()

    def forward():
        y = inp
        for block in blocks:
            y = block(y)
        return y

    alive: list = []  # the output holds the graph (and the offloader's handles) meanwhile
    saved = measure_activations(lambda: alive.append(forward()), exclude=blocks.parameters())
    return saved + (0 if offload is None else offload.now["kept"] + offload.now["device"])


def offload_benchmark(mesh, reps: int = 7, batch: int = 4, config: GPTConfig = CONFIG):
    """Launch target: every side both ways, timed in one interleaved round; rank 0 reports."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, config.seq_len, config.d_model, generator=g)
    sides = {(s, ours): _model(config, mesh, s, ours) for s in SIDES for ours in (True, False)}
    times = timed_blocks({key: blocks for key, (blocks, _) in sides.items()}, x, reps,
                         group=mesh.tp)
    n, rows = config.n_layers, []
    for s in SIDES:
        blocks, offload = sides[(s, True)]
        kept = device_bytes(blocks, offload, x)
        moved = 0 if offload is None else offload.read()["host_peak"]
        ours, theirs = times[f"{s}/edu3d"], times[f"{s}/torch"]
        rows.append(result(f"{n} blocks {s}", ours, REFERENCE[s], theirs,
                           tokens=batch * config.seq_len, slowdown=ours / times["none/edu3d"],
                           device_bytes_per_layer=kept / n, host_bytes_per_layer=moved / n))
    return (report("offload", mesh.layout.world_size, rows, layout_name(tp=mesh.size("tp")))
            if mesh.rank == 0 else None)


def run_benchmark(nprocs: int = 1, reps: int = 7, json_out: bool = False, **_) -> dict:
    """``edu3d bench offload [-n N]``: none, offload, full and both on ``N`` tp ranks."""
    Layout(tp=nprocs).validate(config=CONFIG)
    res = launch(offload_benchmark, nprocs, args=(reps,), layout=Layout(tp=nprocs),
                 timeout=600)
    return res.results[0]
