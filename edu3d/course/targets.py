"""The design part of every exercise: a plan, what it costs in time and memory, a target.

After reading this file you should know how a design is graded, the way LLM-Training-Puzzles
scores its puzzles: the learner's plan (a layout, a schedule, a bucket size ...) is costed by
the model its chapter taught, as the seconds of one step (or one unit of work) and the bytes
of the fullest device (:class:`Cost`). It passes when it is a valid plan, fits the memory
target and meets the time target (:class:`Target`, :func:`meet`).

Where the plans can be listed, the time target is the best feasible plan's time times a
small slack (:func:`best`, :func:`target_of`): a target the model proves reachable, never a
hand-picked number, so it moves with the model. Many plans may pass; the point is the
reasoning, and the failure says how far off the plan is and which way (too slow, too big),
never which plan to write. The notebook shows a plan next to its target in one line
(:func:`plan_line`, most often in the usual words of :func:`step_line`), or why the plan is
no plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class Cost:
    """What a plan costs: seconds (or the model's unit of time) and bytes."""

    time: float
    memory: float


@dataclass(frozen=True)
class Target:
    """A plan passes when its time is at most ``time`` and its memory at most ``memory``."""

    time: float
    memory: float


def fmt_bytes(n: float) -> str:
    """``1.2 TB``, ``12.3 GB``, ``840 MB``, ``4 KB`` (powers of 1000, as the course's charts)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_time(s: float) -> str:
    """``1.23 s``, ``45.6 ms``, ``789 us``."""
    if abs(s) >= 1:
        return f"{s:.3g} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def best(plans: Iterable, cost: Callable[[object], Cost], memory: float):
    """The fastest of ``plans`` whose memory is at most ``memory``: ``(plan, Cost)``; raises
    ``ValueError`` when none fits (a job without an answer is the grader's bug)."""
    found = None
    for plan in plans:
        c = cost(plan)
        if c.memory <= memory and (found is None or c.time < found[1].time):
            found = (plan, c)
    if found is None:
        raise ValueError("no plan fits the memory target: the job has no answer")
    return found


def meet(what: str, got: Cost, target: Target, fmt: Callable[[float], str] = fmt_time) -> None:
    """Raise ``AssertionError`` naming ``what`` and the shortfall unless ``got`` meets
    ``target``: memory first (a plan that does not fit cannot run), then time."""
    assert got.memory <= target.memory, \
        f"{what}: it needs {fmt_bytes(got.memory)}, more than the {fmt_bytes(target.memory)} " \
        "it may use"
    assert got.time <= target.time, \
        f"{what}: it fits ({fmt_bytes(got.memory)}), but takes {fmt(got.time)}, slower than " \
        f"the target {fmt(target.time)} ({got.time / target.time:.2f}x)"


def target_of(plans: Iterable, cost: Callable[[object], Cost], memory: float,
              slack: float) -> Target:
    """The target of a job whose ``plans`` can be listed: ``memory``, and the time of the
    fastest plan that fits it (:func:`best`) times ``slack``."""
    _, top = best(plans, cost, memory)
    return Target(time=slack * top.time, memory=memory)


def plan_line(cost: Callable[[], Cost], target: Callable[[], Target],
              line: Callable[[Cost, Target], str]) -> str:
    """``line(cost(), target())``: a plan next to its target, for the notebook; or, when
    ``cost`` raises ``AssertionError`` (the plan is no plan), the reason it gives."""
    try:
        got = cost()
    except AssertionError as why:
        return str(why)
    return line(got, target())


def step_line(label: str, got: Cost, target: Target, memory: str = "{}", note: str = "") -> str:
    """The usual line: ``<label>: step 1.2 s (target 1.1 s<note>), <memory> (at most 40 GB)``,
    where ``memory`` places the plan's bytes in its words (``"{} per rank"``, ``"peak {}"``)."""
    return (f"{label}: step {fmt_time(got.time)} (target {fmt_time(target.time)}{note}), "
            f"{memory.format(fmt_bytes(got.memory))} (at most {fmt_bytes(target.memory)})")
