"""One ZeRO unit laid flat: its parameters end to end in one buffer, and this rank's shard.

After reading this file you should understand the bookkeeping under every ZeRO stage:

* a unit's parameters (one dtype, see :mod:`edu3d.parallel.zero.units`) are copied end to end
  into one **flat buffer**, padded to a multiple of the group size N, and every parameter's
  ``.data`` becomes a view of its stretch of that buffer: updating the buffer updates the
  model;
* rank ``r`` owns the contiguous slice ``[r·P/N, (r+1)·P/N)``: its **shard**. A shard can cut
  a parameter anywhere, so :meth:`FlatUnit.pieces` says which stretch of which parameter
  lies in it (the optimizer steps those pieces);
* under ZeRO-3 the full buffer exists only while the unit computes. :meth:`FlatUnit.free`
  gives its storage back (resized to 0 bytes) and points every parameter at an **empty
  tensor of shape (0,)** (as FSDP does): a freed parameter can be printed, cloned or
  normed safely (it is empty), never read through a full shape over no memory (a
  segmentation fault). :meth:`FlatUnit.restore` regrows the storage for a gather and points
  the parameters at their views again;
* with a **mixed-precision** ``param_dtype`` (FSDP2's ``MixedPrecisionPolicy``) the flat
  buffer holds the parameters in that dtype (what forward and backward compute with, and what
  the all-gathers move) and :attr:`FlatUnit.master_init` keeps this rank's shard in the
  parameters' own dtype: the master copy the optimizer steps. The gradient shard of stages
  2-3 has the master's dtype too, so micro-batches accumulate in full precision;
* a unit of **FP8 weights** keeps its fp32 buffer and shard; only its gathers for forward
  and backward (:attr:`FlatUnit.gather_as`, :mod:`edu3d.parallel.fp8.fp8_gather`) move FP8.
"""

from __future__ import annotations

import math

import torch


class FlatUnit:
    """One unit's parameters as a padded flat buffer, and this rank's shard of it."""

    def __init__(self, name: str, modules: list, params: list, n: int, index: int,
                 param_dtype: torch.dtype | None = None):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"ZeRO unit {name} mixes dtypes {sorted(map(str, dtypes))}: one "
                             "flat buffer holds one dtype (split it, see units.by_dtype)")
        self.name, self.modules, self.params = name, modules, params
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(self.numel / n) * n
        self.shard_numel = self.padded // n
        self.lo, self.hi = index * self.shard_numel, (index + 1) * self.shard_numel
        self.sizes = [p.numel() for p in params]  # kept: a freed parameter is empty
        self.offsets = []
        off = 0
        for size in self.sizes:
            self.offsets.append(off)
            off += size
        p0 = params[0]
        self.dtype = p0.dtype  # the parameters' own: the master copy's and the gradient shard's
        full = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for p, o in zip(params, self.offsets):
                full[o:o + p.numel()].copy_(p.detach().reshape(-1))
        compute = param_dtype if param_dtype is not None and p0.is_floating_point() else p0.dtype
        self.master_init = full[self.lo:self.hi].clone() if compute != p0.dtype else None
        self.flat_param = full if compute == p0.dtype else full.to(compute)
        self.views = [self.flat_param[o:o + p.numel()].view(p.shape)
                      for p, o in zip(params, self.offsets)]
        self.empty = torch.empty(0, dtype=compute, device=p0.device)
        self.point_at_views()
        self.shard_param = self.flat_param[self.lo:self.hi]
        self.flat_grad: torch.Tensor | None = None
        self.shard_grad = torch.zeros(self.shard_numel, dtype=self.dtype, device=p0.device)
        # the optimizer's copy (offload: in host memory; mixed precision: in self.dtype), or
        # None when it steps the shard itself; and its gradient, or None: the shard's
        self.master_param: torch.Tensor | None = None
        self.master_grad: torch.Tensor | None = None
        self.averaged = False  # stages 2-3: finish() divided the shard gradient already
        self.ready: set = set()  # stages 2-3: parameters whose gradient arrived (synced)
        self.reduced = False  # stages 2-3: reduce-scattered in this step
        self.gathered = True
        self.pending = None  # an asynchronous all-gather in flight (prefetch)
        self.gather_as = None  # ZeRO-3 in FP8: its gather for compute (edu3d.parallel.fp8)

    @property
    def host_param(self) -> torch.Tensor | None:
        """The master copy (in host memory under ``offload``)."""
        return self.master_param

    def point_at_views(self) -> None:
        for p, v in zip(self.params, self.views):
            p.data = v

    def free(self) -> None:
        """ZeRO-3: drop the full buffer; the parameters become empty tensors."""
        for p in self.params:
            p.data = self.empty
        self.flat_param.untyped_storage().resize_(0)
        self.gathered = False

    def regrow(self) -> None:
        """Give the full buffer its memory back (its contents are then gathered into it)."""
        self.flat_param.untyped_storage().resize_(self.padded * self.flat_param.element_size())

    def pieces(self):
        """``(param, start, end, at)``: elements ``[start, end)`` of ``param`` (flattened)
        lie in this rank's shard, beginning at offset ``at`` of the shard."""
        for p, o, size in zip(self.params, self.offsets, self.sizes):
            a, b = max(o, self.lo), min(o + size, self.hi)
            if a < b:
                yield p, a - o, b - o, a - self.lo

    def flatten_grads(self, dtype: torch.dtype) -> torch.Tensor:
        """The unit's gradients end to end (padded) in ``dtype`` (the reduction's); a
        parameter without one counts zero."""
        flat = torch.zeros(self.padded, dtype=dtype, device=self.shard_grad.device)
        for p, o, size in zip(self.params, self.offsets, self.sizes):
            if p.grad is not None:
                flat[o:o + size].copy_(p.grad.reshape(-1))
        return flat

    def grad_view(self, i: int) -> torch.Tensor:
        """ZeRO-1: parameter ``i``'s stretch of the flat gradient buffer, shaped like it."""
        o = self.offsets[i]
        return self.flat_grad[o:o + self.sizes[i]].view(self.views[i].shape)

    def holds_storage(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == self.flat_param.untyped_storage().data_ptr() \
            and self.flat_param.untyped_storage().nbytes() > 0
