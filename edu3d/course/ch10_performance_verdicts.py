"""Chapter 10's takeaways, computed from the run they sit under.

After reading this file you should know why a caption in this chapter can be trusted: each
one that states a measured effect is built here from that run's own numbers, with the spread
over its repeated steps, and says what it would be on a GPU where a 2-core CPU cannot show it:

* :func:`spread` is the median and the range (lowest, highest) of repeated measurements;
  two settings differ only when their ranges do not overlap;
* :func:`overlap_verdict` compares dp2 with DP overlap off and on
  (:func:`edu3d.course.ch10_performance.breakdown` of each step): how much all-reduce the
  overlap hid, and whether the step got faster, slower, or neither, beyond the noise; the
  numbers it prints are the median step's budget, the bars the chart draws
  (:func:`edu3d.course.ch10_performance.budget`), so text and picture cannot disagree;
* :func:`budget_line` prints one drawn budget bar;
* :func:`scaling_verdict` says whether more ranks made the tiny model faster on this
  machine, from the sweep's tokens/s;
* :func:`profile_verdict` says how much of a profiled step its costliest operator took.
"""

from __future__ import annotations

import statistics

from edu3d.course.ch10_performance import breakdown, budget

GPU_OVERLAP = "on a GPU (its own stream, its own network card) hidden time is won back"


def spread(values) -> tuple[float, float, float]:
    """``(median, lowest, highest)`` of repeated measurements."""
    values = list(values)
    return statistics.median(values), min(values), max(values)


def _differ(a: tuple, b: tuple) -> int:
    """-1 when ``a``'s range lies wholly below ``b``'s, 1 wholly above, 0 when they overlap."""
    return -1 if a[2] < b[1] else 1 if a[1] > b[2] else 0


def overlap_verdict(events: list[dict]) -> dict:
    """dp2 with overlap off and on, from the steps after the first of each traced case:
    per mode its ``budget`` (:func:`edu3d.course.ch10_performance.budget`, the bar the chart
    draws) and ``step``, ``exposed``, ``comm`` as (that bar's value, lowest, highest over
    the steps); the all-reduce ``hidden`` under overlap; and ``text``: the chart's takeaway,
    whose every number is the drawn bar's."""
    out: dict = {}
    for mode in ("off", "on"):
        case = f"overlap {mode}"
        steps = breakdown(events, case)["steps"]
        later = [steps[s] for s in sorted(steps)[1:]] or list(steps.values())
        row = budget(events, case)
        out[mode] = {k: (row[k],) + spread(r[f"{k}_ms"] for r in later)[1:]
                     for k in ("step", "exposed", "comm")}
        out[mode]["n"], out[mode]["budget"] = len(later), row
    on, off = out["on"], out["off"]
    out["hidden"] = max(on["comm"][0] - on["exposed"][0], 0.0)  # as the chart writes it
    faster = _differ(on["step"], off["step"])
    effect = {-1: "overlap made the step faster", 1: "overlap made the step SLOWER",
              0: "the step did not change beyond the spread of its repetitions"}[faster]
    rng = lambda s: f"{s[0]:.1f} ms ({s[1]:.1f}-{s[2]:.1f})"  # noqa: E731
    out["faster"] = faster
    out["text"] = (f"overlap hid {out['hidden']:.1f} of {on['comm'][0]:.1f} ms of all-reduce; "
                   f"step {rng(off['step'])} off, {rng(on['step'])} on, over {on['n']} steps:"
                   f"<br>{effect}.<br>Here gloo's thread shares the cores with the backward it "
                   f"hides under; {GPU_OVERLAP}.")
    return out


def budget_line(name: str, row: dict) -> str:
    """One printed line of a drawn budget bar (:func:`edu3d.course.ch10_performance.budget`):
    its length (the step), its parts and its whole communication."""
    return (f"{name:<12} step {row['step']:6.1f} ms: compute {row['compute']:5.1f}, "
            f"communication {row['comm']:5.1f} of which exposed {row['exposed']:5.1f}, "
            f"idle {row['idle']:5.1f} ms")


def scaling_verdict(sweep: list[dict], cores: int) -> str:
    """Whether more ranks made the tiny model faster here: dp1 against dp2 and dp4."""
    rate = {r["name"]: r["tokens_per_s"] for r in sweep}
    parts = [f"{n} {rate[n] / rate['dp1']:.2f}x dp1's tokens/s" for n in ("dp2", "dp4")
             if n in rate and "dp1" in rate]
    best = max(rate, key=rate.get)
    return (f"on {cores} cores: " + ", ".join(parts) + f"; the fastest layout here is {best}. "
            "On a cluster each rank has its own GPU, and dp4 would approach 4x while the "
            "all-reduce stays small beside the compute.")


def profile_verdict(table: list[dict]) -> str:
    """How much of the profiled step's self time its costliest operator took."""
    ops = [r for r in table if not r["name"].startswith(("edu3d:", "ProfilerStep"))]
    total = sum(r["self_ms"] for r in ops)  # the profiler's own markers left out
    top = max(ops, key=lambda r: r["self_ms"])
    share = top["self_ms"] / total if total else 0.0
    return (f"the costliest operator, {top['name']}, took {share:.0%} of the step's self time"
            + ("; no single operator dominates: an overhead-bound step" if share < 0.5 else
               "; it dominates the step") + ". On a GPU-sized model the matmuls (aten::mm, "
            "attention) would take most of it.")
