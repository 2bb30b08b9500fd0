"""``edu3d bench tp``: edu3d's tensor parallelism timed against PyTorch's DTensor TP.

After reading this file you should understand what is compared, and why it is fair:

* both sides run the **same transformer blocks** (the serial GPT's, same weights) on the same
  input, forward and backward, on the same ranks, repetitions interleaved (:mod:`edu3d.bench.harness`);
* edu3d: :func:`edu3d.parallel.tp.apply_tp`; PyTorch: ``edu3d train --impl torch``'s plan
  (:func:`edu3d.production.torch_tp.apply_tp`), ``parallelize_module`` with
  ``ColwiseParallel`` for ``qkv``/``fc`` and ``RowwiseParallel`` for the projections, and for
  ``--sp`` ``SequenceParallel`` on the LayerNorms with ``PrepareModuleInput`` gathering the
  sequence before attention and the MLP (torchtitan's plan);
* DTensor shards ``qkv`` contiguously, which would give a rank half of q and half of k; its
  copy of the model has the ``qkv`` rows reordered to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` first,
  so both sides compute the same heads (the outputs are compared before timing).

Rows: ``L blocks`` (plain TP), ``L blocks overlap`` (edu3d's column layers all-reduce the
input gradient asynchronously while computing the weight gradient; the reference is the same
DTensor plan), ``L blocks sp`` (sequence parallelism on both sides); each row is one forward
and backward.

The embedding and the loss are left out: DTensor's loss-parallel path is a separate feature,
and the blocks are where tensor parallelism's traffic is.
"""

from __future__ import annotations


import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from edu3d.bench.harness import comm_shares, interleaved_medians, layout_name, report, result
from edu3d.config.layout import Layout
from edu3d.launch import launch
from edu3d.model.gpt import GPT, GPTConfig
from edu3d.parallel.tp.apply import apply_tp
from edu3d.production.torch_tp import apply_tp as apply_dtensor_tp

CONFIG = GPTConfig(n_layers=2, n_heads=8, d_model=128, seq_len=64, vocab_size=128)


def _dtensor_blocks(gpt: GPT, t: int, sp: bool):
    """PyTorch's side: ``edu3d train --tp t --impl torch``'s own plan
    (:func:`edu3d.production.torch_tp.apply_tp`) applied to the whole GPT; its blocks."""
    mesh = init_device_mesh("cpu", (t,), mesh_dim_names=("tp",))
    apply_dtensor_tp(gpt, mesh, sequence_parallel=sp)
    return gpt.blocks, mesh


def _run_blocks(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def tp_benchmark(mesh, sp: bool = False, reps: int = 10, batch: int = 4,
                 config: GPTConfig = CONFIG, overlap: bool = False) -> dict | None:
    """Launch target: time forward + backward of the blocks both ways; rank 0 reports.
    ``overlap`` runs edu3d's column layers with the asynchronous input-gradient all-reduce."""
    t, r = mesh.size("tp"), mesh.index("tp")
    model = GPT(config, 0)
    apply_tp(model, mesh, sequence_parallel=sp, overlap=overlap)
    ours = model.blocks
    theirs, _ = _dtensor_blocks(GPT(config, 0), t, sp)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, config.seq_len, config.d_model, generator=g)
    x_ours = x.chunk(t, 1)[r].contiguous() if sp else x
    x_theirs = x_ours  # under SP both plans take this rank's tokens as a plain tensor

    def local(y):
        return y.to_local() if isinstance(y, DTensor) else y

    def step(blocks, inp):
        inp = inp.detach().requires_grad_()
        y = local(_run_blocks(blocks, inp))  # to_local is differentiable: same backward seed
        y.sum().backward()
        return y

    diff = (step(ours, x_ours) - step(theirs, x_theirs)).abs().max().detach().item()
    if diff > 1e-4:
        raise RuntimeError(f"edu3d and DTensor blocks disagree by {diff:.2e}; not timing")
    times = interleaved_medians({"edu3d": lambda: step(ours, x_ours),
                                 "dtensor": lambda: step(theirs, x_theirs)},
                                reps=reps, warmup=2, group=mesh.tp)
    share = comm_shares(lambda: step(ours, x_ours))
    if mesh.rank != 0:
        return None
    name = f"{config.n_layers} blocks{' sp' if sp else ''}{' overlap' if overlap else ''}"
    reference = ("torch.distributed.tensor.parallel (ColwiseParallel/RowwiseParallel"
                 + (", SequenceParallel)" if sp else ")"))
    return result(name, times["edu3d"], reference, times["dtensor"],
                  tokens=batch * config.seq_len, comm_share=share, max_abs_diff=diff)


def bench_all(mesh, reps: int) -> dict | None:
    rows = [tp_benchmark(mesh, sp, reps, overlap=overlap)
            for sp, overlap in ((False, False), (False, True), (True, False))]
    return (report("tp", mesh.layout.world_size, rows, layout_name(tp=mesh.size("tp")))
            if mesh.rank == 0 else None)


def run_benchmark(nprocs: int = 2, reps: int = 10, json_out: bool = False, **_) -> dict:
    """``edu3d bench tp [-n N]``: TP, TP with overlap, and TP+SP on ``nprocs`` ranks."""
    Layout(tp=nprocs).validate(config=CONFIG)
    res = launch(bench_all, nprocs, args=(reps,), layout=Layout(tp=nprocs), timeout=600)
    return res.results[0]
