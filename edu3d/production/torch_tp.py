"""Tensor (and sequence) parallelism on PyTorch's DTensor: edu3d's GPT through
``parallelize_module``, the plan torchtitan's ``apply_tp`` writes for Llama.

After reading this file you should understand the same cut as :mod:`edu3d.parallel.tp.apply`,
written as a *plan* instead of replaced layers:

* ``qkv`` is ``ColwiseParallel``, ``attn.proj`` ``RowwiseParallel``; MLP ``fc`` colwise,
  ``proj`` rowwise; the token embedding rowwise (its vocabulary rows split) and the LM head
  colwise with its output left sharded over the vocabulary for ``loss_parallel``;
* ``ColwiseParallel`` cuts a weight into contiguous rows, while edu3d's fused ``qkv`` is laid
  out ``[q | k | v]``: rank ``r`` must get *its heads* of q, k and v. So the rows are first
  permuted to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (a relabelling: the same numbers, the
  same function); each rank's contiguous third then chunks into its own q, k and v;
* with sequence parallelism the LayerNorms are ``SequenceParallel``, each parallel region
  starts with ``PrepareModuleInput(Shard(1) -> Replicate())`` (an all-gather) and the row
  layers end with ``Shard(1)`` (a reduce-scatter). The position embedding, which torchtitan's
  Llama does not have (RoPE), keeps its weight whole and hands on only its rank's positions
  (``PrepareModuleOutput(Replicate -> Shard(0))``; backward all-gathers, so its gradient is
  complete on every rank).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)


@torch.no_grad()
def heads_contiguous(qkv: nn.Linear, tp: int) -> None:
    """Permute ``qkv``'s output rows from ``[q | k | v]`` to rank-major ``[q_r k_r v_r]``."""
    d = qkv.out_features // 3
    per = d // tp
    order = torch.cat([torch.arange(j * d + r * per, j * d + (r + 1) * per)
                       for r in range(tp) for j in range(3)])
    qkv.weight.copy_(qkv.weight[order])
    if qkv.bias is not None:
        qkv.bias.copy_(qkv.bias[order])


def serial_qkv(t: torch.Tensor, tp: int) -> torch.Tensor:
    """The inverse of :func:`heads_contiguous` on a full ``qkv`` tensor (rows first)."""
    parts = [chunk.chunk(3) for chunk in t.chunk(tp)]
    return torch.cat([torch.cat([parts[r][j] for r in range(tp)]) for j in range(3)])


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> None:
    """Turn ``model`` (the serial GPT, in place) into its DTensor tensor-parallel form over
    the 1-D ``tp_mesh``. ``model.tok_emb`` / ``lm_head`` stay tied if they were."""
    tp, sp = tp_mesh.size(), sequence_parallel
    tied = model.lm_head.weight is model.tok_emb.weight
    seq = Shard(1) if sp else Replicate()
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                   use_local_output=False),  # loss_parallel takes the DTensor
    }
    if sp:
        plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(),
                                              desired_output_layouts=Shard(0))
        plan["ln_f"] = SequenceParallel()
    parallelize_module(model, tp_mesh, plan)
    for block in model.blocks:
        heads_contiguous(block.attn.qkv, tp)
        block.attn.n_heads //= tp
        bplan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=seq),
                 "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=seq)}
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),),
                                        use_local_output=True)
            bplan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel(),
                          "attn": gather, "mlp": gather})
        parallelize_module(block, tp_mesh, bplan)
    if tied:  # both sides are Shard(0) over the vocabulary: one DTensor, two uses
        model.lm_head.weight = model.tok_emb.weight
