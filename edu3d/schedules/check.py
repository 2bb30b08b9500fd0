"""Checking a schedule before running it: dependencies, messages, deadlock, memory.

After reading this file you should understand what makes a list of actions a valid pipeline:

* **dependencies**: a stage can run the forward of micro-batch ``i`` only once its input
  has arrived (from the previous stage, by ``RECV_F`` or on the same rank); a backward
  (``B`` or ``I``) needs its own forward and the gradient of the next stage; ``W`` needs
  ``I``; a send needs the compute that produced what it sends;
* **placement**: every stage is run by the rank that holds it, round robin or as a V
  (``style``, :func:`~edu3d.schedules.actions.stage_rank`); two stages on one rank (the turn
  of a V) hand their tensors over without a message;
* **messages**: every ``SEND`` has exactly one matching ``RECV`` on the right rank, and
  nothing is received that nobody sent;
* **deadlock**: the engine's sends never block (``isend``), its receives do. Replaying all
  ranks with exactly those rules must finish; if every rank is stuck waiting, the message
  names what each one waits for;
* **in-flight micro-batches**: a micro-batch's activations stay alive from its forward until
  its backward has used them (``B``, or ``W`` when the backward is split), so the peak count
  per rank is the schedule's activation memory: ``m`` for GPipe, at most ``p`` for 1F1B.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from edu3d.schedules.actions import Action, stage_rank, stages_of


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names the action and what it lacks."""


@dataclass
class Report:
    """What :func:`check` found: the peak in-flight (stage, micro-batch) pairs per rank."""

    peak_in_flight: list[int]
    steps: int  # replay rounds until every rank finished (a rough critical-path length)


def needs_of(a: Action, r: int, where, last: int) -> list[tuple[int, Action]]:
    """What must have happened (on which rank) before action ``a`` on rank ``r`` may run;
    ``where[s]`` is the rank holding stage ``s``."""
    s, i = a.stage, a.mb
    if a.kind == "F":
        if s == 0:
            return []
        prev = where[s - 1]
        return [(r, Action(s, "RECV_F", i))] if prev != r else [(r, Action(s - 1, "F", i))]
    if a.kind in ("B", "I"):
        need = [(r, Action(s, "F", i))]
        if s < last:
            nxt = where[s + 1]
            need.append((r, Action(s, "RECV_B", i)) if nxt != r else (r, Action(s + 1, "I", i)))
        return need
    if a.kind == "W":
        return [(r, Action(s, "I", i))]
    if a.kind == "SEND_F":
        return [(r, Action(s, "F", i))]
    if a.kind == "SEND_B":
        return [(r, Action(s, "I", i))]
    if a.kind == "RECV_F":
        return [(where[s - 1], Action(s - 1, "SEND_F", i))]
    if a.kind == "RECV_B":
        return [(where[s + 1], Action(s + 1, "SEND_B", i))]
    raise ScheduleError(f"unknown action kind in {a}")


def done_key(a: Action) -> Action:
    """A full backward ``B`` also provides what ``I`` provides (the input gradient)."""
    return Action(a.stage, "I", a.mb) if a.kind == "B" else a


def check(actions: list[list[Action]], pp: int, m: int, vpp: int = 1,
          style: str = "loop") -> Report:
    """Replay the schedule (``vpp`` chunks per rank, placed by ``style``: see
    :func:`~edu3d.schedules.actions.stage_rank`); raise :class:`ScheduleError` on any
    problem, else a report."""
    if len(actions) != pp:
        raise ScheduleError(f"{len(actions)} rank lists for pp={pp}; give one list per rank")
    last = pp * vpp - 1
    where = [stage_rank(s, pp, style) for s in range(last + 1)]
    for r, ops in enumerate(actions):
        for a in ops:
            if not 0 <= a.stage <= last or where[a.stage] != r:
                raise ScheduleError(f"rank {r} runs {a}, but stage {a.stage} lives on rank "
                                    f"{where[a.stage] if a.stage <= last else '-'}")
            if not 0 <= a.mb < m:
                raise ScheduleError(f"rank {r}: {a} names micro-batch {a.mb}, outside 0..{m - 1}")
        counts = Counter(ops)
        dup = [str(a) for a, c in counts.items() if c > 1]
        if dup:
            raise ScheduleError(f"rank {r} runs {', '.join(dup)} more than once")
        for s in stages_of(r, pp, last + 1, style):
            for i in range(m):
                has_b = Action(s, "B", i) in counts
                has_iw = Action(s, "I", i) in counts, Action(s, "W", i) in counts
                if Action(s, "F", i) not in counts:
                    raise ScheduleError(f"rank {r} never runs {s}F{i}")
                if not (has_b ^ any(has_iw)) or (any(has_iw) and not all(has_iw)):
                    raise ScheduleError(f"rank {r} must run either {s}B{i} or both {s}I{i} "
                                        f"and {s}W{i}")
    sends = {(stage_rank(a.stage + (1 if a.kind == "SEND_F" else -1), pp, style), a.kind[5:],
              a.stage + (1 if a.kind == "SEND_F" else -1), a.mb)
             for r, ops in enumerate(actions) for a in ops if a.kind.startswith("SEND")}
    recvs = {(r, a.kind[5:], a.stage, a.mb)
             for r, ops in enumerate(actions) for a in ops if a.kind.startswith("RECV")}
    if sends != recvs:
        lost = sorted(sends - recvs)
        ghost = sorted(recvs - sends)
        raise ScheduleError(
            "unmatched messages: " +
            "; ".join([f"rank {d} never receives {s}{'RECV_' + k}{i}" for d, k, s, i in lost] +
                      [f"rank {d} waits for {s}{'RECV_' + k}{i} that nobody sends"
                       for d, k, s, i in ghost]))

    done = [set() for _ in range(pp)]
    pos = [0] * pp
    live, peak = [set() for _ in range(pp)], [0] * pp
    rounds = 0
    while any(pos[r] < len(actions[r]) for r in range(pp)):
        rounds += 1
        progressed = False
        for r in range(pp):
            while pos[r] < len(actions[r]):
                a = actions[r][pos[r]]
                if not all(done_key(n) in done[q] for q, n in needs_of(a, r, where, last)):
                    break
                done[r].add(done_key(a))
                pos[r] += 1
                progressed = True
                if a.kind == "F":
                    live[r].add((a.stage, a.mb))
                    peak[r] = max(peak[r], len(live[r]))
                elif a.kind in ("B", "W"):
                    live[r].discard((a.stage, a.mb))
        if not progressed:
            stuck = [f"rank {r} at {actions[r][pos[r]]} (waits for "
                     f"{', '.join(str(n) for q, n in needs_of(actions[r][pos[r]], r, where, last) if done_key(n) not in done[q])})"
                     for r in range(pp) if pos[r] < len(actions[r])]
            raise ScheduleError("deadlock: " + "; ".join(stuck))
    return Report(peak_in_flight=peak, steps=rounds)
