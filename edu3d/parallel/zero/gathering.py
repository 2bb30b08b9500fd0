"""ZeRO-3's parameter life cycle: gathered before a unit computes, freed after.

After reading this file you should understand how a rank that keeps only ``1/N`` of every
unit still runs the whole model (FSDP's unshard / reshard):

* a **forward pre-hook** on each of a unit's modules all-gathers the unit's shards into its
  flat buffer and points the parameters at it; a **forward hook** on the unit's last module
  frees it again (unless :attr:`Gathering.reshard_after_forward` is off: more micro-batches'
  forwards follow) and hooks the module's output, so that the unit is gathered again when
  its gradient arrives, before the module's backward runs;
* a **forward hook on the model** frees whatever a partial forward left gathered: a unit
  whose last module did not run this time (a skipped branch), a prefetched unit that never
  ran (its gather lands first: freeing memory a gather is still writing would corrupt it);
* ``prefetch=True`` starts the next unit's all-gather (asynchronous) while this one
  computes: forward order in forward, reverse order in backward;
* a freed unit's parameters are empty tensors (:meth:`FlatUnit.free`), safe to touch;
* a unit that computes in FP8 (:attr:`FlatUnit.gather_as`) is gathered in FP8 for forward
  and backward; every other gather (a ``state_dict``) moves its exact fp32 shards;
* ``model.state_dict()`` gathers every freed unit, copies the full tensors into the state
  dict and frees them again: FSDP's ``FULL_STATE_DICT`` (the hooks are in
  :mod:`edu3d.parallel.zero.zero_state`). It is collective: every rank of the group must call
  it, and a rank that calls it alone gets an error, not a hang.

Every gather and free records the bytes of parameters held (``mem`` events: the sawtooth
chapter 03 draws).
"""

from __future__ import annotations

import torch

from edu3d.distributed import comm, trace
from edu3d.parallel.zero.flat_unit import FlatUnit


class Gathering:
    """Gathers and frees ``units`` (sharded over ``group``) around their modules' use."""

    def __init__(self, model: torch.nn.Module, units: list[FlatUnit], group, prefetch: bool):
        self.units, self.group, self.prefetch, self.model = units, group, prefetch, model
        self.reshard_after_forward = True
        for u in units:
            u.shard_param = u.shard_param.clone()  # the only persistent copy
            self.free(u)
        self._install_hooks()

    def free(self, u: FlatUnit) -> None:
        if u.pending is not None:  # a prefetched unit nobody used: let the gather land first
            u.pending.wait()
            u.pending = None
        u.free()
        self.mark_resident()

    def mark_resident(self) -> None:
        """Record the bytes of parameters this rank holds right now (the ZeRO-3 sawtooth)."""
        full = sum(u.flat_param.untyped_storage().nbytes() for u in self.units)
        shards = sum(u.shard_param.untyped_storage().nbytes() for u in self.units)
        trace.current().mark_memory("params", params=full + shards)

    def _start(self, u: FlatUnit, async_op: bool, compute: bool = True):
        u.regrow()
        with trace.current().context(chunk=self.units.index(u)):
            if compute and u.gather_as is not None:
                return u.gather_as.start(u, self.group, async_op)
            return comm.all_gather(u.flat_param, u.shard_param, self.group, async_op=async_op)

    def gather(self, u: FlatUnit, compute: bool = False) -> None:
        """All-gather ``u``'s parameters (``compute``: for forward or backward, in FP8 where
        the unit computes in FP8; else its exact shards, as ``state_dict`` needs)."""
        if u.pending is not None:
            u.pending.wait()
            u.pending = None
        elif not u.gathered:
            self._start(u, async_op=False, compute=compute)
        else:
            return
        u.point_at_views()
        u.gathered = True
        self.mark_resident()

    def _prefetch(self, i: int) -> None:
        if self.prefetch and 0 <= i < len(self.units):
            u = self.units[i]
            if not u.gathered and u.pending is None:
                u.pending = self._start(u, async_op=True)

    def _install_hooks(self) -> None:
        for i, u in enumerate(self.units):
            def before_forward(module, inputs, u=u, i=i):
                self.gather(u, compute=True)
                self._prefetch(i + 1)

            def after_forward(module, inputs, output, u=u, i=i):
                if module is u.modules[-1] and self.reshard_after_forward:
                    self.free(u)
                outs = output if isinstance(output, (tuple, list)) else [output]
                for t in outs:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(lambda grad, u=u, i=i: self._before_backward(u, i))

            for m in u.modules:
                m.register_forward_pre_hook(before_forward)
                m.register_forward_hook(after_forward)
        self.model.register_forward_hook(self._after_model_forward)

    def _after_model_forward(self, module, inputs, output) -> None:
        """Free what a partial forward left gathered: a unit whose last module did not run
        (or a prefetched unit that never ran). Its backward gathers it again if needed."""
        if self.reshard_after_forward:
            for u in self.units:
                if u.gathered or u.pending is not None:
                    self.free(u)

    def _before_backward(self, u: FlatUnit, i: int) -> None:
        self.gather(u, compute=True)
        self._prefetch(i - 1)
