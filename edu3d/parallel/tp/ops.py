"""The conjugate communication operators of tensor parallelism, as autograd Functions.

After reading this file you should understand:

* every collective tensor parallelism needs comes in a *conjugate pair*: what one direction
  (forward) does, the other (backward) undoes in the transposed sense. Each class is named
  forward-then-backward (Megatron calls the first two ``f`` and ``g``):

  ==========================  ==============  ==============  ===========================
  operator                    forward         backward        used by
  ==========================  ==============  ==============  ===========================
  ``IdentityAllReduce``  (f)  identity        all-reduce      input of a column split
  ``AllReduceIdentity``  (g)  all-reduce      identity        output of a row split
  ``AllGatherSplit``          all-gather      split           gathering a column output
  ``SplitAllGather``          split           all-gather      entering a sharded region
  ``ReduceScatterAllGather``  reduce-scatter  all-gather      row output under SP
  ``AllGatherReduceScatter``  all-gather      reduce-scatter  column input under SP
  ==========================  ==============  ==============  ===========================

* why they pair up: if forward *copies* ``x`` to every rank (identity), each rank's use of
  it contributes a partial gradient, and the true gradient is their *sum* (all-reduce). If
  forward *sums* partial results, each rank's input receives the full gradient unchanged
  (identity). Gather and split are each other's transpose in the same way;
* every collective goes through :mod:`edu3d.distributed.comm`, so it is a trace event a chart can count;
  with one rank in the group the operators do nothing and record nothing.

``dim`` is the dimension that is gathered, split or scattered: the hidden dimension (``-1``)
for column outputs, the sequence dimension (``1`` of ``[batch, seq, hidden]``) under
sequence parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.distributed import comm, trace


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)


# ---- the raw collectives along any dimension (comm's all-gather works along dim 0) --------
def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over the group (a new tensor; ``x`` is untouched)."""
    out = x.contiguous().clone()
    comm.all_reduce(out, group)
    return out


def all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order."""
    n = group_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((n * front.shape[0], *front.shape[1:]))
    comm.all_gather(out, front, group)
    return out.movedim(0, dim)


def split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``dim`` (no communication)."""
    n, size = group_size(group), x.shape[dim]
    if size % n:
        raise ValueError(f"dimension {dim} of size {size} does not split into {n} equal "
                         f"tensor-parallel shards; make it a multiple of {n}")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's slice along ``dim``."""
    n = group_size(group)
    front = x.movedim(dim, 0).contiguous()
    if front.shape[0] % n:
        raise ValueError(f"dimension {dim} of size {front.shape[0]} does not split into {n} "
                         f"equal shards for reduce-scatter; make it a multiple of {n}")
    out = front.new_empty((front.shape[0] // n, *front.shape[1:]))
    comm.reduce_scatter(out, front, group)
    return out.movedim(0, dim)


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """Element-wise maximum over the group, recorded like :func:`edu3d.distributed.comm.all_reduce`
    (the one reduction that is not a sum: the max is only a numerical shift, exact on gloo)."""
    out = x.contiguous().clone()
    with trace.current().span("comm", "all_reduce", group=comm.group_name(group),
                              n=group_size(group), bytes=out.numel() * out.element_size()):
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


# ---- the conjugate pairs --------------------------------------------------------------------
class _Conjugate(torch.autograd.Function):
    """``forward_op`` on the way in, ``backward_op`` on the gradient; both ``(x, group, dim)``."""

    forward_op = backward_op = None

    @classmethod
    def forward(cls, ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        if group_size(group) == 1:
            return x.view_as(x)
        return cls.forward_op(x, group, dim)

    @classmethod
    def backward(cls, ctx, grad):
        if group_size(ctx.group) == 1:
            return grad, None, None
        return cls.backward_op(grad, ctx.group, ctx.dim), None, None


def _identity(x, group, dim):
    return x.view_as(x)


def _all_reduce(x, group, dim):
    return all_reduce(x, group)


class IdentityAllReduce(_Conjugate):
    """``f``: forward identity, backward all-reduce. Before ``Y = X·[A1 A2]`` every rank
    needs all of ``X``; each rank's ``Yi = X·Ai`` gives only part of ``dL/dX``, so sum them."""

    forward_op, backward_op = staticmethod(_identity), staticmethod(_all_reduce)


class AllReduceIdentity(_Conjugate):
    """``g``: forward all-reduce, backward identity. ``Y = X1·A1 + X2·A2``: sum the partial
    products; each partial product's gradient is the full ``dL/dY``."""

    forward_op, backward_op = staticmethod(_all_reduce), staticmethod(_identity)


class AllGatherSplit(_Conjugate):
    """Forward all-gather along ``dim``, backward keep this rank's slice of the gradient."""

    forward_op, backward_op = staticmethod(all_gather), staticmethod(split)


class SplitAllGather(_Conjugate):
    """Forward keep this rank's slice along ``dim``, backward all-gather the gradient."""

    forward_op, backward_op = staticmethod(split), staticmethod(all_gather)


class ReduceScatterAllGather(_Conjugate):
    """Sequence parallelism's ``g``: forward reduce-scatter along the sequence (sum the
    partial products, keep my tokens), backward all-gather the gradient of my tokens."""

    forward_op, backward_op = staticmethod(reduce_scatter), staticmethod(all_gather)


class AllGatherReduceScatter(_Conjugate):
    """Sequence parallelism's ``f``: forward all-gather the sequence (every rank needs all
    tokens), backward reduce-scatter (sum the partial gradients, keep my tokens')."""

    forward_op, backward_op = staticmethod(all_gather), staticmethod(reduce_scatter)


def identity_all_reduce(x, group, dim: int = -1):
    return IdentityAllReduce.apply(x, group, dim)


def all_reduce_identity(x, group, dim: int = -1):
    return AllReduceIdentity.apply(x, group, dim)


def all_gather_split(x, group, dim: int = -1):
    return AllGatherSplit.apply(x, group, dim)


def split_all_gather(x, group, dim: int = -1):
    return SplitAllGather.apply(x, group, dim)


def reduce_scatter_all_gather(x, group, dim: int = 1):
    return ReduceScatterAllGather.apply(x, group, dim)


def all_gather_reduce_scatter(x, group, dim: int = 1):
    return AllGatherReduceScatter.apply(x, group, dim)
