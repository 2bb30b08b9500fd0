"""Activation offloading: what backward needs waits in host memory, not on the device.

After reading this file you should understand:

* **what moves**: every tensor a chosen block saves for its backward (a linear layer's
  input, GELU's input, attention's q, k, v and output ...: the ``sbh(34 + 5as/h)`` bytes of
  :mod:`edu3d.parallel.recompute`) is copied to host memory as the block's forward runs, and
  the device copy is dropped once the block's forward is over; backward brings the block's
  tensors back when it first needs one of them. The numbers are copied, never changed, so
  the losses and gradients are bitwise the run's without offloading
  (``tests/test_offload_activations.py``). Recomputation pays for memory with a second
  forward; offloading pays with two copies over the host link (PCIe on a GPU) per byte;
* **which blocks** (``run.memory``, :meth:`~edu3d.config.sections.Memory.offloaded`): every
  ``k``-th (``--offload-every k``), and by default **not the model's last**: its backward
  starts right after its forward (on the last pipeline stage), so its tensors would come
  straight back. Megatron (``--cpu-offloading-num-layers``, fewer than the layers) and
  torchtune (its ``NoOpManager`` around the output layer) keep it too;
* **how**: a ``saved_tensors_hooks`` pair around each chosen block's ``forward`` (torch's
  recipe, and torchtune's ``OffloadActivations``): ``pack`` copies a saved tensor's
  *storage* (each storage once per block, so the views of one buffer, q, k and v of the fused
  projection, move as one: the bytes counted are the storages', as
  :mod:`edu3d.distributed.meter` counts them) and returns a small handle; ``unpack`` turns the
  handle back into a tensor. Two kinds of saved tensor stay where they are: **parameters**
  (the device keeps the weights anyway; their storages are read as the block's forward
  starts, after ZeRO-3's hook gathered the block's unit) and the **stage's own input** (a leaf that requires
  grad: the pipeline engine holds it for its gradient, so moving it would free nothing);
* **on a GPU**: the host buffers are pinned (page-locked: the copy engine reads them
  directly, asynchronously), the copies run on a side CUDA stream: a block's device-to-host
  copies overlap the next block's forward, and in backward, when block ``i`` is brought
  back, block ``i-1`` of the same micro-batch (its predecessor in the forward, found through
  :meth:`ActivationOffload.chain`, which the trainer opens around every forward) is
  prefetched, so its copy overlaps block ``i``'s backward. The device then holds at most two
  blocks' tensors beyond what it keeps;
* **on a CPU** there is no second memory: the "host" is a second pool of the same RAM, the
  copies are real ``memcpy``s, synchronous (no prefetch), and what is measured is counted
  here, as torchtitan and Megatron describe their offloading: bytes moved each way, bytes in
  the host pool, bytes of saved tensors on the device (kept, held during the block's
  forward, or brought back for its backward) with their peaks (:meth:`read`);
* **how it composes**: it wraps the block *outside* recomputation, so a recomputed block
  offloads what recomputation keeps (the block's input, or q, k, v for ``selective``) and
  recomputes the rest from it; TP, SP, CP and EP save tensors like any other code; ZeRO-3's
  gathered weights are parameters; a pipeline's micro-batches each have their own blocks'
  tensors in the host pool, and a zero-bubble ``I`` then ``W`` unpack the same handles twice
  (the block stays on the device between the two, as it would without offloading).

What it saves, per stage and micro-batch, and what it moves:
:func:`edu3d.plan.estimate.stage_activation_bytes` (``where="device"`` or ``"host"``), split by
:mod:`edu3d.plan.host_pool`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
import torch.nn as nn

from edu3d.config.sections import Memory


class _Stored:
    """One storage a block saved: its copy in the host pool, and on the device while its
    block's backward needs it; or (``kept``) a storage left on the device."""

    __slots__ = ("nbytes", "home", "host", "device", "event", "handles", "kept")

    def __init__(self, nbytes: int, home: torch.device, host: torch.Tensor | None):
        self.nbytes, self.home, self.host, self.kept = nbytes, home, host, host is None
        self.device, self.event, self.handles = None, None, 0


class _Region:
    """One block's forward on one micro-batch: the storages it saved, and the block before
    it in the same forward (prefetched in backward on a GPU)."""

    __slots__ = ("params", "stored", "by_address", "hold", "prev", "restored")

    def __init__(self, block: nn.Module, prev: "_Region | None"):
        self.prev, self.restored = prev, False
        # the block's weights' storages, read as its forward starts (ZeRO-3 has gathered them)
        self.params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        self.stored: list[_Stored] = []
        self.by_address: dict[int, _Stored] = {}  # storage address -> its copy, in the forward
        self.hold: list[torch.Tensor] = []  # the device storages, until the forward ends


class _Packed:
    """What autograd keeps in place of one saved tensor: its storage's copy and the view
    (or, for a kept one, the tensor itself)."""

    __slots__ = ("owner", "region", "stored", "tensor", "dtype", "offset", "size", "stride")

    def __init__(self, owner, region, stored, t: torch.Tensor):
        self.owner, self.region, self.stored = owner, region, stored
        self.tensor = t if stored.kept else None
        self.dtype, self.offset, self.size, self.stride = (t.dtype, t.storage_offset(),
                                                           t.size(), t.stride())
        stored.handles += 1

    def __del__(self):  # autograd dropped it: the backward that needed it has run
        self.owner.release(self.stored)


def _bytes_view(storage) -> torch.Tensor:
    """A uint8 tensor over a whole storage (any dtype): what is copied."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


#: where the saved tensors of the offloaded blocks are counted: the host pool; the device,
#: for a moved storage while its block's forward runs or once backward brought it back
#: (what the planner calls transient); the device, for a stage's input, kept where it is
POOLS = ("host", "device", "kept")


class ActivationOffload:
    """Moves the saved tensors of the blocks ``layers`` (serial layer numbers) to host memory
    during forward and back for backward (see the module docstring); counts what it does."""

    def __init__(self, layers):
        self.layers = frozenset(layers)
        self.moved_out = self.moved_in = 0  # bytes copied to host, back to the device
        self.now = dict.fromkeys(POOLS, 0)
        self.peak = dict.fromkeys(POOLS, 0)
        self._streams: dict = {}
        self._chain: list | None = None  # [the last block run] in the forward being run
        self._region: _Region | None = None

    # ---- the counters -----------------------------------------------------------------------
    def count(self, **delta: int) -> None:
        """Add ``delta`` bytes to pools of :data:`POOLS`; keep each one's peak."""
        for pool, n in delta.items():
            self.now[pool] += n
            self.peak[pool] = max(self.peak[pool], self.now[pool])

    def read(self, reset: bool = True) -> dict:
        """Bytes moved each way since the last reset, and each pool's bytes (:data:`POOLS`)
        now and at their peak; ``reset`` starts the next period (moved bytes to 0, peaks to
        what is held now)."""
        out = {"layers": sorted(self.layers), "moved_out": self.moved_out,
               "moved_in": self.moved_in, **{f"{k}_bytes": v for k, v in self.now.items()},
               **{f"{k}_peak": v for k, v in self.peak.items()}}
        if reset:
            self.moved_out = self.moved_in = 0
            self.peak = dict(self.now)
        return out

    # ---- applying it --------------------------------------------------------------------------
    def wrap(self, block: nn.Module, layer: int) -> None:
        """Make ``block`` (serial layer ``layer``) offload what its forward saves, in place.

        A ``functools.partial`` of the block's current ``forward`` (recomputation's, when it
        runs), as :func:`edu3d.parallel.recompute.checkpointed` does: a deep copy of the model
        rebinds it to the copied block."""
        if hasattr(block.forward, "offloaded"):
            raise ValueError(f"block {layer} already offloads its activations; build a fresh "
                             "model")
        run = functools.partial(self._forward, block, block.forward)
        run.offloaded = layer
        block.forward = run

    @contextlib.contextmanager
    def chain(self) -> Iterator[None]:
        """One forward pass (a pipeline stage on one micro-batch): each block it runs is the
        next one's predecessor, prefetched in backward when the next is brought back. The
        trainer opens one around every forward action; outside one nothing is prefetched."""
        saved, self._chain = self._chain, [None]
        try:
            yield
        finally:
            self._chain = saved

    def _forward(self, block: nn.Module, fn: Callable, *args, **kwargs):
        if not torch.is_grad_enabled():  # nothing is saved (generation, evaluation)
            return fn(*args, **kwargs)
        region = self._region = _Region(block, self._chain[0] if self._chain else None)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return fn(*args, **kwargs)
        finally:
            held = sum(t.numel() for t in region.hold)
            region.hold.clear()  # the forward is over: the device copies may go
            region.by_address.clear()  # an address names a storage only while it is held
            self.count(device=-held)
            self._region = None
            if self._chain:
                self._chain[0] = region

    # ---- the hooks ------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        region = self._region
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in region.params:
            return t  # a parameter: the device keeps it anyway
        stored = region.by_address.get(key)
        if stored is not None and not stored.handles:  # released in the forward (its node
            stored = None  # was dropped: topk's indices): saved again, copied again
        if stored is None:
            if t.is_leaf and t.requires_grad:  # the stage's input: its holder keeps it
                stored = _Stored(nbytes, t.device, None)
                self.count(kept=nbytes)
            else:
                held = key in region.by_address  # saved again: its device copy is held
                stored = self._copy_out(storage, nbytes)
                if not held:
                    region.hold.append(_bytes_view(storage))
                self.count(host=nbytes, device=0 if held else nbytes)
                region.stored.append(stored)
            region.by_address[key] = stored
        return _Packed(self, region, stored, t)

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed  # a parameter
        if packed.tensor is not None:
            return packed.tensor  # kept on the device
        stored = packed.stored
        if stored.device is None:
            self._restore(packed.region)
        device = stored.device
        if stored.event is not None:  # the copy ran on the side stream: wait for it here
            stream = torch.cuda.current_stream(device.device)
            stream.wait_event(stored.event)
            device.record_stream(stream)
            stored.event = None
        return torch.empty(0, dtype=packed.dtype, device=device.device).set_(
            device.untyped_storage(), packed.offset, packed.size, packed.stride)

    def release(self, stored: _Stored) -> None:
        """A handle is gone; when a storage's last one goes, so do its copies."""
        stored.handles -= 1
        if stored.handles:
            return
        if stored.kept:
            self.count(kept=-stored.nbytes)
        self.count(host=-stored.nbytes if stored.host is not None else 0,
                   device=-stored.nbytes if stored.device is not None else 0)
        stored.host = stored.device = stored.event = None

    # ---- the copies -----------------------------------------------------------------------------
    def _stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _copy_out(self, storage, nbytes: int) -> _Stored:
        src = _bytes_view(storage)
        self.moved_out += nbytes
        if src.device.type != "cuda":  # the host pool is the same memory: a plain copy
            return _Stored(nbytes, src.device, src.clone())
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        side = self._stream(src.device)
        side.wait_stream(torch.cuda.current_stream(src.device))  # the tensor is computed
        with torch.cuda.stream(side):
            host.copy_(src, non_blocking=True)
        src.record_stream(side)  # its memory is not reused before the copy has read it
        return _Stored(nbytes, src.device, host)

    def _restore(self, region: _Region, prefetch: bool = True) -> None:
        """Bring every live storage of ``region``'s block back to the device; on a GPU, on
        the side stream, and then start on the block before it (its backward comes next)."""
        region.restored = True
        gpu = False
        for stored in region.stored:
            if stored.host is None or stored.device is not None:
                continue  # released already, or back already
            if stored.home.type != "cuda":
                stored.device = stored.host.clone()
            else:
                gpu, side = True, self._stream(stored.home)
                with torch.cuda.stream(side):
                    stored.device = torch.empty(stored.nbytes, dtype=torch.uint8,
                                                device=stored.home)
                    stored.device.copy_(stored.host, non_blocking=True)
                    stored.event = side.record_event()
            self.moved_in += stored.nbytes
            self.count(device=stored.nbytes)
        prev, region.prev = region.prev, None
        if gpu and prefetch and prev is not None and not prev.restored:
            self._restore(prev, prefetch=False)


def apply_offload(model: nn.Module, memory: Memory) -> ActivationOffload | None:
    """Offload the saved tensors of ``model``'s blocks that ``memory`` chooses
    (:meth:`~edu3d.config.sections.Memory.offloaded`), in place; ``None`` when it chooses
    none. Apply it after recomputation (it wraps the recomputing forward) and before the
    pipeline cut (the layer numbers are the serial model's)."""
    blocks = list(model.blocks)
    layers = memory.offloaded(len(blocks))
    if not layers:
        return None
    offload = ActivationOffload(layers)
    for i in layers:
        offload.wrap(blocks[i], i)
    return offload
