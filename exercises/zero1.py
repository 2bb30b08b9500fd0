"""Exercise 03: a ZeRO-1 step — every rank does the optimizer's work for 1/N of the model.

Plain data parallelism all-reduces the gradients and then *every* rank updates *every*
parameter. ZeRO-1 splits that work (and the optimizer state that goes with it):

1. lay all gradients end to end in one flat buffer, padded with zeros to a multiple of N;
2. **reduce-scatter** it: rank r receives the sum of slice r only (``comm.reduce_scatter``);
   divide by N;
3. update only slice r of the flat parameters with that averaged gradient (here plain SGD:
   ``p - lr * g``);
4. **all-gather** the updated slices so every rank has the whole model again
   (``comm.all_gather``), and copy them back into the parameters.

Reduce-scatter + all-gather is exactly the traffic of one all-reduce: 2Ψ. Run the checks in
``exercises/03_zero1.ipynb``.
"""

import math

import torch
import torch.distributed as dist

from edu3d import comm


def shard_range(numel: int, n: int, rank: int) -> tuple[int, int, int]:
    """``(lo, hi, padded)``: rank's slice ``[lo, hi)`` of a flat buffer padded to a multiple
    of ``n``. Example: ``shard_range(10, 4, 1) == (3, 6, 12)``."""
    raise NotImplementedError(
        "hint: every rank must get a slice of the same length and the slices must tile "
        "the buffer exactly, so first pad the buffer to a size every rank can share")


@torch.no_grad()
def zero1_sgd_step(params: list, lr: float, group=None) -> None:
    """Each rank holds its local (not yet averaged) gradients; update ``params`` in place to
    ``p - lr * mean-over-ranks(grad)``, doing the update only on this rank's slice."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    raise NotImplementedError(
        "hint: each rank should receive only its own slice of the summed gradient, "
        "update only that slice of the parameters, and then every rank needs every "
        "updated slice back")


# ---- design: a ZeRO stage and a bucket size ---------------------------------------------------
def choose_zero(job: str) -> tuple[int, float]:
    """``(stage, bucket_mb)``: the ZeRO stage (0 is plain data parallelism) and the size of
    a communication bucket for one job, bf16 mixed precision with AdamW:

    =====  ==========  ==========  ============  ===========  ========  ==============
    job    parameters  GPUs        memory/GPU    activations  compute   link
    =====  ==========  ==========  ============  ===========  ========  ==============
    ``a``  7 B         64          80 GB         20 GB        1.0 s     30 us, 25 GB/s
    ``b``  7 B         8           40 GB         8 GB         1.0 s     10 us, 100 GB/s
    ``c``  13 B (40    16          24 GB         4 GB         1.5 s     30 us, 25 GB/s
           layers)
    =====  ==========  ==========  ============  ===========  ========  ==============

    A rank holds its share of the 16 bytes per parameter (stage by stage, as chapter 03
    showed), the activations, two buckets (one filling, one on the wire) and, under ZeRO-3,
    two whole layers (the one computing and the one prefetched). The bf16 gradients travel
    in buckets; each bucket is a ring, two phases of ``N - 1`` steps (ZeRO-3: three, since
    the backward gathers the weights again), every step paying the link's latency plus its
    share of the bucket. Communication hides under the step's compute, except the last
    bucket's. The target: the fullest rank within 90 % of the GPU, the step within 2 % of
    the best plan (the grader's model: ``cost`` in ``edu3d/course/ch03_zero_grade.py``).
    """
    raise NotImplementedError(
        "hint: the least sharding that fits costs the least traffic; then what does a "
        "small bucket pay that a big one does not, and what does a big one cost?")
