"""Data parallelism: every rank holds the whole model, trains on its rows of the global batch,
and the ranks average their gradients before the optimizer step.

After reading this file you should understand four ways to average gradients, from the most
obvious to the one PyTorch's ``DistributedDataParallel`` uses:

``naive``
    after backward, one all-reduce per parameter. Many small messages, each paying the
    latency ``alpha``, and nothing overlaps with computation.
``flat``
    after backward, copy every gradient into one flat buffer and all-reduce it once: one
    latency instead of hundreds, but still after backward has finished.
``overlap``
    a ``post_accumulate_grad`` hook launches an asynchronous all-reduce for each parameter as
    soon as its gradient is ready, while backward continues on earlier layers.
``bucketed``
    the parameters are grouped into buckets of about ``bucket_mb`` MB in *reverse*
    registration order (backward produces the last layer's gradients first). Each bucket's
    gradients live in one flat buffer (``p.grad`` is a view into it, so autograd writes them
    there directly); when a bucket's last gradient arrives, one asynchronous all-reduce sends
    the whole bucket. Few messages *and* overlap.

Every version sums with ``SUM`` and divides by N itself (``ReduceOp.AVG`` is broken on gloo).
The average of the N local mean losses is the global mean loss, so the averaged gradient is
exactly the serial model's gradient. With gradient accumulation over K micro-batches each
micro-batch's loss is divided by K, and :meth:`DataParallel.no_sync` skips communication on
all but the last micro-batch: gradients accumulate locally and are sent once.

Traffic per step (ring): ``2(N-1)/N · Ψ`` elements per rank, ``2Ψ`` in the ZeRO paper's
count (DESIGN.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from edu3d.distributed import comm, trace

IMPLS = ("naive", "flat", "overlap", "bucketed")


@contextlib.contextmanager
def switched(obj, name: str, value):
    """``obj.name = value`` inside the block, the old value restored after (even on error)."""
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


@dataclass
class Bucket:
    """Parameters whose gradients travel together, and the flat buffer they live in."""

    params: list
    buffer: torch.Tensor
    ready: int = 0
    handle: object = None
    index: int = 0
    offsets: list = field(default_factory=list)


def make_buckets(params: list, bucket_mb: float, reverse: bool = True,
                 first_bucket_mb: float | None = None) -> list[Bucket]:
    """Group ``params`` into buckets of at least ``bucket_mb`` MB (the last may be smaller).

    ``reverse=True`` fills buckets from the last registered parameter backwards, the order in
    which backward produces gradients, so the first bucket is ready early. In forward order
    the first bucket waits for the embedding's gradient, which arrives last: no overlap.
    ``first_bucket_mb`` caps the first bucket (PyTorch DDP uses 1 MB) so that communication
    starts after the first few gradients rather than after ``bucket_mb`` of them.
    """
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb={bucket_mb} must be positive (e.g. 25, PyTorch's default)")
    order = list(reversed(params)) if reverse else list(params)
    limit = bucket_mb * 2**20
    first = min(first_bucket_mb, bucket_mb) * 2**20 if first_bucket_mb else limit
    groups, current, size = [], [], 0
    for p in order:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= (first if not groups else limit):
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    buckets = []
    for i, ps in enumerate(groups):
        buf = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
        offsets, off = [], 0
        for p in ps:
            offsets.append(off)
            off += p.numel()
        buckets.append(Bucket(ps, buf, index=i, offsets=offsets))
    return buckets


class DataParallel:
    """Averages a model's gradients over ``group`` with one of :data:`IMPLS`.

    Usage per step: ``dp.zero_grad()``; forward/backward for each micro-batch (all but the
    last inside ``with dp.no_sync():``); ``dp.finish()``; then clip and step as usual.
    ``comm_hook(tensor, group) -> handle`` replaces the all-reduce of a bucket (compression,
    see :mod:`edu3d.parallel.dp.compress`); it must sum, :meth:`finish` divides by N.

    ``params`` (default: all of ``model``'s) are the ones averaged, and ``divisor`` (default
    N) what their sums are divided by: expert parallelism averages its experts' gradients
    over the expert-data-parallel group but divides by the whole ``dp x cp`` size.
    """

    def __init__(self, model: torch.nn.Module, group=None, impl: str = "bucketed",
                 bucket_mb: float = 25.0, reverse_buckets: bool = True, comm_hook=None,
                 broadcast: bool = True, first_bucket_mb: float | None = 1.0,
                 params: list | None = None, divisor: int | None = None):
        if impl not in IMPLS:
            raise ValueError(f"dp impl {impl!r} is not one of {', '.join(IMPLS)}")
        self.model, self.group, self.impl = model, group, impl
        self.n = divisor or dist.get_world_size(group)
        self.params = [p for p in (model.parameters() if params is None else params)
                       if p.requires_grad]
        self.sync = True
        self.comm_hook = comm_hook
        self._pending: list = []  # (tensor, handle) of asynchronous all-reduces in flight
        self._next = 0  # the next bucket to launch
        self._grads_seen = 0
        self.launch_log: list = []  # (bucket, gradients ready when it was launched), last step
        self.buckets: list[Bucket] = []
        if broadcast:
            self.broadcast_parameters()
        if impl == "bucketed":
            self.buckets = make_buckets(self.params, bucket_mb, reverse_buckets,
                                        first_bucket_mb)
            self._bucket_of = {}
            for b in self.buckets:
                for p, off in zip(b.params, b.offsets):
                    self._bucket_of[p] = (b, off)
            self._attach_grad_views()
        if impl in ("overlap", "bucketed"):
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                           for p in self.params]

    # ---- setup ----------------------------------------------------------------------------
    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Start from the same weights everywhere: copy the group's first rank's parameters."""
        src = dist.get_process_group_ranks(self.group)[0] if self.group else 0
        for p in self.params:
            comm.broadcast(p.data, src, self.group)

    def _attach_grad_views(self) -> None:
        for p, (b, off) in self._bucket_of.items():
            p.grad = b.buffer[off:off + p.numel()].view_as(p)

    # ---- per step ---------------------------------------------------------------------------
    def zero_grad(self) -> None:
        if self.buckets:
            for b in self.buckets:
                b.buffer.zero_()
                b.ready = 0
            self._next, self._grads_seen, self.launch_log = 0, 0, []
            self._attach_grad_views()  # in case someone set p.grad to None
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

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self.sync:
            return
        if self.impl == "overlap":
            self._pending.append((p.grad, self._all_reduce(p.grad, async_op=True)))
            return
        b, _ = self._bucket_of[p]
        b.ready += 1
        self._grads_seen += 1
        # like DDP, launch buckets strictly in bucket order (every rank must issue the
        # collectives in the same order): a ready bucket waits for all earlier ones
        while (self._next < len(self.buckets)
               and self.buckets[self._next].ready == len(self.buckets[self._next].params)):
            nb = self.buckets[self._next]
            self.launch_log.append((nb.index, self._grads_seen))
            with trace.current().context(chunk=nb.index):
                self._pending.append((nb.buffer, self._all_reduce(nb.buffer, async_op=True)))
            self._next += 1

    def finish(self) -> None:
        """Make every ``p.grad`` the average over the group (call after the last backward)."""
        if self.impl == "naive":
            for p in self.params:
                self._finish_one(p.grad, self._all_reduce(p.grad, async_op=False))
        elif self.impl == "flat":
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            self._finish_one(flat, self._all_reduce(flat, async_op=False))
            off = 0
            for p in self.params:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
        else:
            expected = len(self.params) if self.impl == "overlap" else len(self.buckets)
            if len(self._pending) != expected:
                raise RuntimeError(
                    f"{len(self._pending)} of {expected} gradient all-reduces were launched: "
                    "was the last backward run inside no_sync(), or a parameter unused?")
            for t, handle in self._pending:
                self._finish_one(t, handle)
            self._pending = []

    def _finish_one(self, t: torch.Tensor, handle) -> None:
        if handle is not None:
            handle.wait()
        t.div_(self.n)
