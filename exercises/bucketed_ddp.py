"""Exercise 02: gradient averaging for data parallelism, and two bug hunts.

1. **Bug hunt:** :func:`sync_gradients` runs, but the model it trains does not match the serial
   one. Find out why and fix it.
2. **Bug hunt:** :func:`make_buckets` builds buckets that can never overlap with backward.
   Find out why and fix it.
3. **Build:** :class:`BucketedDDP` averages gradients bucket by bucket, launching each
   bucket's asynchronous all-reduce as soon as its last gradient is ready
   (``register_post_accumulate_grad_hook``), and finishing (wait, divide by N, copy back)
   after backward.

Reduce with SUM (``edu3d.distributed.comm.all_reduce``) and divide by N yourself. Run the checks in
``exercises/02_bucketed_ddp.ipynb``.
"""

import torch
import torch.distributed as dist

from edu3d import comm


def sync_gradients(model: torch.nn.Module, group=None) -> None:
    """After backward: make every ``p.grad`` the average over the group."""
    n = dist.get_world_size(group)
    for p in model.parameters():
        comm.all_reduce(p.data, group)
        p.data /= n


def make_buckets(params: list, bucket_mb: float) -> list[list]:
    """Buckets of at least ``bucket_mb`` MB (the last may be smaller), in launch order."""
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_mb * 2**20:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class BucketedDDP:
    """Average gradients bucket by bucket, each launched as soon as it is complete.

    Keep ``self.launched_at``: for each launched bucket, how many gradients had been produced
    when you launched it (the checks use it to see whether you overlapped with backward).
    """

    def __init__(self, model: torch.nn.Module, group=None, bucket_mb: float = 25.0):
        raise NotImplementedError(
            "hint: group the parameters into buckets, know which bucket each parameter "
            "belongs to, and get told whenever a gradient is ready, so that a bucket "
            "can be sent the moment it is complete")

    def _on_grad(self, p: torch.Tensor) -> None:
        raise NotImplementedError(
            "hint: a gradient just arrived: once the next bucket in launch order is "
            "complete, start its reduction without waiting for it to finish, and record "
            "how many gradients you had seen then")

    def finish(self) -> None:
        """Wait for every bucket, divide by N, copy the averages back into ``p.grad``."""
        raise NotImplementedError(
            "hint: after backward, every bucket started must be complete and averaged, "
            "and each parameter's gradient must hold its average")


# ---- design: a micro-batch and a bucket size -----------------------------------------------
def plan_step(job: str) -> tuple[int, float]:
    """``(rows, bucket_mb)`` for one data-parallel step of GPT-2 small (124 M parameters) on
    8 ranks, each with 32 sequences of 1024 tokens per step, cut into micro-batches of
    ``rows`` sequences (``rows`` divides 32) that accumulate their gradients; only the last
    micro-batch's backward runs your buckets' all-reduces (bucket size ``bucket_mb``).

    =====  =====================================  ===========================
    job    link (one all-reduce step: α + S·β)     memory for activations
    =====  =====================================  ===========================
    ``a``  NVLink: α 20 us, 50 GB/s                20 GB
    ``b``  InfiniBand: α 100 us, 10 GB/s           12 GB
    =====  =====================================  ===========================

    A micro-batch costs 4 ms plus 6 ms per sequence (a third forward, two thirds backward)
    and keeps 1.1 GB of activations per sequence. The step's time is chapter 02's bucket
    timeline (``edu3d.course.ch02_data_parallel.simulate_dp_step``) after the other
    micro-batches; the grader's model is ``cost`` in
    ``edu3d/course/ch02_data_parallel_grade.py``. The target: the activations fit, and the
    step is within 3 % of the best plan.
    """
    raise NotImplementedError(
        "hint: what does a micro-batch cost besides its sequences, and what bounds its "
        "size? Then: what does a bucket pay per all-reduce, and what is left to send "
        "after backward ends?")
