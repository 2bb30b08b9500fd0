"""Tensor and sequence parallelism (Megatron-LM), applied to the serial reference GPT.

Read in this order: :mod:`~edu3d.parallel.tp.ops` (the conjugate communication operators),
:mod:`~edu3d.parallel.tp.layers` (column, row, vocabulary-parallel layers and the loss),
:mod:`~edu3d.parallel.tp.parallelize` (the model transformation and the training step),
:mod:`~edu3d.parallel.tp.activations` (activation memory, measured against Korthikanti's
formula), :mod:`~edu3d.parallel.tp.live` (the runs chapter 04 draws, and exercise 04's
grader) and :mod:`~edu3d.parallel.tp.bench` (edu3d against PyTorch's DTensor TP).
"""

from edu3d.parallel.tp.layers import (ColumnParallelLinear, RowParallelLinear,
                                      VocabParallelEmbedding, padded_size, shard, unshard,
                                      vocab_parallel_cross_entropy)
from edu3d.parallel.tp.ops import (AllGatherReduceScatter, AllGatherSplit, AllReduceIdentity,
                                   IdentityAllReduce, ReduceScatterAllGather, SplitAllGather)
from edu3d.parallel.tp.parallelize import (TensorParallelGPT, TPTrainer, build_trainer,
                                           check_layout, parallelize)

__all__ = ["AllGatherReduceScatter", "AllGatherSplit", "AllReduceIdentity", "ColumnParallelLinear",
           "IdentityAllReduce", "ReduceScatterAllGather", "RowParallelLinear", "SplitAllGather",
           "TPTrainer", "TensorParallelGPT", "VocabParallelEmbedding", "build_trainer",
           "check_layout", "padded_size", "parallelize", "shard", "unshard",
           "vocab_parallel_cross_entropy"]
