"""``edu3d bench tp``: edu3d's tensor parallelism timed against PyTorch's DTensor TP.

After reading this file you should understand what is compared, and why it is fair:

* both sides run the **same transformer blocks** (the serial GPT's, same weights) on the same
  input, forward and backward, on the same ranks, repetitions interleaved (:mod:`edu3d.bench`);
* edu3d: :func:`edu3d.parallel.tp.apply_tp`; PyTorch: ``parallelize_module`` with
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

import copy

import torch

from edu3d.bench import interleaved_medians, report, result
from edu3d.mesh import Layout
from edu3d.model import GPT, GPTConfig

CONFIG = GPTConfig(n_layers=2, n_heads=8, d_model=128, seq_len=64, vocab_size=128)


def _head_major_qkv(block, t: int) -> None:
    """Reorder the fused qkv rows so a contiguous 1/t slice holds whole heads of q, k, v."""
    with torch.no_grad():
        for p in (block.attn.qkv.weight, block.attn.qkv.bias):
            q, k, v = (part.chunk(t, 0) for part in p.data.chunk(3, 0))
            p.data.copy_(torch.cat([torch.cat([q[r], k[r], v[r]]) for r in range(t)]))


def _dtensor_blocks(gpt: GPT, t: int, sp: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (t,), mesh_dim_names=("tp",))
    for block in gpt.blocks:
        _head_major_qkv(block, t)
        block.attn.n_heads //= t
        plan = {"attn.qkv": ColwiseParallel(), "mlp.fc": ColwiseParallel(),
                "attn.proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
                "mlp.proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())}
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),))
            plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel(),
                         "attn": gather, "mlp": copy.deepcopy(gather),
                         "attn.proj": RowwiseParallel(output_layouts=Shard(1),
                                                      use_local_output=False),
                         "mlp.proj": RowwiseParallel(output_layouts=Shard(1),
                                                     use_local_output=False)})
        parallelize_module(block, mesh, plan)
    return gpt.blocks, mesh


def _run_blocks(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def tp_benchmark(mesh, sp: bool = False, reps: int = 10, batch: int = 4,
                 config: GPTConfig = CONFIG, overlap: bool = False) -> dict | None:
    """Launch target: time forward + backward of the blocks both ways; rank 0 reports.
    ``overlap`` runs edu3d's column layers with the asynchronous input-gradient all-reduce."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from edu3d.parallel.tp.apply import apply_tp

    t, r = mesh.size("tp"), mesh.index("tp")
    model = GPT(config, 0)
    apply_tp(model, mesh, sequence_parallel=sp, overlap=overlap)
    ours = model.blocks
    theirs, dmesh = _dtensor_blocks(GPT(config, 0), t, sp)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, config.seq_len, config.d_model, generator=g)
    x_ours = x.chunk(t, 1)[r].contiguous() if sp else x
    x_theirs = distribute_tensor(x, dmesh, [Shard(1)]) if sp else x

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
    if mesh.rank != 0:
        return None
    name = f"{config.n_layers} blocks{' sp' if sp else ''}{' overlap' if overlap else ''}"
    reference = ("torch.distributed.tensor.parallel (ColwiseParallel/RowwiseParallel"
                 + (", SequenceParallel)" if sp else ")"))
    return result(name, times["edu3d"], reference, times["dtensor"], max_abs_diff=diff)


def bench_all(mesh, reps: int) -> dict | None:
    rows = [tp_benchmark(mesh, sp, reps, overlap=overlap)
            for sp, overlap in ((False, False), (False, True), (True, False))]
    return report("tp", mesh.layout.world_size, rows) if mesh.rank == 0 else None


def run_benchmark(nprocs: int = 2, reps: int = 10, json_out: bool = False, **_) -> dict:
    """``edu3d bench tp [-n N]``: TP, TP with overlap, and TP+SP on ``nprocs`` ranks."""
    from edu3d.launch import launch

    Layout(tp=nprocs).validate(config=CONFIG)
    res = launch(bench_all, nprocs, args=(reps,), layout=Layout(tp=nprocs), timeout=600)
    return res.results[0]
