"""Pipeline schedules as data: per rank, an ordered list of actions.

After reading this file you should understand:

* an *action* is written in PyTorch's notation (``torch.distributed.pipelining``):
  ``"0F3"`` = stage 0 runs the forward of micro-batch 3; ``B`` is a full backward, ``I`` the
  backward for the stage's *input* only, ``W`` the backward for its *weights* only;
  ``"2SEND_F3"`` = stage 2 sends micro-batch 3's activation on (to stage 3) and
  ``"3RECV_F3"`` = stage 3 receives it; ``"3SEND_B3"`` / ``"2RECV_B3"`` carry the gradient
  back. Global stage ``s`` lives on pipeline rank ``s % pp`` as its chunk ``s // pp``;
* a schedule is four simple loops:

  - **GPipe** (Huang et al. 2019): all forwards, then all backwards. Holds m micro-batches
    of activations.
  - **1F1B** (Narayanan et al. 2019, Megatron's rule): rank r runs ``p-r-1`` warm-up
    forwards, then alternates one forward, one backward, then cools down with the remaining
    backwards. Same bubble as GPipe, but at most ``p`` micro-batches in flight.
  - **interleaved 1F1B** (Narayanan et al. 2021): each rank holds ``v`` chunks; micro-batches
    go through the chunks in groups of ``p`` (Megatron's grouping), which divides the
    bubble by ``v``: ``(p-1)/(v·m+p-1)``.
  - **ZB-H1** (Qi et al. 2023): the backward is split into ``I`` (needed by the previous
    stage, on the critical path) and ``W`` (needed only by the optimizer), and rank ``r``
    postpones ``r`` of its ``W`` into the cool-down, where 1F1B would idle;

* the compute order is what a schedule *is*; :func:`with_comms` then adds the sends and
  receives each compute action needs, so the same list can be checked, simulated, executed
  and drawn.
"""

from __future__ import annotations

import re
from typing import NamedTuple

COMPUTE = ("F", "B", "I", "W")
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


class Action(NamedTuple):
    """One step of a rank's schedule: ``Action(2, "F", 3)`` prints as ``2F3``."""

    stage: int
    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ValueError(f"{text!r} is not an action; write stage, kind, micro-batch as in "
                             f"'0F3', '1B0', '2W1' or '1SEND_F2'")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))


def stage_rank(stage: int, pp: int) -> int:
    """The pipeline rank that holds global stage ``stage`` (chunks are dealt round-robin)."""
    return stage % pp


def _check(pp: int, m: int, vpp: int = 1) -> None:
    if pp < 1 or m < 1 or vpp < 1:
        raise ValueError(f"pp={pp}, microbatches={m}, vpp={vpp} must all be positive")


# ---- compute orders --------------------------------------------------------------------------
def gpipe(pp: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards (in the same micro-batch order, as PyTorch does)."""
    _check(pp, m)
    return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
            for r in range(pp)]


def one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    """Megatron's 1F1B: ``p-r-1`` warm-up forwards, steady one-forward-one-backward,
    then the remaining backwards."""
    _check(pp, m)
    out = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        ops = [Action(r, "F", i) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [Action(r, "F", warmup + i), Action(r, "B", i)]
        ops += [Action(r, "B", i) for i in range(m - warmup, m)]
        out.append(ops)
    return out


def _rounds(pp: int, m: int) -> int:
    """Micro-batches per group for interleaving: ``p`` when ``p`` divides ``m`` (Megatron);
    like PyTorch, ``m // max(1, m // p)`` otherwise, which must divide ``m``."""
    rounds = max(1, m // pp)
    if m % rounds:
        raise ValueError(f"interleaved needs microbatches a multiple of {rounds} "
                         f"(groups of ~pp={pp}); got {m}. Use a multiple of pp.")
    return m // rounds


def _interleaved_rank(r: int, pp: int, m: int, vpp: int, zero_bubble: bool) -> list[Action]:
    """One rank of interleaved 1F1B (or, with ``zero_bubble``, ZB-H1 / ZB1P).

    Forward step ``k`` runs chunk ``(k // g) % v`` (``g`` micro-batches per group), backward
    step ``k`` the chunks in reverse order; each chunk takes its micro-batches in order.
    """
    g = _rounds(pp, m)
    factor = 1 if zero_bubble else 2
    warmup = min((vpp - 1) * g + factor * (pp - 1 - r), m * vpp)
    total = m * vpp

    def fwd_stage(k):
        return ((k // g) % vpp) * pp + r

    def bwd_stage(k):
        return (vpp - 1 - ((k - warmup) // g) % vpp) * pp + r

    nxt = {"F": {}, "B": {}, "W": {}}

    def take(kind, stage):
        i = nxt[kind].get(stage, 0)
        nxt[kind][stage] = i + 1
        return i

    ops: list[Action] = []
    pending_w: list[int] = []  # stages whose W is still owed, oldest first
    back = "I" if zero_bubble else "B"
    for k in range(total + warmup):  # warmup forwards, steady pairs, cool-down backwards
        if k < total:
            s = fwd_stage(k)
            ops.append(Action(s, "F", take("F", s)))
        if k >= warmup:
            s = bwd_stage(k)
            ops.append(Action(s, back, take("B", s)))
            if zero_bubble:
                pending_w.append(s)
                # ZB-H1: rank r keeps r weight-gradients back to fill its cool-down bubble
                if k - warmup >= r:
                    w = pending_w.pop(0)
                    ops.append(Action(w, "W", take("W", w)))
    for w in pending_w:
        ops.append(Action(w, "W", take("W", w)))
    return ops


def interleaved(pp: int, m: int, vpp: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B with ``vpp`` chunks per rank (stage ``s`` on rank ``s % pp``)."""
    _check(pp, m, vpp)
    return [_interleaved_rank(r, pp, m, vpp, zero_bubble=False) for r in range(pp)]


def zb_h1(pp: int, m: int) -> list[list[Action]]:
    """ZB-H1: 1F1B whose backward is split into I (input grad) and W (weight grad);
    rank ``r`` postpones ``r`` W passes into its cool-down."""
    _check(pp, m)
    return [_interleaved_rank(r, pp, m, 1, zero_bubble=True) for r in range(pp)]


def compute_order(name: str, pp: int, m: int, vpp: int = 1) -> list[list[Action]]:
    """The per-rank compute actions of schedule ``name`` (one of :data:`SCHEDULES`)."""
    if name == "gpipe":
        return gpipe(pp, m)
    if name == "1f1b":
        return one_f_one_b(pp, m)
    if name == "interleaved":
        return interleaved(pp, m, vpp)
    if name == "zb-h1":
        return zb_h1(pp, m)
    raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def chunks(name: str, vpp: int) -> int:
    """Chunks per rank a schedule uses: ``vpp`` for interleaved, 1 for the others."""
    return vpp if name == "interleaved" else 1


# ---- communication ------------------------------------------------------------------------
def with_comms(compute: list[list[Action]], pp: int, vpp: int = 1) -> list[list[Action]]:
    """Insert the sends and receives each compute action needs.

    A forward of stage ``s > 0`` first receives its input (``sRECV_F``) and afterwards sends
    its output on (``sSEND_F``) unless it is the last stage; a backward (``B`` or ``I``)
    first receives the output gradient (``sRECV_B``) unless it is the last stage and then
    sends the input gradient back (``sSEND_B``) unless it is stage 0. Stages on the same rank
    (``pp = 1``) hand tensors over directly, without messages. Consecutive messages between
    two compute actions are what the engine batches into one ``batch_isend_irecv``.
    """
    last = pp * vpp - 1
    out = []
    for r, ops in enumerate(compute):
        seq: list[Action] = []
        for a in ops:
            s = a.stage
            remote_prev = s > 0 and stage_rank(s - 1, pp) != r
            remote_next = s < last and stage_rank(s + 1, pp) != r
            if a.kind == "F":
                if remote_prev:
                    seq.append(Action(s, "RECV_F", a.mb))
                seq.append(a)
                if remote_next:
                    seq.append(Action(s, "SEND_F", a.mb))
            elif a.kind in ("B", "I"):
                if remote_next:
                    seq.append(Action(s, "RECV_B", a.mb))
                seq.append(a)
                if remote_prev:
                    seq.append(Action(s, "SEND_B", a.mb))
            else:
                seq.append(a)
        out.append(seq)
    return out


def build(name: str, pp: int, m: int, vpp: int = 1) -> list[list[Action]]:
    """Schedule ``name`` with its communication: what the engine executes on each rank."""
    return with_comms(compute_order(name, pp, m, vpp), pp, chunks(name, vpp))


def format_torch(actions: list[list[Action]]) -> str:
    """One line per rank, ``rank R: 0F0 0SEND_F0 ...`` (PyTorch's action notation)."""
    return "\n".join(f"rank {r}: " + " ".join(map(str, ops)) for r, ops in enumerate(actions))


def parse_torch(text: str) -> list[list[Action]]:
    """Inverse of :func:`format_torch` (the ``rank R:`` label is optional)."""
    out = []
    for line in text.strip().splitlines():
        body = line.split(":", 1)[1] if ":" in line else line
        out.append([Action.parse(t) for t in body.split()])
    return out
