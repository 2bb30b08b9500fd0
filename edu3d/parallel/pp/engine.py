"""The pipeline engine: a small interpreter of a rank's action list.

After reading this file you should understand how a schedule (data) becomes a run:

* ``F`` runs the stage's forward on micro-batch ``i`` and keeps what its backward needs; on
  the last stage it also computes the loss, **scaled by 1/m** so that the gradients summed
  over m micro-batches equal the gradient of the global batch's mean loss (forget it and
  gradients are m times too big; Adam hides that, plain SGD does not);
* ``B`` back-propagates through the stage; ``I`` computes only the gradient of the stage's
  input (what the previous stage waits for) and ``W`` only the weights' (what nobody waits
  for), using the same split as PyTorch's zero-bubble schedules;
* messages: consecutive ``SEND``/``RECV`` actions are posted together as one
  ``batch_isend_irecv`` (Megatron's ``send_forward_recv_backward`` where two directions
  meet). Sends never block (their handles are waited at the end of the step); a receive
  blocks until its tensor is there. Each message has a tag naming ``(direction, stage,
  micro-batch)``, so two messages between the same ranks cannot be confused;
* shapes: the first message of each channel in a step is preceded by a small metadata
  tensor ``[ndim, dtype, *shape]``, so a receiver allocates the right buffer without being
  told shapes in advance;
* every executed action is a trace event (``compute`` F/B/I/W, ``comm`` send/recv on group
  ``pp``) and after each compute action a ``mem`` event holds the bytes of activations this
  rank keeps (measured with ``saved_tensors_hooks``): every run has a measured timeline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d import trace
from edu3d.parallel.pp.schedules import Action
from edu3d.parallel.pp.stage import PipelineStage

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_META_LEN = 8


class _ActivationMeter:
    """Counts the bytes autograd saves for backward (parameters excluded)."""

    def __init__(self, params):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.bytes = 0
        self._seen: set[int] = set()

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
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
    process group; ``scale_loss=False`` reproduces the classic bug (no 1/m).
    """

    def __init__(self, stages: dict[int, PipelineStage], actions: list[Action], n_stages: int,
                 ranks: list[int], group, microbatches: int, scale_loss: bool = True):
        self.stages, self.actions, self.n_stages = stages, actions, n_stages
        self.ranks, self.group, self.m = ranks, group, microbatches
        self.pp = len(ranks)
        self.scale_loss = scale_loss
        self.meter = _ActivationMeter([p for st in stages.values() for p in st.parameters()])
        self.peak_in_flight = 0
        self.peak_activation_bytes = 0

    # ---- messages ---------------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        return self.ranks[stage % self.pp]

    def _tag(self, direction: str, from_stage: int, mb: int, meta: bool) -> int:
        return ((from_stage * 2 + (direction == "B")) * self.m + mb) * 2 + int(meta) + 1

    def _post(self, comms: list[Action]) -> None:
        """Post a run of consecutive messages together; wait for the receives."""
        rec = trace.current()
        ops, recvs, metas = [], [], []
        for a in comms:
            direction = a.kind[-1]  # F or B
            if a.kind.startswith("SEND"):
                peer_stage = a.stage + (1 if direction == "F" else -1)
                t = (self.out_send if direction == "F" else self.grad_send).pop((a.stage, a.mb))
                if (direction, a.stage) not in self.meta_sent:
                    self.meta_sent.add((direction, a.stage))
                    meta = torch.zeros(_META_LEN, dtype=torch.int64)
                    meta[: 2 + t.dim()] = torch.tensor([t.dim(), _DTYPES.index(t.dtype),
                                                        *t.shape])
                    ops.append(dist.P2POp(dist.isend, meta, self._peer(peer_stage), self.group,
                                          self._tag(direction, a.stage, a.mb, True)))
                    self.keep.append(meta)
                ops.append(dist.P2POp(dist.isend, t, self._peer(peer_stage), self.group,
                                      self._tag(direction, a.stage, a.mb, False)))
                self.keep.append(t)
                rec.record("comm", "send", rec.now(), rec.now(), group="pp", n=self.pp,
                           peer=self._peer(peer_stage), bytes=t.numel() * t.element_size(),
                           mb=a.mb, stage=a.stage, chunk=a.stage // self.pp)
            else:
                from_stage = a.stage + (-1 if direction == "F" else 1)
                channel = (direction, from_stage)
                recvs.append((a, from_stage, channel))
                if channel not in self.channels:
                    meta = torch.zeros(_META_LEN, dtype=torch.int64)
                    metas.append((channel, meta))
                    ops.append(dist.P2POp(dist.irecv, meta, self._peer(from_stage), self.group,
                                          self._tag(direction, from_stage, a.mb, True)))
        t0 = rec.now()
        works = dist.batch_isend_irecv(ops) if ops else []
        sends = [w for op, w in zip(ops, works) if op.op is dist.isend]
        self.pending_sends.extend(sends)
        for op, w in zip(ops, works):
            if op.op is not dist.isend:
                w.wait()  # metadata first: it says how big the data is
        for channel, meta in metas:
            ndim, code = int(meta[0]), int(meta[1])
            self.channels[channel] = (torch.Size(meta[2:2 + ndim].tolist()), _DTYPES[code])
        data_ops, bufs = [], []
        for a, from_stage, channel in recvs:
            shape, dtype = self.channels[channel]
            buf = torch.empty(shape, dtype=dtype)
            bufs.append((a, buf))
            data_ops.append(dist.P2POp(dist.irecv, buf, self._peer(from_stage), self.group,
                                       self._tag(a.kind[-1], from_stage, a.mb, False)))
        for w in (dist.batch_isend_irecv(data_ops) if data_ops else []):
            w.wait()
        t1 = rec.now()
        for a, buf in bufs:
            (self.inputs if a.kind == "RECV_F" else self.grads_in)[(a.stage, a.mb)] = buf
            rec.record("comm", "recv", t0, t1, group="pp", n=self.pp,
                       peer=self._peer(a.stage + (-1 if a.kind == "RECV_F" else 1)),
                       bytes=buf.numel() * buf.element_size(), mb=a.mb, stage=a.stage,
                       chunk=a.stage // self.pp)

    # ---- compute ----------------------------------------------------------------------------
    def _forward(self, s: int, i: int) -> None:
        stage = self.stages[s]
        x_mb, y_mb = self.batch[i]
        with self.meter:
            if stage.is_first:
                emb = stage.embed(x_mb)
                x = emb.detach().requires_grad_()
            else:
                emb = None
                x = self.inputs.pop((s, i)).requires_grad_()
            out = stage(x)
            if stage.is_last:
                loss = stage.loss(out, y_mb)
                self.losses.append(loss.detach())
                out = loss / self.m if self.scale_loss else loss
        self.saved[(s, i)] = (emb, x, out, self.meter.bytes)
        if not stage.is_last:
            if s + 1 in self.stages:  # next stage on this rank (pp = 1): hand over directly
                self.inputs[(s + 1, i)] = out.detach()
            else:
                self.out_send[(s, i)] = out.detach()

    def _grad_out(self, s: int, i: int):
        return None if self.stages[s].is_last else self.grads_in.pop((s, i))

    def _pass_grad_back(self, s: int, i: int, x: torch.Tensor, emb) -> None:
        if emb is not None:  # first stage: the embedding's weights get x's gradient now
            return
        if s - 1 in self.stages:
            self.grads_in[(s - 1, i)] = x.grad
        else:
            self.grad_send[(s, i)] = x.grad

    def _backward(self, s: int, i: int) -> None:
        emb, x, out, _ = self.saved.pop((s, i))
        torch.autograd.backward(out, self._grad_out(s, i))
        if emb is not None:
            emb.backward(x.grad)
        self._pass_grad_back(s, i, x, emb)

    def _backward_input(self, s: int, i: int) -> None:
        from torch.distributed.pipelining._backward import stage_backward_input

        emb, x, out, nbytes = self.saved[(s, i)]
        g = self._grad_out(s, i)
        _, groups = stage_backward_input([out], None if g is None else [g], [x],
                                         iter(self.stages[s].body_parameters()))
        self.saved[(s, i)] = (emb, x, groups, nbytes)
        self._pass_grad_back(s, i, x, emb)

    def _backward_weight(self, s: int, i: int) -> None:
        from torch.distributed.pipelining._backward import stage_backward_weight

        emb, x, groups, _ = self.saved.pop((s, i))
        stage_backward_weight(iter(self.stages[s].body_parameters()), groups)
        if emb is not None:
            emb.backward(x.grad)

    # ---- the interpreter ----------------------------------------------------------------------
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
        self.meta_sent, self.channels = set(), {}  # per step: channels whose shape is known
        rec = trace.current()
        run = {"F": self._forward, "B": self._backward, "I": self._backward_input,
               "W": self._backward_weight}
        comms: list[Action] = []
        for a in self.actions:
            if not a.is_compute:
                comms.append(a)
                continue
            if comms:
                self._post(comms)
                comms = []
            with rec.span("compute", a.kind, mb=a.mb, stage=a.stage, chunk=a.stage // self.pp):
                run[a.kind](a.stage, a.mb)
            held = sum(v[3] for v in self.saved.values())
            self.peak_in_flight = max(self.peak_in_flight, len(self.saved))
            self.peak_activation_bytes = max(self.peak_activation_bytes, held)
            rec.mark_memory("activations", activations=held)
        if comms:
            self._post(comms)
        for w in self.pending_sends:
            w.wait()
        self.keep.clear()
        return self.losses
