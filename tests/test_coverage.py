"""Communication time is covered time: overlapping collectives count once, and the part no
compute ran beside is the exposed time (:mod:`edu3d.distributed.coverage`).

``edu3d train --cp 2`` once reported "cp 156%" of the step: the ring's sends and receives are
in flight together and their durations were added. These check the arithmetic on spans whose
answer is known, through the recorder every rank uses."""

from __future__ import annotations

import random

from edu3d.distributed import coverage
from edu3d.distributed.trace import Recorder


def test_overlapping_collectives_count_once_and_exposed_is_outside_compute():
    rec = Recorder()
    for t0, t1 in ((0, 10), (5, 15), (2, 4)):  # three collectives in flight together
        rec.record("comm", "send", t0, t1, group="cp")
    rec.record("comm", "all_reduce", 14, 20, group="dp")
    rec.record("compute", "F", 0, 12)
    covered, exposed = rec.comm_us(), rec.comm_us(exposed=True)
    assert covered == {"cp": 15, "dp": 6, "any": 20}
    assert exposed == {"cp": 3, "dp": 6, "any": 8}


def test_the_fold_keeps_the_totals_exact_for_spans_in_order():
    """Thousands of spans, folded as they come (memory stays bounded), give the union and
    difference computed on the whole list at once."""
    rng = random.Random(0)
    cov, spans, compute, t = coverage.Coverage(), [], [], 0.0
    for _ in range(3 * coverage.FOLD_AT):
        a = t + rng.uniform(0, 2)
        b = a + rng.uniform(0.1, 3)
        c0 = t + rng.uniform(0, 1)
        cov.add("dp", a, b)
        cov.add(coverage.COMPUTE, c0, c0 + 1)
        spans.append((a, b))
        compute.append((c0, c0 + 1))
        t = a + 0.5
    cov.fold(float("inf"))
    assert max(len(v) for v in cov.open.values()) == 0

    def union(xs):
        out = []
        for a, b in sorted(xs):
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        return out

    want = coverage.length(union(spans))
    assert abs(cov.covered["dp"] - want) < 1e-6 * want
    want = coverage.length(coverage.minus(union(spans), union(compute)))
    assert abs(cov.exposed["dp"] - want) < 1e-6 * max(want, 1)
