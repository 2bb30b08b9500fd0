"""How ZeRO averages gradients: one unit at a time, into this rank's slice.

After reading this file you should understand the collectives behind
:meth:`~edu3d.parallel.zero.sharding.Zero.finish` and ZeRO-2/3's backward hooks:

* :func:`reduce_unit`: a unit's gradients laid end to end (in ``reduce_dtype`` under mixed
  precision) and **reduce-scattered**: this rank receives the sum of its slice and adds it to
  its gradient shard (micro-batches accumulate there, in the parameters' own dtype); the full
  gradients are freed, and under ZeRO-3 the unit's parameters too. A sum that arrives after
  :meth:`finish` divided the shard (a second backward before the step) is divided on its own,
  so it adds its average, as DDP's second backward does;
* :func:`average_full_gradients`: ZeRO-1's one reduction per step, over the full gradients
  backward accumulated: an **all-reduce** (``p.grad`` the average everywhere, DDP +
  ``ZeroRedundancyOptimizer``'s) or, with ``reduce_scatter=True``, a reduce-scatter (the
  paper's 2Ψ: each rank averages only its slice);
* under HSDP every sum over the group is then summed across the replica groups
  (:func:`edu3d.parallel.zero.hybrid.across_replicas`) before it is divided;
* :func:`agree_on_stepped`: which parameters the optimizer steps: every one (each must
  have a gradient), or with ``find_unused_parameters`` those some rank gave a gradient (one
  summed mask): a parameter nobody used keeps ``p.grad is None``, as torch would.

Sums are divided by the group's size (or the given divisor) here, never averaged by the
backend (``ReduceOp.AVG`` is broken on gloo).
"""

from __future__ import annotations

import torch

from edu3d.distributed import comm, trace
from edu3d.distributed.meter import storage_bytes
from edu3d.parallel.zero import hybrid


def reduce_scatter_into(zero, u, flat: torch.Tensor) -> None:
    """Reduce-scatter ``flat`` (unit ``u``'s gradients, padded) and add this rank's slice of
    the sum to ``u.shard_grad``."""
    if zero.consumed:  # the first reduction after a step starts from zero
        for v in zero.units:
            v.shard_grad.zero_()
            v.averaged = False
        zero.consumed = False
    out = torch.empty(u.shard_numel, dtype=flat.dtype, device=flat.device)
    with trace.current().context(chunk=zero.units.index(u)):
        comm.reduce_scatter(out, flat, zero.group)
    if u.averaged:  # after finish(): what this backward adds is averaged on its own
        hybrid.across_replicas(zero, out, zero.units.index(u))
        out.div_(zero.divisor)
    u.shard_grad += out


def mark_grads(zero, *transient: torch.Tensor) -> None:
    """A ``mem`` event with the gradient bytes held now (when a trace is recorded)."""
    rec = trace.current()
    if rec.enabled:
        rec.mark_memory("grads", grads=storage_bytes(zero.tensors()["grads"] + [*transient]))


def reduce_unit(zero, u) -> None:
    """Stages 2-3: reduce-scatter unit ``u``'s gradients, then free them (and, under ZeRO-3,
    the unit's parameters)."""
    u.ready.clear()
    u.reduced = True
    flat = u.flatten_grads(zero.reduce_dtype or u.dtype)
    mark_grads(zero, flat)  # the peak inside backward: this unit's grads twice
    reduce_scatter_into(zero, u, flat)
    del flat
    for q in u.params:
        q.grad = None
    mark_grads(zero)
    if zero.gathering is not None:
        zero.gathering.free(u)


def average_full_gradients(zero, u, k: int) -> None:
    """Stage 1: unit ``u``'s full gradients averaged, by a reduce-scatter into this rank's
    slice or an all-reduce of them all (``k``: the unit's index, for the trace)."""
    dtype = zero.reduce_dtype or u.flat_grad.dtype
    if zero.reduce_scatter:
        flat = u.flat_grad.to(dtype, copy=True)
        u.shard_grad.zero_()
        reduce_scatter_into(zero, u, flat)
        hybrid.across_replicas(zero, u.shard_grad, k)
        u.shard_grad.div_(zero.divisor)
        return
    flat = u.flat_grad if u.flat_grad.dtype == dtype else u.flat_grad.to(dtype)
    with trace.current().context(chunk=k):
        comm.all_reduce(flat, zero.group)
    hybrid.across_replicas(zero, flat, k)
    flat.div_(zero.divisor)
    if flat is not u.flat_grad:
        u.flat_grad.copy_(flat)


def agree_on_stepped(zero) -> set:
    """The parameters that step (module docstring); an error naming the flag when one got no
    gradient and ``find_unused_parameters`` is off."""
    params = list(zero.got)
    if zero.find_unused:
        return hybrid.used_by_any(zero, params, {p for p in params if zero.got[p]})
    missing = [zero.names.get(p, tuple(p.shape)) for p in params if not zero.got[p]]
    if missing:
        raise RuntimeError(f"ZeRO-{zero.stage}: parameters {missing[:4]} received no "
                           "gradient this step (unused in forward?): pass "
                           "Zero(..., find_unused_parameters=True)")
    return set(params)
