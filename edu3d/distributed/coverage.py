"""How long communication ran, counted as covered time, never as summed durations.

After reading this file you should understand why "time in communication" is a union of
spans and not a sum of them, and how much of it no compute hid:

* **covered, not summed.** Collectives run concurrently: context parallelism's ring posts
  its sends and receives together, data parallelism's bucket all-reduces overlap each other
  and the backward. Adding their durations counts the same instant once per collective in
  flight, so a step of 100 ms could report 156 ms "in cp communication". Here each group's
  spans are merged first (:class:`Coverage`), so a group covers at most the whole step, and
  ``any`` is the time *some* collective was in flight, whatever its group;
* **exposed** is what a group covered while no compute span ran on this rank: the time the
  rank only waited for the network (chapter 10's ``minus``: communication minus compute). A
  collective called from inside a compute span (tensor parallelism's all-reduces and the CP
  ring's exchanges run inside the forward and backward) is never exposed by this count: its
  wait is part of that span;
* **bounded memory.** Spans are kept merged per key, sorted, and folded into running totals
  up to a time (:meth:`Coverage.fold`): on every read (totals up to now) and when a key
  holds :data:`FOLD_AT` pieces (its older half). A span that began before the last fold is
  counted from the fold on: an asynchronous collective still in flight across a read loses
  the part before it.
"""

from __future__ import annotations

import bisect

COMPUTE, ANY = "compute", "any"
FOLD_AT = 4096  # merged pieces per key before the older half is folded


def length(spans) -> float:
    return sum(b - a for a, b in spans)


def minus(spans: list, cut: list) -> list:
    """The parts of ``spans`` (sorted, disjoint) outside every span of ``cut`` (the same)."""
    out, j = [], 0
    for a, b in spans:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k, start = j, a
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > start:
                out.append((start, cut[k][0]))
            start = max(start, cut[k][1])
            k += 1
        if start < b:
            out.append((start, b))
    return out


def _insert(spans: list, a: float, b: float) -> None:
    """Add ``[a, b)`` to the sorted, disjoint ``spans``, merging what it touches."""
    if not spans or a > spans[-1][1]:  # the usual case: after everything so far
        spans.append([a, b])
        return
    i = bisect.bisect_left(spans, [a, a])
    if i and spans[i - 1][1] >= a:
        i -= 1
    j = i
    while j < len(spans) and spans[j][0] <= b:
        a, b = min(a, spans[j][0]), max(b, spans[j][1])
        j += 1
    spans[i:j] = [[a, b]]


def _split(spans: list, at: float) -> tuple[list, list]:
    """``spans`` before and after ``at`` (a span across it is cut in two)."""
    before, after = [], []
    for a, b in spans:
        if b <= at:
            before.append((a, b))
        elif a >= at:
            after.append([a, b])
        else:
            before.append((a, at))
            after.append([at, b])
    return before, after


class Coverage:
    """Spans by key (a communication group's collectives, ``compute``), folded into
    ``covered`` and ``exposed`` microseconds per group and ``covered[ANY]``,
    ``exposed[ANY]`` for all groups together."""

    def __init__(self) -> None:
        self.open: dict[str, list] = {}
        self.floor = float("-inf")
        self.covered: dict[str, float] = {}
        self.exposed: dict[str, float] = {}

    def add(self, key: str, t0: float, t1: float) -> None:
        """A span of ``key``: a group's name, or :data:`COMPUTE`."""
        t0 = max(t0, self.floor)
        if t1 <= t0:
            return
        for k in ((key,) if key == COMPUTE else (key, ANY)):
            spans = self.open.setdefault(k, [])
            _insert(spans, t0, t1)
            if len(spans) >= FOLD_AT:
                self.fold(spans[len(spans) // 2][0])

    def fold(self, at: float) -> None:
        """Count everything before ``at`` into the totals; keep the rest open."""
        if at <= self.floor:
            return
        before = {}
        for key, spans in self.open.items():
            before[key], self.open[key] = _split(spans, at)
        compute = before.pop(COMPUTE, [])
        for key, spans in before.items():
            self.covered[key] = self.covered.get(key, 0.0) + length(spans)
            self.exposed[key] = self.exposed.get(key, 0.0) + length(minus(spans, compute))
        self.floor = at
