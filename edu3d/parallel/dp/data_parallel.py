"""Data parallelism: every rank holds the whole model, trains on its rows of the global batch,
and the ranks average their gradients before the optimizer step.

After reading this file you should understand four ways to average gradients, from the most
obvious to the one PyTorch's ``DistributedDataParallel`` uses:

``naive``
    after backward, one all-reduce per parameter. Many small messages, each paying the
    latency ``alpha``, and nothing overlaps with computation.
``flat``
    after backward, copy every gradient into one flat buffer (one per dtype) and all-reduce
    it once: one latency instead of hundreds, but still after backward has finished.
``overlap``
    a ``post_accumulate_grad`` hook launches an asynchronous all-reduce for each parameter as
    soon as its gradient is ready (and those of the parameters registered after it: the
    launch order below), while backward continues on earlier layers.
``bucketed``
    the parameters are grouped into buckets (:mod:`edu3d.parallel.dp.buckets`) in *reverse*
    registration order, one dtype per bucket; each bucket's gradients live in one flat
    buffer, and when a bucket's last gradient arrives one asynchronous all-reduce sends the
    whole bucket. Few messages *and* overlap.

Every version sums with ``SUM`` and divides by N itself (``ReduceOp.AVG`` is broken on gloo).
The average of the N local mean losses is the global mean loss, so the averaged gradient is
exactly the serial model's gradient. Traffic per step (ring): ``2(N-1)/N · Ψ`` elements per
rank, ``2Ψ`` in the ZeRO paper's count (DESIGN.md).

**The loop is torch DDP's.** ``DataParallel`` is an ``nn.Module`` around the model: ``dp(x)``
runs it, ``dp.parameters()`` and ``dp.state_dict()`` are the model's (keys ``module.*``), and
the average is complete when ``loss.backward()`` returns, so ``optimizer.step()`` may follow
at once. At the end of every backward outside ``no_sync()`` that gave every parameter a
gradient, a callback queued on the autograd engine (as DDP's ``Reducer`` queues its own)
launches what is left, waits for every all-reduce and divides. With gradient accumulation,
run every backward but the last inside ``with dp.no_sync():``: gradients accumulate locally
and travel once. A second backward outside ``no_sync`` averages again, exactly as DDP does
(what it adds is averaged; what was averaged stays so).

**The explicit form** (the course's, and the trainer's, whose pipeline runs several
backwards outside ``no_sync``, one per stage, each over other parameters) calls
:meth:`DataParallel.finish` after the last backward: it completes whatever the backwards left
(a parameter that got no gradient in them, a last backward inside ``no_sync``), and does
nothing when the end of backward already did it. Forgetting it is an error, never a silently
local step: :mod:`edu3d.parallel.dp.step_guard` stops ``optimizer.step()`` on parameters
whose average is unfinished, and the next ``dp(x)`` refuses as DDP's does. A parameter
whose all-reduce is already in flight and that gets a gradient again (a second backward
before the average completed) is an error too, not a race.

Beyond the loop, as torch DDP:

* **any ``zero_grad``**: the gradient hook uses the gradient autograd hands it. After
  ``optimizer.zero_grad()`` (``p.grad = None``) autograd allocates a fresh gradient that is
  not a view of the bucket; the hook copies it into the bucket and makes ``p.grad`` the view
  again, so every placement of ``zero_grad``, either ``set_to_none``, gives the average;
* **launch order**: every rank must issue the same collectives in the same order, so the
  asynchronous versions launch strictly in bucket (or reverse-parameter) order;
* **unused parameters**: a parameter that got no gradient is an error naming it, unless
  ``find_unused_parameters=True``. Then it contributes zero, a parameter no rank used
  keeps its gradient untouched (``None`` stays ``None``: AdamW neither decays it nor moves
  its moments), and one that another rank used gets the average (one small all-reduce of a
  "used" flag per parameter decides which);
* **the same start** (:mod:`edu3d.parallel.dp.same_start`): every parameter, frozen ones
  included, and every buffer broadcast from the group's first rank at wrap time; buffers
  broadcast again before each forward that follows a synchronising one
  (``broadcast_buffers=True``, the default).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from edu3d.distributed import comm, trace
from edu3d.parallel.dp import same_start, step_guard
from edu3d.parallel.dp.buckets import Bucket, make_buckets

IMPLS = ("naive", "flat", "overlap", "bucketed")
__all__ = ["IMPLS", "DataParallel", "make_buckets", "switched", "used_by_any_rank"]


def used_by_any_rank(params: list, used, group) -> set:
    """The parameters of ``params`` that some rank of ``group`` gave a gradient this step
    (``used``: this rank's, anything supporting ``in``): one summed mask of flags, on the
    parameters' device (NCCL reduces only device tensors)."""
    device = params[0].device if params else "cpu"
    flags = torch.tensor([p in used for p in params], dtype=torch.int32, device=device)
    comm.all_reduce(flags, group)
    return {p for p, f in zip(params, flags.tolist()) if f}


@contextlib.contextmanager
def switched(obj, name: str, value):
    """``obj.name = value`` inside the block, the old value restored after (even on error)."""
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


class DataParallel(nn.Module):
    """Averages ``module``'s gradients over ``group`` with one of :data:`IMPLS`: torch DDP's
    loop (module docstring), or the explicit one with :meth:`finish`.

    ``comm_hook(tensor, group) -> handle`` replaces the all-reduce of a bucket (compression,
    see :mod:`edu3d.parallel.dp.compress`); it must sum, the wrapper divides by N.
    ``params`` (default: all of ``module``'s) are the ones broadcast and averaged (the
    trainable ones), and ``divisor`` (default N) what their sums are divided by: expert
    parallelism averages its experts' gradients over the expert-data-parallel group but
    divides by the whole ``dp x cp`` size. ``find_unused_parameters`` and
    ``broadcast_buffers`` have torch DDP's meaning; a wrapper given its own ``params`` list
    owns no buffers. ``average_in_backward=False`` is the explicit form only (the trainer's):
    the end of backward averages nothing and :meth:`finish` completes the average, so a
    trace shows the wait for the last all-reduces after the backward, where it is exposed. (Not torch's single-process ``nn.DataParallel``: this is DDP's role.)
    """

    def __init__(self, module: nn.Module, group=None, impl: str = "bucketed",
                 bucket_mb: float = 25.0, reverse_buckets: bool = True, comm_hook=None,
                 broadcast: bool = True, first_bucket_mb: float | None = 1.0,
                 params: list | None = None, divisor: int | None = None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 average_in_backward: bool = True):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"dp impl {impl!r} is not one of {', '.join(IMPLS)}")
        self.module, self.group, self.impl = module, group, impl
        self.n = divisor or dist.get_world_size(group)
        given = list(module.parameters() if params is None else params)
        self.params = [p for p in given if p.requires_grad]
        self.param_set = set(self.params)
        self.names = {p: name for name, p in module.named_parameters()}
        self.find_unused_parameters = find_unused_parameters
        self.average_in_backward = average_in_backward  # False: only finish() averages
        self.broadcast_buffers = broadcast_buffers and params is None
        self.sync = True
        self.comm_hook = comm_hook
        self.used: set = set()  # parameters whose gradient arrived since the last average
        self.synced: set = set()  # ... in a backward outside no_sync
        self.unfinished = False  # a gradient arrived that is not averaged yet
        self.averaged = False  # the end of a backward averaged every gradient: finish() is done
        self._inflight: list = []  # (tensor, handle) of asynchronous all-reduces in flight
        self._zeros: dict = {}  # overlap: the zero gradient sent for a locally unused parameter
        self._next = 0  # the next unit (bucket, or parameter for overlap) to launch
        self._grads_seen = 0
        self._callback_queued = False
        self.launch_log: list = []  # (bucket, gradients ready when it was launched), last step
        self.buckets: list[Bucket] = []
        if broadcast:
            same_start.broadcast_parameters(given, group)
            if self.broadcast_buffers:
                same_start.broadcast_buffers(module, group)
        if impl == "bucketed":
            self.buckets = make_buckets(self.params, bucket_mb, reverse_buckets,
                                        first_bucket_mb)
        self._units = self.buckets  # what launches during backward, in this order
        if impl == "overlap":
            self._units = [Bucket([p], None, index=i, offsets=[0])
                           for i, p in enumerate(reversed(self.params))]
        self._unit_of = {p: (u, off) for u in self._units
                         for p, off in zip(u.params, u.offsets)}
        # every version watches the gradients arrive: it must know which parameters got one
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                         for p in self.params]
        self.buffer_sync = None
        if self.broadcast_buffers and any(True for _ in module.buffers()):
            self.buffer_sync = same_start.BufferSync(module, group, lambda: self.sync)
        step_guard.watch(self)

    @property
    def model(self) -> nn.Module:
        """The wrapped model (torch DDP calls it ``module``)."""
        return self.module

    def forward(self, *inputs, **kwargs):
        """Run the model, as DDP's forward: refused while an average is unfinished."""
        if self.unfinished and self.synced:
            raise RuntimeError(self._unfinished_message())
        return self.module(*inputs, **kwargs)

    # ---- gradient buffers -----------------------------------------------------------------
    def _slot(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s place in its bucket's flat buffer, shaped like ``p``."""
        b, off = self._unit_of[p]
        return b.buffer[off:off + p.numel()].view_as(p)

    def _attach_grad_views(self) -> None:
        for b in self.buckets:
            for p, off in zip(b.params, b.offsets):
                p.grad = b.buffer[off:off + p.numel()].view_as(p)

    def _adopt(self, p: torch.Tensor) -> None:
        """Make ``p.grad`` its bucket slot again. After ``p.grad = None`` autograd allocated a
        fresh gradient elsewhere: copy it into the slot (the slot's old content is stale)."""
        slot = self._slot(p)
        if p.grad.data_ptr() != slot.data_ptr():
            slot.copy_(p.grad)
            p.grad = slot

    # ---- per step ---------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients, as ``optimizer.zero_grad()``: ``p.grad = None`` (torch's
        default). ``set_to_none=False`` zeroes the buckets in place and keeps ``p.grad``
        their view (autograd then writes into them directly, no copy); the versions without
        buckets always set ``None``. All-reduces still in flight land first."""
        self._drain()
        self._reset()
        self.launch_log = []
        if self.buckets and not set_to_none:
            for b in self.buckets:
                b.buffer.zero_()
            self._attach_grad_views()
        else:
            for p in self.params:
                p.grad = None

    def no_sync(self):
        """Accumulate gradients locally; no communication inside this block."""
        return switched(self, "sync", False)

    def _all_reduce(self, t: torch.Tensor, async_op: bool):
        if self.comm_hook is not None:
            return self.comm_hook(t, self.group)
        return comm.all_reduce(t, self.group, async_op=async_op)

    def _launched(self, p: torch.Tensor) -> bool:
        return bool(self._units) and self._unit_of[p][0].index < self._next

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self.sync and p in self.synced and self._launched(p):
            self._drain()  # every rank launched the same all-reduces: let them end
            raise RuntimeError(
                f"rank {dist.get_rank()}: {self._name(p)} got a second gradient while its "
                "all-reduce was in flight (two backwards outside no_sync() before the average "
                "completed): run every backward but the last of a step inside dp.no_sync()")
        self.unfinished, self.averaged = True, False
        self.used.add(p)
        if self.buckets:
            self._adopt(p)
        if not self.sync:
            return
        first = p not in self.synced  # a unit counts each parameter once
        self.synced.add(p)
        if not self._callback_queued and self.average_in_backward:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self._callback_queued = True
            except RuntimeError:  # called outside backward (a pipeline's weight pass): finish()
                pass
        if self._units and first:
            self._unit_of[p][0].ready += 1
            self._grads_seen += 1
            self._launch(force=False)

    def _end_of_backward(self) -> None:
        """The end of a backward outside ``no_sync``: average now if every parameter got
        its gradient (or ``find_unused_parameters``: torch DDP's rule); otherwise wait for
        more backwards of this step (a pipeline's stages) or :meth:`finish`."""
        self._callback_queued = False
        if self.find_unused_parameters or len(self.synced) == len(self.params):
            self._average()

    def _launch(self, force: bool) -> None:
        """Launch units strictly in order (every rank must issue the collectives in the same
        order): a ready one waits for all earlier ones. ``force``: launch the rest now."""
        while self._next < len(self._units):
            u = self._units[self._next]
            if not force and u.ready < len(u.params):
                return
            if u.buffer is None:  # overlap: the parameter's own gradient, or a zero
                p = u.params[0]
                t = p.grad if p.grad is not None else self._zeros.setdefault(
                    p, torch.zeros_like(p))
                self._inflight.append((t, self._all_reduce(t, async_op=True)))
            else:
                if self._next == 0:
                    self.launch_log = []
                self.launch_log.append((u.index, self._grads_seen))
                with trace.current().context(chunk=u.index):
                    self._inflight.append((u.buffer, self._all_reduce(u.buffer, async_op=True)))
            self._next += 1

    def finish(self) -> None:
        """Make every ``p.grad`` the average over the group: after the last backward of the
        step when it ran inside ``no_sync`` or left a parameter without a gradient (a
        pipeline's stages, ``find_unused_parameters``); nothing to do when the end of
        backward averaged already."""
        if self.averaged and not self.unfinished:
            return
        unused = [p for p in self.params if p not in self.used]
        if unused and not self.find_unused_parameters:
            self._drain()  # the all-reduces already launched end on every rank alike
            self._reset()
            raise RuntimeError(self._unused_message(unused))
        self._average()

    def _average(self) -> None:
        """Launch what is left, wait for every all-reduce, divide (the unused parameters:
        module docstring)."""
        unused = [p for p in self.params if p not in self.used]
        if self.impl in ("naive", "flat"):
            used = self._globally_used() if self.find_unused_parameters else set(self.params)
            for p in unused:
                if p in used and p.grad is None:
                    p.grad = torch.zeros_like(p)  # used elsewhere: this rank adds zero
            self._reduce_after_backward([p for p in self.params if p in used])
        else:
            for p in unused:  # their slots hold last step's gradient, or nothing
                if self.buckets and p.grad is None:
                    self._slot(p).zero_()
                elif self.buckets:
                    self._adopt(p)
            self._launch(force=True)
            # the flags go after every bucket, so that all ranks issue the same order
            used = self._globally_used() if self.find_unused_parameters else set(self.params)
            self._drain()
            for p in unused:  # used by another rank: the average of zero and theirs
                if p in used and p.grad is None:
                    p.grad = self._slot(p) if self.buckets else self._zeros[p]
        self._reset()
        self.averaged = True

    def _reduce_after_backward(self, params: list) -> None:
        if self.impl == "naive":
            for p in params:
                self._finish_one(p.grad, self._all_reduce(p.grad, async_op=False))
            return
        kinds: dict = {}  # one flat buffer per dtype
        for p in params:
            kinds.setdefault((p.dtype, p.device), []).append(p)
        for ps in kinds.values():
            flat = torch.cat([p.grad.reshape(-1) for p in ps])
            self._finish_one(flat, self._all_reduce(flat, async_op=False))
            for p, piece in zip(ps, flat.split([p.numel() for p in ps])):
                p.grad.copy_(piece.view_as(p))

    def _globally_used(self) -> set:
        """The parameters some rank of the group gave a gradient this step."""
        return used_by_any_rank(self.params, self.used, self.group)

    # ---- misuse, named ------------------------------------------------------------------------
    def _name(self, p: torch.Tensor) -> str:
        return self.names.get(p, f"a parameter of shape {tuple(p.shape)}")

    def _shown(self, params: list) -> str:
        names = [self._name(p) for p in params]
        return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")

    def _unused_message(self, unused: list) -> str:
        return (f"rank {dist.get_rank()}: {len(unused)} parameter(s) got no gradient in this "
                f"step: {self._shown(unused)}. Every rank must reduce every gradient: use them "
                "in the loss, or pass DataParallel(..., find_unused_parameters=True) as with "
                "torch DDP")

    def _unfinished_message(self) -> str:
        rank = dist.get_rank()
        if self.synced:
            missing = [p for p in self.params if p not in self.synced]
            return (f"rank {rank}: DataParallel has not finished averaging this step's "
                    f"gradients: the backwards outside no_sync() gave none to {len(missing)} "
                    f"parameter(s): {self._shown(missing)}. If they are unused, pass "
                    "DataParallel(..., find_unused_parameters=True) as with torch DDP; if a "
                    "later backward gives them one, call dp.finish() after it")
        return (f"rank {rank}: the gradients accumulated inside dp.no_sync() were never "
                "averaged: run the last backward of the step outside no_sync(), or call "
                "dp.finish() after it, before optimizer.step()")

    def check_step(self, optimizer) -> None:
        """The step guard's question (:mod:`edu3d.parallel.dp.step_guard`): refuse a step of
        this wrapper's parameters while their average is unfinished."""
        if self.unfinished and step_guard.stepped_by(optimizer, self.param_set):
            raise RuntimeError(self._unfinished_message())

    def _drain(self) -> None:
        for t, handle in self._inflight:
            self._finish_one(t, handle)
        self._inflight = []

    def _reset(self) -> None:
        """A new average: no gradient seen, no unit launched."""
        self.used, self.synced = set(), set()
        self.unfinished = self.averaged = False
        self._zeros = {}
        for u in self._units:
            u.ready = 0
        self._next, self._grads_seen = 0, 0

    def _finish_one(self, t: torch.Tensor, handle) -> None:
        if handle is not None:
            handle.wait()
        t.div_(self.n)
