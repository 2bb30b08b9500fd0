"""Exercise 09 (solution): edu3d's ZeRO-3, ZeRO-2 and ZeRO-1 on PyTorch's own APIs."""

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel


def fsdp2(model, mesh, zero: int = 3):
    """Shard ``model`` (edu3d's GPT) over ``mesh`` with FSDP2, as ZeRO-3 (``zero=3``) or
    ZeRO-2 (``zero=2``). Returns the model (sharded in place)."""
    for block in model.blocks:  # one unit per block: gathered one at a time
        fully_shard(block, mesh=mesh, reshard_after_forward=zero == 3)
    # then the root: a unit of what is left (embeddings, ln_f, head), and the whole step's
    # hooks; a block's parameters already in a unit are not taken again
    fully_shard(model, mesh=mesh, reshard_after_forward=zero == 3)
    return model


def ddp_zero1(model, group, groups: list, **adamw):
    """ZeRO-1 the PyTorch way: ``(ddp_model, optimizer)``."""
    ddp = DistributedDataParallel(model, process_group=group)
    optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW,
                                        process_group=group, **adamw)
    return ddp, optimizer


# The deeper hints of exercises/torch_wrap.py (edu3d.course.grading.tiers): per function,
# a nudge (a check's second failure), then the answer's shape (its third).
HINTS = {'fsdp2': ('one fully_shard per block first, then one on the whole model (it takes '
                   'what no block took); ZeRO-3 reshards after forward, ZeRO-2 does not',
                   'for block in model.blocks: fully_shard(block, mesh=mesh, '
                   'reshard_after_forward=zero == 3); then fully_shard(model, mesh=mesh, '
                   'reshard_after_forward=zero == 3); return model'),
         'ddp_zero1': ('DistributedDataParallel averages the gradients; '
                       'ZeroRedundancyOptimizer wraps an optimizer class and shards its '
                       'state over a process group',
                       'ddp = DistributedDataParallel(model, process_group=group); opt = '
                       'ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, '
                       'process_group=group, **adamw); return ddp, opt')}
