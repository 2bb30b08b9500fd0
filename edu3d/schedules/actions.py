"""Pipeline schedules as data: per rank, an ordered list of actions.

After reading this file you should understand:

* an *action* is written in PyTorch's notation (``torch.distributed.pipelining``):
  ``"0F3"`` = stage 0 runs the forward of micro-batch 3; ``B`` is a full backward, ``I`` the
  backward for the stage's *input* only, ``W`` the backward for its *weights* only;
  ``"2SEND_F3"`` = stage 2 sends micro-batch 3's activation on (to stage 3) and
  ``"3RECV_F3"`` = stage 3 receives it; ``"3SEND_B3"`` / ``"2RECV_B3"`` carry the gradient
  back. Global stage ``s`` is chunk ``s // pp`` of its rank; which rank is the schedule's
  *placement* (PyTorch's ``style``): ``loop`` deals stages round robin (rank ``s % pp``),
  ``v`` runs every odd chunk backwards (:func:`stage_rank`);
* a schedule is a few simple loops:

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
  - **ZBV** (Qi et al. 2023, section 6) and **DualPipeV** (DeepSeek-V3's DualPipe cut in
    half, Sea AI Lab): two chunks per rank laid out as a **V**, rank ``r`` holding stage
    ``r`` on the way down and stage ``2p-1-r`` on the way back up, so the first and the
    last stage share rank 0 and the turn (stages ``p-1`` and ``p``) happens on one rank
    without a message. ZBV fills the bubble with deferred ``W``; DualPipeV pairs a forward
    of one chunk with a backward of the other (``F&B``), so activations flow down and
    gradients up at the same time;

* the compute order is what a schedule *is*; :func:`with_comms` then adds the sends and
  receives each compute action needs, so the same list can be checked, simulated, executed
  and drawn.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import NamedTuple

COMPUTE = ("F", "B", "I", "W")
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank, placed as a V

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


def placement(name: str) -> str:
    """Where schedule ``name`` puts its stages: ``"v"`` for ZBV and DualPipeV, else ``"loop"``."""
    return "v" if name in V_SHAPED else "loop"


def stage_rank(stage: int, pp: int, style: str = "loop") -> int:
    """The pipeline rank that holds global stage ``stage``: chunk ``c = stage // pp`` at
    position ``stage % pp``, counted backwards on odd chunks when ``style`` is ``"v"``
    (PyTorch's ``generate_stage_to_rank_mapping``). With pp = 4: loop 0123 0123, v 0123 3210."""
    chunk, pos = divmod(stage, pp)
    return pp - 1 - pos if style == "v" and chunk % 2 else pos


def stages_of(rank: int, pp: int, n_stages: int, style: str = "loop") -> list[int]:
    """The global stages pipeline rank ``rank`` holds, in increasing order."""
    return [s for s in range(n_stages) if stage_rank(s, pp, style) == rank]


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


class _VList:
    """One rank's list of a V schedule, being written: its stage on the way down
    (``down = r``) and on the way back up (``up = 2p-1-r``); :meth:`run` appends the stage's
    next micro-batch of a kind (``B`` and ``I`` share one count, as in PyTorch)."""

    def __init__(self, r: int, pp: int):
        self.down, self.up = r, 2 * pp - 1 - r
        self.ops: list[Action] = []
        self.done: Counter = Counter()

    def run(self, stage: int, kind: str, times: int = 1) -> None:
        for _ in range(times):
            count = "I" if kind == "B" else kind
            self.ops.append(Action(stage, kind, self.done[stage, count]))
            self.done[stage, count] += 1


def _zbv_rank(r: int, pp: int, m: int) -> list[Action]:
    """PyTorch's ``ScheduleZBVZeroBubble`` for rank ``r``: planned for at least ``2p-1``
    micro-batches (enough to fill the V), the ones past ``m`` then dropped."""
    v = _VList(r, pp)
    down, up, run, done = v.down, v.up, v.run, v.done
    n = max(2 * pp - 1, m)
    run(down, "F", 2 * (pp - r) - 1)  # warm-up: micro-batches on their way down
    for _ in range(r):  # ... and the first ones coming back up
        run(up, "F"), run(down, "F")
    for _ in range(pp - r):  # the turn: the first backwards, W right behind I
        run(up, "F"), run(up, "I"), run(up, "W")
    while done[up, "F"] < done[down, "F"] or done[down, "F"] < n:  # steady: 1F1B per chunk
        if done[down, "F"] < n:
            run(down, "F")
        run(down, "I"), run(down, "W"), run(up, "F"), run(up, "I"), run(up, "W")
    for _ in range(r):  # cool-down: input gradients first (the next rank waits for them) ...
        run(down, "I"), run(up, "I")
    for _ in range(pp - r):
        run(down, "I"), run(down, "W")
    run(up, "W", done[up, "I"] - done[up, "W"])  # ... the deferred W fill the tail
    run(down, "W", done[down, "I"] - done[down, "W"])
    return [a for a in v.ops if a.mb < m]


def _dualpipev_rank(r: int, pp: int, m: int) -> list[Action]:
    """PyTorch's ``ScheduleDualPipeV`` (DeepSeek's ``DualPipeV.step``) for rank ``r``, its
    eight steps in order. A split backward (``I``) leaves its ``W`` in a queue that later
    steps drain, oldest first; ``F&B`` pairs are written as the forward, then the backward."""
    v = _VList(r, pp)
    down, up, run = v.down, v.up, v.run
    owed: list[Action] = []

    def back(stage: int, split: bool) -> None:
        run(stage, "I" if split else "B")
        if split:
            owed.append(Action(stage, "W", v.ops[-1].mb))

    def weight() -> None:
        if owed:
            v.ops.append(owed.pop(0))

    run(down, "F", 2 * (pp - r - 1))  # 1: forwards on the way down
    for _ in range(r + 1):  # 2: one down, one up
        run(down, "F"), run(up, "F")
    for _ in range(pp - r - 1):  # 3: zero bubble, I W F on the way up
        back(up, True), weight(), run(up, "F")
    for _ in range(m - 2 * pp + r + 1):  # 4: the main step, two F&B pairs
        run(down, "F"), back(up, False), run(up, "F"), back(down, False)
    for _ in range(pp - r - 1):  # 5: B up, then an F&B pair
        back(up, False), run(up, "F"), back(down, False)
    half = (r + 1) // 2
    for k in range(r + 1):  # 6: B up, B down; the second half split (odd ranks one earlier)
        back(up, k > half or k == half and r % 2 == 1)
        back(down, k >= half)
    for _ in range(pp - r - 1):  # 7: W, then I down
        weight(), back(down, True)
    for _ in range(r + 1):  # 8: the queued W
        weight()
    return v.ops


def zbv(pp: int, m: int) -> list[list[Action]]:
    """ZBV: two chunks per rank as a V, every backward split into I and W (PyTorch's order)."""
    _check(pp, m)
    return [_zbv_rank(r, pp, m) for r in range(pp)]


def dualpipev(pp: int, m: int) -> list[list[Action]]:
    """DualPipeV: two chunks per rank as a V, forward of one chunk paired with backward of the
    other (PyTorch's order). Needs ``m >= 2p`` micro-batches, as PyTorch does."""
    _check(pp, m)
    if m < 2 * pp:
        raise ValueError(f"dualpipev needs at least 2*pp = {2 * pp} micro-batches (one per "
                         f"stage of the V), got {m}")
    return [_dualpipev_rank(r, pp, m) for r in range(pp)]


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
    if name == "zbv":
        return zbv(pp, m)
    if name == "dualpipev":
        return dualpipev(pp, m)
    raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def chunks(name: str, vpp: int) -> int:
    """Chunks per rank a schedule uses: ``vpp`` for interleaved, 2 for the V-shaped ones, 1
    for the others."""
    return vpp if name == "interleaved" else 2 if name in V_SHAPED else 1


# ---- communication ------------------------------------------------------------------------
def with_comms(compute: list[list[Action]], pp: int, vpp: int = 1,
               style: str = "loop") -> list[list[Action]]:
    """Insert the sends and receives each compute action needs.

    A forward of stage ``s > 0`` first receives its input (``sRECV_F``) and afterwards sends
    its output on (``sSEND_F``) unless it is the last stage; a backward (``B`` or ``I``)
    first receives the output gradient (``sRECV_B``) unless it is the last stage and then
    sends the input gradient back (``sSEND_B``) unless it is stage 0. Stages on the same rank
    (``pp = 1``, or the turn of a V) hand tensors over directly, without messages.
    Consecutive messages between two compute actions are what the engine batches into one
    ``batch_isend_irecv``. ``style`` is the placement (:func:`stage_rank`).
    """
    last = pp * vpp - 1
    out = []
    for r, ops in enumerate(compute):
        seq: list[Action] = []
        for a in ops:
            s = a.stage
            remote_prev = s > 0 and stage_rank(s - 1, pp, style) != r
            remote_next = s < last and stage_rank(s + 1, pp, style) != r
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
    return with_comms(compute_order(name, pp, m, vpp), pp, chunks(name, vpp), placement(name))


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
