"""Tensor and sequence parallelism (Megatron-LM), applied to the serial reference GPT.

Read in this order: :mod:`~edu3d.parallel.tp.ops` (the conjugate communication operators),
:mod:`~edu3d.parallel.tp.layers` (column, row, vocabulary-parallel layers and the loss),
:mod:`~edu3d.parallel.tp.apply` (the model transformation),
:mod:`~edu3d.parallel.tp.activations` (activation memory, measured against Korthikanti's
formula), :mod:`edu3d.course.ch04_tensor_parallel` (the runs chapter 04 draws, and exercise 04's
grader) and :mod:`~edu3d.bench.bench_tp` (edu3d against PyTorch's DTensor TP).
"""

from edu3d.parallel.tp.layers import (ColumnParallelLinear, RowParallelLinear,
                                      VocabParallelEmbedding, shard, unshard,
                                      vocab_parallel_cross_entropy)
from edu3d.parallel.tp.ops import (AllGatherReduceScatter, AllGatherSplit, AllReduceIdentity,
                                   IdentityAllReduce, ReduceScatterAllGather, SplitAllGather)
from edu3d.parallel.tp.apply import apply_tp, check_layout, partial_grad_names

__all__ = ["AllGatherReduceScatter", "AllGatherSplit", "AllReduceIdentity", "ColumnParallelLinear",
           "IdentityAllReduce", "ReduceScatterAllGather", "RowParallelLinear", "SplitAllGather",
           "VocabParallelEmbedding", "apply_tp", "check_layout",
           "partial_grad_names", "shard", "unshard",
           "vocab_parallel_cross_entropy"]
