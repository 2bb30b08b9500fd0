"""The pipeline engine: a small interpreter of a rank's action list.

After reading this file you should understand how a schedule (data) becomes a run:

* ``F`` runs the stage's forward on micro-batch ``i`` and keeps what its backward needs; on
  the last stage it also computes the loss, **scaled by 1/m** so that the gradients summed
  over m micro-batches equal the gradient of the global batch's mean loss (forget it and
  gradients are m times too big; Adam hides that, plain SGD does not);
* ``B`` back-propagates through the stage; ``I`` computes only the gradient of the stage's
  input (what the previous stage waits for) and ``W`` only the weights' (what nobody waits
  for), using the same split as PyTorch's zero-bubble schedules;
* messages: consecutive sends are posted together as one ``batch_isend_irecv`` and never
  block (their handles are waited at the end of the step); receives are posted *early*
  (see :meth:`PipelineEngine._prepost`: a send whose receive is not yet posted stalls until
  the sender's next library call), and a ``RECV`` action waits for its tensor. Each message
  has a tag naming ``(direction, stage, micro-batch)``, so two messages between the same
  ranks cannot be confused;
* shapes: a receive buffer must have the shape of the tensor that will arrive, and under
  ``--batching pad|bucket|tokens`` every micro-batch has its own ``[B, T]``. Every rank of a
  pipeline holds the whole step's batch (the trainer cuts it the same way on each stage), so
  a receiver reads micro-batch ``i``'s ``[B, T]`` off its own copy: the message is
  ``[B, T / k, *rest]`` (``k`` is 1, or tp under sequence parallelism). Only that rule
  (dtype, ``k``, the rest) crosses the wire, once per channel (direction and stage pair) in
  the first step, as a small metadata tensor. Megatron's ``variable_seq_lengths`` has to send
  each micro-batch's shape ahead of its tensor; here it is free. A sender whose tensor breaks
  the rule raises an error instead of corrupting the receiver;
* every executed action is a trace event (``compute`` F/B/I/W, ``comm`` send/recv on group
  ``pp``) and after each compute action a ``mem`` event holds the bytes of activations this
  rank keeps (measured with ``saved_tensors_hooks``): every run has a measured timeline.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from edu3d.distributed import trace
from edu3d.schedules.actions import Action, stage_rank
from edu3d.parallel.pp.stage import PipelineStage

def scaled_loss(loss: torch.Tensor, m: int) -> torch.Tensor:
    """What a micro-batch back-propagates: its mean loss divided by the number of micro-batches,
    so the m gradients add up to the gradient of the mean over the whole batch."""
    return loss / m


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_META_LEN = 8


class _ActivationMeter:
    """Counts the bytes autograd saves for backward (parameters excluded).

    Parameters are recognised by their storage's address *now*: ZeRO-3 frees a unit's
    storage after use and gathers it again, possibly at an address an activation held
    meanwhile, so the addresses are looked up at every save. A recomputed (checkpointed) block saves
    only its input here; what its recomputation saves in backward is not held in between."""

    def __init__(self, params):
        self.params = list(params)
        self.param_ptrs = self._param_ptrs()
        self.bytes = 0
        self._seen: set[int] = set()

    def _param_ptrs(self) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in self.params}

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        self.param_ptrs = self._param_ptrs()
        if ptr not in self.param_ptrs and ptr not in self._seen:
            self._seen.add(ptr)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self.bytes, self._seen = 0, set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class PipelineEngine:
    """Runs one rank's actions for one step.

    ``stages`` maps global stage index -> :class:`PipelineStage` (this rank's); ``ranks``
    lists the global ranks of the pipeline group in stage-rank order; ``group`` is that
    process group; ``placement`` says which of them holds each stage (``"loop"`` or ``"v"``,
    :func:`~edu3d.schedules.actions.stage_rank`). ``microbatch_loss(loss, m)`` turns a
    micro-batch's mean loss into what is back-propagated (default ``loss / m``;
    ``lambda loss, m: loss`` is the classic bug).

    ``action_context(action, last)``, when given, wraps every compute action in a context
    manager; ``last`` says whether it is the stage's last forward (for ``F``) or the last
    action that adds to the stage's weight gradients (``B`` or ``W``). That is how data
    parallelism keeps quiet until a stage's gradients are complete (``no_sync``) and ZeRO-3
    keeps a stage's parameters gathered across its micro-batches.
    """

    def __init__(self, stages: dict[int, PipelineStage], actions: list[Action], n_stages: int,
                 ranks: list[int], group, microbatches: int,
                 microbatch_loss: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                 action_context: Callable[[Action, bool], contextlib.AbstractContextManager]
                 | None = None, placement: str = "loop"):
        self.stages, self.actions, self.n_stages = stages, actions, n_stages
        self.placement = placement
        self.ranks, self.group, self.m = ranks, group, microbatches
        self.pp = len(ranks)
        self.microbatch_loss = microbatch_loss or scaled_loss
        self.action_context = action_context
        params = [p for st in stages.values() for p in st.parameters()]
        self.device = params[0].device if params else torch.device("cpu")
        # cut the first stage's graph after the embedding only where I/W split the backward
        self.split_backward = any(a.kind in ("I", "W") for a in actions)
        self.last = {}  # (kind, stage) -> index of the stage's last F and last B/W action
        for i, a in enumerate(actions):
            if a.kind in ("F", "B", "W"):
                self.last[("F" if a.kind == "F" else "BW", a.stage)] = i
        self.meter = _ActivationMeter(params)
        self.activation_bytes: dict[tuple, int] = {}  # (stage, micro-batch shape) -> bytes
        self.peak_in_flight = 0
        self.peak_activation_bytes = 0
        # each channel's shape rule (dtype, k, first message's shape), from the first step's
        # metadata: per (direction, sending stage)
        self.shapes: dict[tuple, tuple] = {}  # receiver side
        self.sent_shapes: dict[tuple, tuple] = {}  # sender side

    # ---- messages ---------------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        return self.ranks[stage_rank(stage, self.pp, self.placement)]

    def _tag(self, direction: str, from_stage: int, mb: int | None) -> int:
        """A distinct tag per (direction, sending stage, micro-batch); ``None`` = metadata."""
        slot = self.m if mb is None else mb
        return ((from_stage * 2 + (direction == "B")) * (self.m + 1) + slot) + 1

    def _send(self, sends: list[Action]) -> None:
        """Post a run of consecutive sends as one batch; they complete in the background."""
        rec = trace.current()
        ops = []
        for a in sends:
            direction = a.kind[-1]  # F or B
            peer = self._peer(a.stage + (1 if direction == "F" else -1))
            t = (self.out_send if direction == "F" else self.grad_send).pop((a.stage, a.mb))
            t = t.contiguous()  # a sequence-parallel shard is a strided view
            rule = self.sent_shapes.get((direction, a.stage))
            if rule is not None and (t.dtype, t.shape) != self._expect(rule, a.mb):
                dtype, shape = self._expect(rule, a.mb)
                raise ValueError(
                    f"stage {a.stage} sends {tuple(t.shape)} {t.dtype} for micro-batch {a.mb}, "
                    f"but its receiver expects {tuple(shape)} {dtype} (the micro-batch's "
                    f"[B, T] = {tuple(self.batch[a.mb][0].shape)} and the first step's rule)")
            if rule is None:  # first message of the channel: tell the receiver the rule
                rule = self._rule(t, a.mb)
                self.sent_shapes[(direction, a.stage)] = rule
                meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.device)
                meta[: 3 + t.dim()] = torch.tensor([t.dim(), _DTYPES.index(t.dtype), rule[1],
                                                    *t.shape])
                ops.append(dist.P2POp(dist.isend, meta, peer, self.group,
                                      self._tag(direction, a.stage, None)))
                self.keep.append(meta)
            ops.append(dist.P2POp(dist.isend, t, peer, self.group,
                                  self._tag(direction, a.stage, a.mb)))
            self.keep.append(t)
            now = rec.now()
            rec.record("comm", "send", now, now, group="pp", n=self.pp, peer=peer,
                       bytes=t.numel() * t.element_size(), mb=a.mb, stage=a.stage,
                       chunk=a.stage // self.pp)
        self.pending_sends.extend(dist.batch_isend_irecv(ops))

    def _prepost(self) -> None:
        """Post every receive of the step as early as possible.

        A gloo send whose receive is not posted yet waits until the *sender* next enters the
        library, which on a busy rank can be a whole compute action later. So at the start of
        a step the data receives of every channel whose shape is known are all posted; on the
        first step only the small metadata receives are, and each channel's data receives
        follow as soon as its metadata has arrived (checked between actions).
        """
        for channel in self.channels:
            if channel in self.shapes:
                self._post_channel(channel)
                continue
            direction, from_stage = channel
            meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.device)
            work = dist.irecv(meta, self._peer(from_stage), self.group,
                              self._tag(direction, from_stage, None))
            self.meta_pending[channel] = (meta, work)

    def _progress(self, block_on: tuple | None = None) -> None:
        """Post the data receives of every channel whose metadata has arrived."""
        for channel, (meta, work) in list(self.meta_pending.items()):
            if channel != block_on and not work.is_completed():
                continue
            work.wait()
            del self.meta_pending[channel]
            ndim, dtype, k = int(meta[0]), _DTYPES[int(meta[1])], int(meta[2])
            self.shapes[channel] = (dtype, k, torch.Size(meta[3:3 + ndim].tolist()))
            self._post_channel(channel)

    def _rule(self, t: torch.Tensor, mb: int) -> tuple:
        """How a channel's tensors follow their micro-batch: ``(dtype, k, shape)``, where
        ``k > 0`` says "``[B, T / k, *shape[2:]]`` of the micro-batch's ``[B, T]``" and
        ``k = 0`` "always ``shape``" (a tensor that is not ``[B, T / k, ...]``)."""
        x = self.batch[mb][0]
        if x.dim() < 2 or t.dim() < 2 or t.shape[0] != x.shape[0] or not t.shape[1] \
                or x.shape[1] % t.shape[1]:
            return t.dtype, 0, t.shape
        return t.dtype, x.shape[1] // t.shape[1], t.shape

    def _expect(self, rule: tuple, mb: int) -> tuple:
        """``(dtype, shape)`` of micro-batch ``mb``'s message on a channel with ``rule``:
        computed from this rank's own copy of the micro-batch, never sent."""
        dtype, k, shape = rule
        if not k:
            return dtype, shape
        b, n = self.batch[mb][0].shape[:2]
        return dtype, torch.Size([b, n // k, *shape[2:]])

    def _post_channel(self, channel: tuple) -> None:
        """Post the receives of all of a channel's micro-batches in this step, each with the
        shape of its own micro-batch."""
        direction, from_stage = channel
        ops = []
        for a in self.channels[channel]:
            dtype, shape = self._expect(self.shapes[channel], a.mb)
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, self._peer(from_stage), self.group,
                                  self._tag(direction, from_stage, a.mb)))
            self.posted[(a.kind, a.stage, a.mb)] = buf
        for op, w in zip(ops, dist.batch_isend_irecv(ops)):
            self.recv_work[id(op.tensor)] = w

    def _recv(self, a: Action) -> None:
        """Wait for a (pre-posted) receive: the comm event lasts as long as the rank waited."""
        rec = trace.current()
        direction = a.kind[-1]
        from_stage = a.stage + (-1 if direction == "F" else 1)
        ev = rec.begin("comm", "recv", group="pp", n=self.pp, peer=self._peer(from_stage),
                       mb=a.mb, stage=a.stage, chunk=a.stage // self.pp)
        rec.waiting(ev)  # the flight record says this rank waits for a peer (the heartbeat)
        if (a.kind, a.stage, a.mb) not in self.posted:
            self._progress(block_on=(direction, from_stage))
        buf = self.posted.pop((a.kind, a.stage, a.mb))
        self.recv_work.pop(id(buf)).wait()
        (self.inputs if direction == "F" else self.grads_in)[(a.stage, a.mb)] = buf
        ev["bytes"] = buf.numel() * buf.element_size()
        rec.end(ev)

    # ---- compute ----------------------------------------------------------------------------
    def _forward(self, s: int, i: int) -> None:
        stage = self.stages[s]
        # (x, y), or (x, y, doc, weight) under --batching (edu3d.train.batching): packed
        # documents' ids, and the weight that makes the loss a mean over the global batch's tokens
        x_mb, y_mb, *more = self.batch[i]
        doc, weight = more or (None, None)
        extra = () if doc is None else (doc,)
        # every micro-batch of a stage saves the same tensors: count them once (the hook is a
        # Python call per saved tensor, too slow to leave on)
        shape = (s, tuple(x_mb.shape))
        measure = shape not in self.activation_bytes
        with self.meter if measure else contextlib.nullcontext():
            emb = None
            if stage.is_first and self.split_backward:
                emb = stage.embed(x_mb, *extra)
                x = emb.detach().requires_grad_()
            elif stage.is_first:
                x = stage.embed(x_mb, *extra)
            else:
                x = self.inputs.pop((s, i)).requires_grad_()
            out = stage(x, *extra)
            if stage.is_last:
                loss = stage.loss(out, y_mb)
                if weight is not None:  # 0: a context-parallel piece of padding only, whose
                    # mean is 0/0; it still runs backward (its K, V serve the other ranks)
                    loss = loss * weight if weight else loss.nan_to_num(0.0) * 0.0
                self.losses.append(loss.detach())
                out = self.microbatch_loss(loss, self.m)
        if measure:
            self.activation_bytes[shape] = self.meter.bytes
        self.saved[(s, i)] = (emb, x, out, self.activation_bytes[shape])
        if not stage.is_last:
            if s + 1 in self.stages:  # next stage on this rank (pp = 1): hand over directly
                self.inputs[(s + 1, i)] = out.detach()
            else:
                self.out_send[(s, i)] = out.detach()

    def _grad_out(self, s: int, i: int):
        return None if self.stages[s].is_last else self.grads_in.pop((s, i))

    def _pass_grad_back(self, s: int, i: int, x: torch.Tensor, emb) -> None:
        if self.stages[s].is_first:  # nothing before the first stage
            return
        if s - 1 in self.stages:
            self.grads_in[(s - 1, i)] = x.grad
        else:
            self.grad_send[(s, i)] = x.grad

    def _backward(self, s: int, i: int) -> None:
        emb, x, out, _ = self.saved.pop((s, i))
        g = self._grad_out(s, i)
        if out.requires_grad:  # not when a first stage's every parameter is frozen (--freeze)
            torch.autograd.backward(out, g)
        if emb is not None and emb.requires_grad:
            emb.backward(x.grad)
        self._pass_grad_back(s, i, x, emb)

    def _backward_input(self, s: int, i: int) -> None:
        emb, x, out, nbytes = self.saved[(s, i)]
        g = self._grad_out(s, i)
        _, groups = stage_backward_input([out], None if g is None else [g], [x],
                                         iter(self._trainable(s)))
        self.saved[(s, i)] = (emb, x, groups, nbytes)
        self._pass_grad_back(s, i, x, emb)

    def _backward_weight(self, s: int, i: int) -> None:
        emb, x, groups, _ = self.saved.pop((s, i))
        params = self._trainable(s)
        if params:
            stage_backward_weight(iter(params), groups)
        # torch sets these gradients outside autograd's accumulation, so the post-accumulate
        # hooks that data parallelism and ZeRO listen to did not run: run them (last layer
        # first, the order backward would have produced them)
        for p in reversed(params):
            for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(p)
        if emb is not None and emb.requires_grad:
            emb.backward(x.grad)

    def _trainable(self, s: int) -> list:
        """Stage ``s``'s body parameters that get a gradient (frozen ones get none)."""
        return [p for p in self.stages[s].body_parameters() if p.requires_grad]

    # ---- the interpreter ----------------------------------------------------------------------
    def _context(self, a: Action, index: int):
        if self.action_context is None:
            return contextlib.nullcontext()
        key = ("F" if a.kind == "F" else "BW", a.stage)
        return self.action_context(a, self.last.get(key) == index)

    def run(self, batch: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Execute the action list on ``batch`` (this rank's m micro-batches); gradients
        accumulate in the stages' parameters. Returns the last stage's per-micro-batch
        (unscaled) losses, empty on other ranks."""
        if len(batch) != self.m:
            raise ValueError(f"the schedule was built for {self.m} micro-batches, got "
                             f"{len(batch)}")
        self.batch, self.losses = batch, []
        self.inputs, self.grads_in, self.out_send, self.grad_send = {}, {}, {}, {}
        self.saved, self.pending_sends, self.keep = {}, [], []
        self.meta_pending, self.posted, self.recv_work = {}, {}, {}
        self.channels: dict[tuple, list[Action]] = {}  # (direction, from stage) -> its RECVs
        for a in self.actions:
            if a.kind.startswith("RECV"):
                d = a.kind[-1]
                self.channels.setdefault((d, a.stage + (-1 if d == "F" else 1)), []).append(a)
        self._prepost()
        rec = trace.current()
        run = {"F": self._forward, "B": self._backward, "I": self._backward_input,
               "W": self._backward_weight}
        sends: list[Action] = []
        for index, a in enumerate(self.actions):
            if a.kind.startswith("SEND"):
                sends.append(a)
                continue
            if sends:  # consecutive sends go out as one batch
                self._send(sends)
                sends = []
            self._progress()
            if a.kind.startswith("RECV"):
                self._recv(a)
                continue
            with rec.span("compute", a.kind, mb=a.mb, stage=a.stage, chunk=a.stage // self.pp), \
                    self._context(a, index):
                run[a.kind](a.stage, a.mb)
            held = sum(v[3] for v in self.saved.values())
            self.peak_in_flight = max(self.peak_in_flight, len(self.saved))
            self.peak_activation_bytes = max(self.peak_activation_bytes, held)
            rec.mark_memory("activations", activations=held)
        if sends:
            self._send(sends)
        for w in self.pending_sends:
            w.wait()
        self.keep.clear()
        return self.losses
