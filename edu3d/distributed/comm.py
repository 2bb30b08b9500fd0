"""Instrumented collectives: torch.distributed's operations, each recorded as a trace event.

After reading this file you should understand:

* the handful of collectives every parallelism is built from — all-reduce, all-gather,
  reduce-scatter, broadcast, and point-to-point send/recv — and which buffer each one fills;
* why edu3d always reduces with ``SUM`` and divides itself: ``ReduceOp.AVG`` and
  ``PREMUL_SUM`` are missing or broken on gloo in some torch versions (DESIGN.md);
* that torch 2.13 renamed ``all_gather_into_tensor``/``reduce_scatter_tensor`` to
  ``all_gather_single``/``reduce_scatter_single``; one shim below picks whichever exists.

Every function takes the process group explicitly (``group=mesh.dp``) and records an event
with the group's name and size, the buffer size in bytes, and start/end times. Asynchronous
calls (``async_op=True``) return a handle; the event ends when ``wait()`` returns, so overlap
of communication with computation is visible on the timeline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.distributed import trace

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)

_GROUP_NAMES = {"default_pg": "world", "undefined": "group"}


def group_name(group) -> str:
    """A short name for a process group: the ``group_desc`` it was created with."""
    pg = group if group is not None else dist.group.WORLD
    desc = getattr(pg, "group_desc", "world")
    return _GROUP_NAMES.get(desc, desc)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Timed:
    """Wraps an async work handle; the trace event ends when ``wait()`` is called."""

    def __init__(self, work, ev: dict, rec: trace.Recorder):
        self.work, self.ev, self.rec = work, ev, rec

    def wait(self):
        if self.ev:
            self.rec.waiting(self.ev)  # a hang here shows in the flight record
        self.work.wait()
        if self.ev:
            self.rec.end(self.ev)
            self.ev = {}  # written once, however often wait() is called
        return True

    def is_completed(self):
        return self.work.is_completed()


def _run(op: str, fn, buf: torch.Tensor, group, async_op: bool, peer: int | None = None):
    rec = trace.current()
    fields = {"group": group_name(group), "n": dist.get_world_size(group),
              "bytes": _nbytes(buf), "peer": peer}
    if async_op:
        ev = rec.begin("comm", op, **fields)
        return _Timed(fn(True), ev, rec)
    with rec.span("comm", op, **fields):
        fn(False)
    return None


def all_reduce(t: torch.Tensor, group=None, *, async_op: bool = False):
    """Sum ``t`` across the group, in place (divide by the group size yourself to average)."""
    return _run("all_reduce", lambda a: dist.all_reduce(t, group=group, async_op=a),
                t, group, async_op)


def all_gather(out: torch.Tensor, t: torch.Tensor, group=None, *, async_op: bool = False):
    """Concatenate every rank's ``t`` (equal sizes) along dim 0 into ``out``."""
    return _run("all_gather", lambda a: _all_gather_single(out, t, group=group, async_op=a),
                out, group, async_op)


def reduce_scatter(out: torch.Tensor, t: torch.Tensor, group=None, *, async_op: bool = False):
    """Sum ``t`` across ranks and give rank i the i-th equal slice (along dim 0) in ``out``."""
    return _run("reduce_scatter",
                lambda a: _reduce_scatter_single(out, t, group=group, async_op=a),
                t, group, async_op)


def all_to_all(out: torch.Tensor, t: torch.Tensor, group=None, *, out_splits=None,
               in_splits=None, async_op: bool = False):
    """Rank i sends row block j of ``t`` (``in_splits[j]`` rows, along dim 0) to rank j, and
    receives rank j's block for it into row block j of ``out`` (``out_splits[j]`` rows).
    ``None`` splits: equal blocks. gloo runs this (``all_to_all_single``); the list form
    ``all_to_all`` fails on gloo before torch 2.10. The bytes recorded are what this rank sends."""
    return _run("all_to_all",
                lambda a: dist.all_to_all_single(out, t, output_split_sizes=out_splits,
                                                 input_split_sizes=in_splits, group=group,
                                                 async_op=a),
                t, group, async_op)


class AllToAll(torch.autograd.Function):
    """:func:`all_to_all` with a backward: the gradient travels back by the same exchange with
    the splits swapped (what each rank received, it returns). ``AllToAll.apply(t, group,
    out_splits, in_splits)``; splits are lists of row counts (``None``: equal blocks)."""

    @staticmethod
    def forward(ctx, t, group, out_splits, in_splits):
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        rows = sum(out_splits) if out_splits is not None else t.shape[0]
        out = t.new_empty((rows, *t.shape[1:]))
        all_to_all(out, t.contiguous(), group, out_splits=out_splits, in_splits=in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        rows = sum(in_splits) if in_splits is not None else grad.shape[0]
        back = grad.new_empty((rows, *grad.shape[1:]))
        all_to_all(back, grad.contiguous(), ctx.group, out_splits=in_splits,
                   in_splits=out_splits)
        return back, None, None, None


def broadcast(t: torch.Tensor, src: int, group=None, *, async_op: bool = False):
    """Copy global rank ``src``'s ``t`` into every rank's ``t``."""
    return _run("broadcast", lambda a: dist.broadcast(t, src=src, group=group, async_op=a),
                t, group, async_op, peer=src)


def send(t: torch.Tensor, dst: int, group=None, *, async_op: bool = False):
    """Send ``t`` to global rank ``dst`` (which must post a matching :func:`recv`)."""
    fn = (lambda a: dist.isend(t, dst, group=group) if a else dist.send(t, dst, group=group))
    return _run("send", fn, t, group, async_op, peer=dst)


def recv(t: torch.Tensor, src: int, group=None, *, async_op: bool = False):
    """Receive into ``t`` from global rank ``src``."""
    fn = (lambda a: dist.irecv(t, src, group=group) if a else dist.recv(t, src, group=group))
    return _run("recv", fn, t, group, async_op, peer=src)


def barrier(group=None) -> None:
    rec = trace.current()
    with rec.span("comm", "barrier", group=group_name(group), n=dist.get_world_size(group)):
        dist.barrier(group=group)


def broadcast_object(obj, src: int = 0, group=None):
    """Global rank ``src``'s ``obj`` (any picklable value), returned on every rank: a
    traced ``broadcast_object_list`` of one element (its size in bytes is unknown until it
    arrives, so the event has none)."""
    box = [obj]
    rec = trace.current()
    with rec.span("comm", "broadcast_object", group=group_name(group),
                  n=dist.get_world_size(group), peer=src):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
