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
