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
    the parameters are grouped into buckets of about ``bucket_mb`` MB in *reverse*
    registration order (backward produces the last layer's gradients first), one dtype per
    bucket. Each bucket's gradients live in one flat buffer (``p.grad`` is a view into it, so
    autograd writes them there directly); when a bucket's last gradient arrives, one
    asynchronous all-reduce sends the whole bucket. Few messages *and* overlap.

Every version sums with ``SUM`` and divides by N itself (``ReduceOp.AVG`` is broken on gloo).
The average of the N local mean losses is the global mean loss, so the averaged gradient is
exactly the serial model's gradient. With gradient accumulation over K micro-batches each
micro-batch's loss is divided by K, and :meth:`DataParallel.no_sync` skips communication on
all but the last micro-batch: gradients accumulate locally and are sent once.

As a library in an ordinary PyTorch loop, on any model, it behaves as torch DDP does:

* **any ``zero_grad``**: the gradient hook uses the gradient autograd hands it. After
  ``optimizer.zero_grad()`` (``p.grad = None``) autograd allocates a fresh gradient that is
  not a view of the bucket; the hook copies it into the bucket and makes ``p.grad`` the view
  again, so every placement of ``zero_grad``, either ``set_to_none``, gives the average;
* **launch order**: every rank must issue the same collectives in the same order, so the
  asynchronous versions launch strictly in bucket (or reverse-parameter) order, and
  :meth:`~DataParallel.finish` launches whatever backward did not (a parameter that got no
  gradient here, or a last backward run inside ``no_sync``);
* **unused parameters**: a parameter that got no gradient this step is an error naming it,
  unless ``find_unused_parameters=True``. Then it contributes zero, a parameter no rank used
  keeps its gradient untouched (``None`` stays ``None``: AdamW neither decays it nor moves
  its moments), and one that another rank used gets the average (one small all-reduce of a
  "used" flag per parameter decides which);
* **buffers** (running statistics, a random buffer) are broadcast from the group's first
  rank before each forward that follows a synchronising one (``broadcast_buffers=True``, the
  default), one broadcast per dtype, and once at construction.

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


@dataclass
class Bucket:
    """Parameters whose gradients travel together, and the flat buffer they live in
    (``None`` for ``overlap``'s one-parameter units, which all-reduce ``p.grad`` itself)."""

    params: list
    buffer: torch.Tensor | None
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
    A flat buffer has one dtype, so each dtype (and device) fills buckets of its own; the
    buckets are then ordered by their first parameter, as torch DDP orders them.
    """
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb={bucket_mb} must be positive (e.g. 25, PyTorch's default)")
    order = list(reversed(params)) if reverse else list(params)
    limit = bucket_mb * 2**20
    first = min(first_bucket_mb, bucket_mb) * 2**20 if first_bucket_mb else limit
    groups, filling, closed = [], {}, set()  # filling: kind -> [params, bytes]
    for p in order:
        kind = (p.dtype, p.device)
        current = filling.setdefault(kind, [[], 0])
        current[0].append(p)
        current[1] += p.numel() * p.element_size()
        if current[1] >= (limit if kind in closed else first):
            groups.append(filling.pop(kind)[0])
            closed.add(kind)
    groups += [ps for ps, _ in filling.values()]
    position = {id(p): i for i, p in enumerate(order)}
    groups.sort(key=lambda ps: position[id(ps[0])])
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

    Usage per step: ``dp.zero_grad()`` (or the optimizer's or the model's ``zero_grad``, at
    any point of the loop); forward/backward for each micro-batch (all but the last inside
    ``with dp.no_sync():``); ``dp.finish()``; then clip and step as usual.
    ``comm_hook(tensor, group) -> handle`` replaces the all-reduce of a bucket (compression,
    see :mod:`edu3d.parallel.dp.compress`); it must sum, :meth:`finish` divides by N.

    ``params`` (default: all of ``model``'s) are the ones averaged, and ``divisor`` (default
    N) what their sums are divided by: expert parallelism averages its experts' gradients
    over the expert-data-parallel group but divides by the whole ``dp x cp`` size.
    ``find_unused_parameters`` and ``broadcast_buffers`` have torch DDP's meaning (module
    docstring); a wrapper given its own ``params`` list owns no buffers.
    """

    def __init__(self, model: torch.nn.Module, group=None, impl: str = "bucketed",
                 bucket_mb: float = 25.0, reverse_buckets: bool = True, comm_hook=None,
                 broadcast: bool = True, first_bucket_mb: float | None = 1.0,
                 params: list | None = None, divisor: int | None = None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True):
        if impl not in IMPLS:
            raise ValueError(f"dp impl {impl!r} is not one of {', '.join(IMPLS)}")
        self.model, self.group, self.impl = model, group, impl
        self.n = divisor or dist.get_world_size(group)
        self.params = [p for p in (model.parameters() if params is None else params)
                       if p.requires_grad]
        self.names = {p: name for name, p in model.named_parameters()}
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers and params is None
        self.sync = True
        self.comm_hook = comm_hook
        self.used: set = set()  # parameters whose gradient arrived since the last finish()
        self._pending: list = []  # (tensor, handle) of asynchronous all-reduces in flight
        self._zeros: dict = {}  # overlap: the zero gradient sent for a locally unused parameter
        self._next = 0  # the next unit (bucket, or parameter for overlap) to launch
        self._grads_seen = 0
        self._sync_buffers_next = True  # torch DDP's require_forward_param_sync
        self.launch_log: list = []  # (bucket, gradients ready when it was launched), last step
        self.buckets: list[Bucket] = []
        if broadcast:
            self.broadcast_parameters()
            if self.broadcast_buffers:
                self.broadcast_module_buffers()
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
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in self.params]
        if self.broadcast_buffers and any(True for _ in model.buffers()):
            self._hooks += [model.register_forward_pre_hook(self._before_forward),
                            model.register_forward_hook(self._after_forward)]

    # ---- setup ----------------------------------------------------------------------------
    def _src(self) -> int:
        return dist.get_process_group_ranks(self.group)[0] if self.group else 0

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Start from the same weights everywhere: copy the group's first rank's parameters."""
        for p in self.params:
            comm.broadcast(p.data, self._src(), self.group)

    @torch.no_grad()
    def broadcast_module_buffers(self) -> None:
        """Copy the group's first rank's buffers to every rank, one broadcast per dtype (the
        model's buffers are looked up each time: a module may have replaced one)."""
        kinds: dict = {}
        for b in self.model.buffers():
            kinds.setdefault((b.dtype, b.device), []).append(b)
        for bufs in kinds.values():
            flat = torch.cat([b.reshape(-1) for b in bufs])
            comm.broadcast(flat, self._src(), self.group)
            for b, piece in zip(bufs, flat.split([b.numel() for b in bufs])):
                b.copy_(piece.view_as(b))

    def _before_forward(self, module, args) -> None:
        if self._sync_buffers_next:
            self.broadcast_module_buffers()

    def _after_forward(self, module, args, output) -> None:
        # as torch DDP: the next forward syncs buffers only after one that will sync gradients
        self._sync_buffers_next = torch.is_grad_enabled() and self.sync

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
    def zero_grad(self, set_to_none: bool = False) -> None:
        """Forget the gradients. Buckets are zeroed in place and ``p.grad`` stays their view
        (autograd then writes into them directly); ``set_to_none=True`` sets ``p.grad = None``
        as ``optimizer.zero_grad()`` does. The other versions always set ``None``."""
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

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        self.used.add(p)
        if self.buckets:
            self._adopt(p)
        if not self.sync or not self._units:
            return
        self._unit_of[p][0].ready += 1
        self._grads_seen += 1
        self._launch(force=False)

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
                self._pending.append((t, self._all_reduce(t, async_op=True)))
            else:
                if self._next == 0:
                    self.launch_log = []
                self.launch_log.append((u.index, self._grads_seen))
                with trace.current().context(chunk=u.index):
                    self._pending.append((u.buffer, self._all_reduce(u.buffer, async_op=True)))
            self._next += 1

    def finish(self) -> None:
        """Make every ``p.grad`` the average over the group (call after the last backward)."""
        unused = [p for p in self.params if p not in self.used]
        if unused and not self.find_unused_parameters:
            self._drain()  # the all-reduces already launched end on every rank alike
            self._reset()
            raise RuntimeError(self._unused_message(unused))
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

    def _unused_message(self, unused: list) -> str:
        names = [self.names.get(p, f"a parameter of shape {tuple(p.shape)}") for p in unused]
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        rank = dist.get_rank()
        return (f"rank {rank}: {len(unused)} parameter(s) got no gradient in this step: "
                f"{shown}. Every rank must reduce every gradient: use them in the loss, or "
                "pass DataParallel(..., find_unused_parameters=True) as with torch DDP")

    def _drain(self) -> None:
        for t, handle in self._pending:
            self._finish_one(t, handle)
        self._pending = []

    def _reset(self) -> None:
        """A new step: no gradient seen, no unit launched."""
        self.used = set()
        self._zeros = {}
        for u in self._units:
            u.ready = 0
        self._next, self._grads_seen = 0, 0

    def _finish_one(self, t: torch.Tensor, handle) -> None:
        if handle is not None:
            handle.wait()
        t.div_(self.n)
