"""HSDP, hybrid sharded data parallelism: ZeRO inside a group, plain data parallelism across.

After reading this file you should understand what ``Zero(..., replicate_group=...)`` adds to
ZeRO, and why it is the standard way to run ZeRO-3 past one node:

* the ``N = dp·cp`` ranks that average a gradient are cut into ``R`` **replica groups** of
  ``S = N/R`` ranks (:meth:`edu3d.config.layout.Layout.groups`: ``"shard"`` and
  ``"replicate"``). ZeRO shards its units over the ``S`` ranks of its own group, as if the
  group were the whole data-parallel world; the ``R`` ranks at the same place of every group
  (a replicate group) hold the *same* shard;
* backward reduce-scatters inside the shard group, so each rank's slice holds the sum over
  its group's rows; then, once per step (in :meth:`Zero.finish
  <edu3d.parallel.zero.sharding.Zero.finish>`, after the last micro-batch), the slice is
  **all-reduced across the replicate group** (:func:`across_replicas`) and divided by ``N``:
  every replica holds the same average, steps the same optimizer shard to the same numbers,
  and gathers parameters inside its own group only. Summing first over the group and then
  across the groups is the sum over all ``N`` ranks, so the step is plain ZeRO's (and the
  serial model's), whatever ``R``;
* **traffic per rank and step** (:func:`edu3d.plan.zero_modes.hsdp_wire_bytes`): ZeRO's over
  ``S`` ranks inside the group (the heavy part: every all-gather and reduce-scatter, on a
  node's fast links when a group is a node), plus one all-reduce of the gradient shard across
  the groups, ``2(R-1)/R · g_b·Ψ/S``: the slow links carry ``1/S`` of a DDP all-reduce, once
  whatever the number of micro-batches (FSDP2 does the same with
  ``set_requires_all_reduce(False)`` on every backward but the last);
* **memory per rank** is ZeRO's with ``S`` in place of ``N``: shards of ``1/S``, ``R`` times
  more than ZeRO over all ``N`` ranks. That is the trade: more bytes held, fewer on the slow
  links, and collectives among ``S`` ranks instead of ``N`` (latency grows with the ring);
* every rank must start from the same weights: the wrap-time broadcasts run over the shard
  group and then across the replicate group (:func:`same_start`), and a parameter some rank
  used is stepped on all of them (:func:`used_by_any`).

The same idea in the references: FSDP2's ``fully_shard(mesh=init_device_mesh(...,
(replicate, shard)))`` (FSDP1's ``ShardingStrategy.HYBRID_SHARD``), Megatron's partial
distributed optimizer (``--num-distributed-optimizer-instances``) and Megatron-FSDP's hybrid
mode. DeepSpeed's ZeRO++ hpZ applies it to the weights only: a second copy of the parameters
sharded within a node for the all-gathers, while gradients and optimizer state stay sharded
over every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.distributed import comm, trace
from edu3d.parallel.dp import same_start as plain
from edu3d.parallel.dp.data_parallel import used_by_any_rank


def place(group) -> tuple[int, int]:
    """``(R, index)``: the size of a replicate group and this rank's place in it (``(1, 0)``
    without HSDP)."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank())


def groups(zero) -> list:
    """The groups whose ranks together hold every copy of ``zero``'s model: its own, and
    across replicas."""
    return [zero.group] + ([zero.replicate] if zero.replicate is not None else [])


def same_start(zero, params, buffers: bool) -> None:
    """Every rank of every replica group starts from the first rank's parameters (and
    ``buffers``): a broadcast inside the group, then one across the groups."""
    params = list(params)
    for g in groups(zero):
        plain.broadcast_parameters(params, g)
        if buffers:
            plain.broadcast_buffers(zero.model, g)


def across_replicas(zero, t: torch.Tensor, unit: int) -> None:
    """Sum ``t`` (unit ``unit``'s gradient slice) over the replicate group, in place: the
    second half of HSDP's average (nothing without HSDP)."""
    if zero.replicate is None:
        return
    with trace.current().context(chunk=unit):
        comm.all_reduce(t, zero.replicate)


def used_by_any(zero, params: list, used) -> set:
    """The parameters of ``params`` some rank of any replica group gave a gradient."""
    for g in groups(zero):
        used = used_by_any_rank(params, used, g)
    return used
