"""How well did a cost model rank what was measured? Ranks, Spearman, the tuner's table.

After reading this file you should understand how ``edu3d tune`` grades the planner:

* **ranks with ties averaged** (:func:`ranks`): candidates the cost model cannot tell apart
  (ZeRO-0/1/2 move the same bytes; the micro-batch count changes nothing but the bubble)
  share the mean of the places they occupy;
* **Spearman's rank correlation** (:func:`spearman`): Pearson's correlation of the two rank
  lists. +1: the model ordered the candidates exactly as the clock did; 0: no better than
  chance; -1: reversed. Only the order counts, so a model wrong by a constant factor (every
  step 20x slower than predicted) can still score 1;
* **the error** of each prediction is ``predicted / measured - 1`` (+0.25: predicted a
  quarter too slow), and their **median** (of the absolute errors) says how far the step
  times themselves are off, which Spearman cannot: a model 20x too fast can rank perfectly;
* **the winner** is the fastest measured candidate whose peak memory fits; the **most
  misranked** is the one whose predicted and measured places differ most
  (:func:`grade`);
* :func:`format_table` prints a report of :mod:`edu3d.bench.autotune` (``edu3d tune``).

Nothing here imports torch: the chapter's panel redraws from recorded reports with it.
"""

from __future__ import annotations

import math
import statistics


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks of ``xs`` (smallest first), ties given the mean of their ranks."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties averaged);
    NaN when either side has fewer than two distinct values."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} predictions for {len(ys)} measurements")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx) if rx else 0.0, sum(ry) / len(ry) if ry else 0.0
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else math.nan


def grade(candidates: list[dict], budget_bytes: float | None) -> dict:
    """Ranks, correlation, each prediction's error and their median, the winner (the
    fastest measured that fits ``budget_bytes``) and the most misranked candidate, from the
    measured ones."""
    done = [c for c in candidates if "measured" in c]
    pred = [c["predicted_step_s"] for c in done]
    meas = [c["measured"]["step_s"] for c in done]
    for c, p, m in zip(done, ranks(pred), ranks(meas)):
        c["predicted_rank"], c["measured_rank"] = p, m
        c["error"] = c["predicted_step_s"] / c["measured"]["step_s"] - 1
        c["fits"] = budget_bytes is None or c["measured"]["peak_bytes"] <= budget_bytes
    rho = spearman(pred, meas) if len(done) > 1 else math.nan
    fitting = [c for c in done if c["fits"]]
    winner = min(fitting, key=lambda c: c["measured"]["step_s"]) if fitting else None
    worst = max(done, key=lambda c: abs(c["predicted_rank"] - c["measured_rank"]),
                default=None)
    return {"spearman": rho, "median_error": statistics.median(abs(c["error"]) for c in done)
            if done else math.nan, "winner": winner["label"] if winner else None,
            "misranked": worst["label"] if worst else None}


# ---- the table -----------------------------------------------------------------------------------
def _mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


def format_table(rep: dict) -> str:
    """The report as text: one row per candidate (the planner's order), the winner and the
    cost model's grade."""
    w = max([len(c["label"]) for c in rep["candidates"] + rep["skipped"]] + [9])
    rows = [f"{'#':>2} {'candidate':<{w}} {'pred ms':>8} {'pred MiB':>8} {'meas ms':>8} "
            f"{'error':>6} {'tok/s':>9} {'peak MiB':>8} {'rank p/m':>9}"]
    for i, c in enumerate(rep["candidates"], start=1):
        m = c.get("measured")
        meas = (f"{m['step_s'] * 1e3:>8.1f} {c['error']:>+6.0%} {m['tokens_per_s']:>9,.0f} "
                f"{_mb(m['peak_bytes']):>8} {c['predicted_rank']:>4g}/{c['measured_rank']:<4g}"
                if m else
                f"  failed: {c.get('error', 'not run')}")
        win = " <- winner" if c["label"] == rep["winner"] else ""
        rows.append(f"{i:>2} {c['label']:<{w}} {c['predicted_step_s'] * 1e3:>8.2f} "
                    f"{_mb(c['predicted_bytes']):>8} {meas}{win}")
    for s in rep["skipped"]:
        rows.append(f"   {s['label']:<{w}} skipped: {s['reason']}")
    rho = math.nan if rep["spearman"] is None else rep["spearman"]  # JSON's null
    rows.append(f"memory measured: {rep['memory_measured']}; times: median of {rep['steps']} "
                f"step(s) after {rep['warmup']} warm-up, slowest rank")
    rows.append(f"winner: {rep['winner'] or 'none fits'}")
    if rep.get("profile"):
        rows.append(f"predicted with the {rep['profile']} profile"
                    + (f" ({rep['profile_note']})" if rep.get("profile_note") else ""))
    err = rep.get("median_error")
    if err is not None and not math.isnan(err):
        rows.append(f"step times: median error {err:.0%} (|predicted / measured - 1|)")
    rows.append("cost model's ranking against the measured one: Spearman rho = "
                + ("undefined (fewer than two distinct values)" if math.isnan(rho) else
                   f"{rho:+.2f} (1: same order, 0: unrelated, -1: reversed)"))
    worst = next((c for c in rep["candidates"] if c["label"] == rep["misranked"]), None)
    if worst is not None:
        rows.append(f"misranked most: {worst['label']}: predicted #{worst['predicted_rank']:g}, "
                    f"measured #{worst['measured_rank']:g} of "
                    f"{sum('measured' in c for c in rep['candidates'])} ("
                    + ("slower" if worst["measured_rank"] > worst["predicted_rank"] else
                       "faster") + " than the model thinks)")
    return "\n".join(rows)

