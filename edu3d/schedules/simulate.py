"""The theory timeline: replay a schedule with a cost per action.

After reading this file you should understand where the pipeline bubble comes from and how
big it is. Given how long a forward (``F``), a full backward (``B``), its two halves (``I``,
``W``) and one message (``p2p``) take, every rank runs its list in order: a compute action
starts when the rank is free and its inputs are there; a send costs the sender nothing
(``isend``) and lands ``p2p`` later; a receive waits for it. The result is the same event
schema a measured run writes, with ``"sim": true``, so one chart draws theory under
measurement.

* **bubble fraction** = idle share of the ranks' time between the first start and the last
  end, ``1 - Σ busy / (p · makespan)``. With equal stages and ``p2p = 0`` it is exactly
  ``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(v·m+p-1)`` for interleaved 1F1B, and with
  ``F = I = W`` also ``(p-1)/(6m+p-1)`` for ZBV and DualPipeV (:func:`bubble_formula`);
* **placement**: which rank holds a stage is read off the lists (the rank that runs it), so
  the V of ZBV and DualPipeV replays like the round robin of the others;
* **peak activation memory** = the most micro-batches whose activations a rank holds at once
  (from forward until ``B`` or ``W`` consumed them), times the activation bytes per
  micro-batch of each stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edu3d.schedules.check import done_key, needs_of
from edu3d.schedules.actions import Action


@dataclass
class Costs:
    """Seconds (or any unit) per action; ``I + W`` should equal ``B``.

    ``scale`` multiplies the compute cost of one stage (a list by global stage), so
    unbalanced stages can be simulated; ``measured`` gives individual actions their own cost
    (a *replay* of a run: what the schedule would take with exactly those compute times and
    no overhead between actions).
    """

    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741 - PyTorch's letter for the input-gradient backward
    W: float = 1.0
    p2p: float = 0.0
    scale: list[float] | None = None
    measured: dict | None = None  # (stage, kind, mb) -> duration of that very action

    def of(self, a: Action) -> float:
        if self.measured is not None and (a.stage, a.kind, a.mb) in self.measured:
            return self.measured[(a.stage, a.kind, a.mb)]
        base = getattr(self, a.kind)
        return base * (self.scale[a.stage] if self.scale else 1.0)


@dataclass
class Timeline:
    events: list[dict]
    makespan: float
    bubble: float
    peak_in_flight: list[int]
    peak_activation_bytes: list[float] = field(default_factory=list)


def bubble_formula(name: str, pp: int, m: int, vpp: int = 1) -> float:
    """The textbook bubble fraction: ``(p-1)/(v·m+p-1)`` (``v = 1`` for GPipe and 1F1B).

    ZB-H1 has no closed form here; it is simulated (about a third of 1F1B's when
    ``F = I = W``). ZBV and DualPipeV, with ``F = I = W`` per chunk (``B = 2F``): each rank
    works ``2m(F+I+W) = 6m`` and idles ``p-1``, the last rank's wait for its first input
    (``(p-1)/(6m+p-1)``, a sixth of 1F1B's for large ``m``); ZBV with fewer micro-batches
    than its V holds (``m < 2p-1``) idles ``2(2p-1-m)`` when that is more. Both fit the
    replay of the action lists exactly (``tests/test_pp_schedules.py``: p <= 8, m <= 3p+2)."""
    if name in ("zbv", "dualpipev"):
        idle = max(pp - 1, 2 * (2 * pp - 1 - m) if name == "zbv" else 0)
        return idle / (6 * m + idle)
    v = vpp if name == "interleaved" else 1
    return (pp - 1) / (v * m + pp - 1)


def bubble_of(events: list[dict]) -> float:
    """Idle share of compute time between the first start and the last end, over ranks."""
    comp = [e for e in events if e["lane"] == "compute"]
    if not comp:
        return 0.0
    ranks = {e["rank"] for e in comp}
    span = max(e["t1"] for e in comp) - min(e["t0"] for e in comp)
    busy = sum(e["t1"] - e["t0"] for e in comp)
    return 1.0 - busy / (len(ranks) * span) if span > 0 else 0.0


def simulate(actions: list[list[Action]], pp: int, costs: Costs | None = None,
             activation_bytes: list[float] | None = None, time_unit: float = 1.0) -> Timeline:
    """Replay ``actions`` (with comms, see :func:`~edu3d.schedules.actions.with_comms`).

    ``activation_bytes[s]`` is what one micro-batch of stage ``s`` keeps for its backward.
    Event times are in the costs' unit times ``time_unit`` (1e6 turns seconds into the trace's
    microseconds).
    """
    costs = costs or Costs()
    where = {a.stage: r for r, ops in enumerate(actions) for a in ops}  # the lists' placement
    last = max(where)
    finished: list[dict] = [{} for _ in range(pp)]  # rank -> action key -> finish time
    clock = [0.0] * pp
    pos = [0] * pp
    live = [dict() for _ in range(pp)]
    peak, peak_bytes = [0] * pp, [0.0] * pp
    events = []
    while any(pos[r] < len(actions[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(actions[r]):
                a = actions[r][pos[r]]
                needs = needs_of(a, r, where, last)
                if not all(done_key(n) in finished[q] for q, n in needs):
                    break
                ready = max([finished[q][done_key(n)] for q, n in needs], default=0.0)
                if a.kind.startswith("RECV"):
                    t0, t1 = clock[r], max(clock[r], ready + costs.p2p)
                elif a.kind.startswith("SEND"):
                    t0 = t1 = max(clock[r], ready)
                else:
                    t0 = max(clock[r], ready)
                    t1 = t0 + costs.of(a)
                clock[r] = t1
                finished[r][done_key(a)] = t1
                pos[r] += 1
                progressed = True
                ev = {"rank": r, "lane": "compute" if a.is_compute else "comm",
                      "op": a.kind if a.is_compute else a.kind.split("_")[0].lower(),
                      "t0": t0 * time_unit, "t1": (t1 + (costs.p2p if a.kind.startswith("SEND")
                                                         else 0.0)) * time_unit,
                      "mb": a.mb, "stage": a.stage, "chunk": a.stage // pp, "sim": True}
                if not a.is_compute:
                    ev.update(group="pp", peer=where[a.stage + (1 if a.kind in ("SEND_F", "RECV_B")
                                                                else -1)])
                events.append(ev)
                if a.kind == "F":
                    live[r][(a.stage, a.mb)] = (activation_bytes or [1.0] * (last + 1))[a.stage]
                elif a.kind in ("B", "W"):
                    live[r].pop((a.stage, a.mb), None)
                if a.kind in ("F", "B", "W"):
                    peak[r] = max(peak[r], len(live[r]))
                    held = sum(live[r].values())
                    peak_bytes[r] = max(peak_bytes[r], held)
                    events.append({"rank": r, "lane": "mem", "op": "activations",
                                   "t0": t1 * time_unit, "t1": t1 * time_unit,
                                   "mem": {"activations": held}, "sim": True})
        if not progressed:
            raise ValueError("the schedule deadlocks; run edu3d.schedules.check.check on it")
    events.sort(key=lambda e: (e["t0"], e["rank"]))
    makespan = max(clock) * time_unit
    return Timeline(events, makespan, bubble_of(events), peak,
                    peak_bytes if activation_bytes is not None else [])
