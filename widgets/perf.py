"""Performance pictures: a profile, overlap, scaling, a benchmark report and a step's budget.

After reading this file you should know how to read chapter 10's charts:

* :func:`op_table_figure` — the operators of one profiled step by **self CPU time** (the
  time spent in the operator itself, not in what it called), coloured by what they serve:
  backward orange, communication yellow, the optimizer vermillion, the rest blue;
* :func:`profile_timeline` — the profiler's top-level events on the course's lanes
  (**lane = rank, x = time**): forward blue, backward orange, optimizer vermillion, the
  collectives' launches yellow on the comm sub-lane;
* :func:`budget_figure` — where a step's time goes, per configuration: **compute**,
  **exposed communication** (no forward or backward runs under it) and **idle** (bubble,
  waiting for a slower rank), with the communication hidden under compute written beside;
* :func:`scaling_figure` — tokens/s and step time per layout, measured, with the machine's
  core count marked: more ranks than cores share the cores;
* :func:`bench_figure` — an ``edu3d bench`` report: edu3d's time against PyTorch's;
* :func:`prediction_figure` — the performance model's predicted step of every layout;
* :func:`predicted_measured_figure` — this machine's layouts: the model's step (hatched)
  beside the measured one (solid), the error above each pair;
* :func:`published_figure` — the model against published runs of real clusters: predicted
  over measured on log axes, one colour per source, the line ``y = x`` (a perfect
  prediction) and the band of +-30 % around it; the known misses ringed and named.

The chapter's knobs (layout, overlap, micro-batches) are
:mod:`edu3d.widgets.panels.ch10_performance`.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from edu3d.widgets import style
from edu3d.widgets.timeline import timeline_figure

BUDGET = (("compute", "compute (F, B, optimizer)", style.BLUE),
          ("exposed", "exposed communication", style.YELLOW),
          ("idle", "idle: bubble, waiting", style.GREY))


def op_kind(name: str) -> str:
    """What an operator serves, from its name (for the table's colours)."""
    low = name.lower()
    if any(k in low for k in ("gloo", "nccl", "c10d", "allreduce", "all_reduce", "broadcast")):
        return "communication"
    if "backward" in low or low.startswith("autograd::"):
        return "backward"
    if low.startswith("optimizer.") or "adam" in low:
        return "optimizer"
    return "forward and shared"


KIND_COLORS = {"communication": style.YELLOW, "backward": style.ORANGE,
               "optimizer": style.VERMILLION, "forward and shared": style.BLUE}


def top_ops(table: list[dict], top: int = 12) -> list[dict]:
    """The ``top`` operators by self CPU time (the profiler's own marker left out)."""
    rows = [r for r in table if not r["name"].startswith(("edu3d:", "ProfilerStep"))]
    return sorted(rows, key=lambda r: -r["self_ms"])[:top]


def op_table_figure(table: list[dict], top: int = 12, rank: int = 0):
    """Horizontal bars: the ``top`` operators of one rank's profiled step by self CPU ms."""
    rows = top_ops(table, top)[::-1]
    total = sum(r["self_ms"] for r in table if not r["name"].startswith("edu3d:"))
    fig = go.Figure()
    for kind, color in KIND_COLORS.items():
        sel = [r for r in rows if op_kind(r["name"]) == kind]
        if sel:
            fig.add_bar(y=[r["name"] for r in sel], x=[r["self_ms"] for r in sel],
                        orientation="h", name=kind, marker_color=color,
                        text=[f"{r['self_ms']:.2f} ms × {r['calls']}" for r in sel],
                        textposition="auto",
                        hovertemplate="%{y}: %{x:.3f} ms self CPU<extra></extra>")
    lead = rows[-1] if rows else {"name": "-", "self_ms": 0.0}
    style.frame(fig, f"Where rank {rank}'s profiled step spent its CPU time",
                f"top {len(rows)} operators by self time; {lead['name']} alone is "
                f"{lead['self_ms'] / max(total, 1e-9):.0%} of {total:.1f} ms",
                x="self CPU time (ms)", height=140 + 28 * max(len(rows), 3))
    fig.update_yaxes(categoryorder="array", categoryarray=[r["name"] for r in rows])
    fig.update_layout(barmode="stack")
    return fig


def profile_timeline(events: list[dict]):
    """The profiler's top-level events of every rank on the course's lanes."""
    evs = [e for e in events if e.get("t1", 0) > e.get("t0", 0)]
    ranks = sorted({e["rank"] for e in evs})
    ops = [op for op in ("F", "B", "optimizer", "all_reduce", "broadcast", "send", "recv")
           if any(e["op"] == op for e in evs)]
    return timeline_figure(
        evs, ops=ops, idle=False,
        title=f"torch.profiler's events of one step, {len(ranks)} ranks",
        takeaway="each bar is a top-level operator (a matmul, a backward function, AdamW's "
                 "step); yellow: the collectives, on gloo's own thread")


def bar_length(row: dict) -> float:
    """A budget bar's length (ms): its compute, exposed communication and idle, stacked."""
    return sum(row.get(key, 0.0) for key, _, _ in BUDGET)


def budget_figure(rows: dict[str, dict], *, title: str, takeaway: str,
                  ghosts: tuple = ()):
    """Stacked horizontal bars, one per configuration (keys of ``rows``): compute, exposed
    communication, idle (ms). Names in ``ghosts`` are drawn translucent: predictions. The
    text beside each bar gives its whole communication and the part compute hid."""
    names = list(rows)
    fig = go.Figure()
    for key, label, color in BUDGET:
        fig.add_bar(y=names, x=[rows[n].get(key, 0.0) for n in names], orientation="h",
                    name=label, marker_color=color,
                    marker_opacity=[style.GHOST_OPACITY if n in ghosts else 1.0 for n in names],
                    text=[f"{rows[n].get(key, 0.0):.1f}" for n in names],
                    textposition="inside",
                    marker_pattern=style.IDLE_PATTERN if key == "idle" else None,
                    hovertemplate=f"{label}: " + "%{x:.1f} ms<extra>%{y}</extra>")
    ends = [bar_length(rows[n]) for n in names]
    fig.add_scatter(y=names, x=ends, mode="text", textposition="middle right",
                    text=[f"  {e:.1f} ms<br>  comm {rows[n].get('comm', 0.0):.1f} ms in all, "
                          f"{max(rows[n].get('comm', 0.0) - rows[n].get('exposed', 0.0), 0):.1f}"
                          " hidden" for n, e in zip(names, ends)],
                    hoverinfo="skip", showlegend=False)
    style.frame(fig, title, takeaway, x="time per step (ms)", height=200 + 50 * len(names))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(range=[0, max(ends + [1e-3]) * 1.6])
    fig.update_yaxes(autorange="reversed")
    return fig


def scaling_figure(rows: list[dict], cores: int):
    """Tokens/s (bars) and step time (labels) per layout, coloured by world size; the core
    count marked."""
    names = [r["name"] for r in rows]
    sizes = sorted({r["world_size"] for r in rows})
    fig = go.Figure()
    for i, n in enumerate(sizes):
        sel = [r for r in rows if r["world_size"] == n]
        fig.add_bar(x=[r["name"] for r in sel], y=[r["tokens_per_s"] for r in sel],
                    name=f"{style.plural(n, 'rank')}" + (" (more than the cores)"
                                                        if n > cores else ""),
                    marker_color=style.group_color(i),
                    marker_pattern=style.IDLE_PATTERN if n > cores else None,
                    text=[f"{r['median_s'] * 1e3:.0f} ms/step" for r in sel],
                    textposition="outside",
                    hovertemplate="%{x}: %{y:.0f} tokens/s<extra></extra>")
    best = max(rows, key=lambda r: r["tokens_per_s"])
    style.frame(fig, f"Throughput per layout on this machine ({style.plural(cores, 'core')})",
                f"{best['name']} is fastest here: on {style.plural(cores, 'core')} more ranks "
                "only share the cores, and every collective adds latency",
                x="layout (the tiny GPT, global batch 8)", y="throughput (tokens/s)")
    fig.update_xaxes(categoryorder="array", categoryarray=names)
    top = max(r["tokens_per_s"] for r in rows)
    fig.update_yaxes(range=[0, top * 1.2])
    return fig


def bench_figure(report: dict):
    """An ``edu3d bench`` report: edu3d's median time beside the reference's, the ratio on
    top."""
    res = report["results"]
    names = [r["name"] for r in res]
    fig = go.Figure([
        go.Bar(x=names, y=[r["edu3d_s"] * 1e3 for r in res], name="edu3d",
               marker_color=style.BLUE, text=[f"ratio {r['ratio']:.2f}" for r in res],
               textposition="outside"),
        go.Bar(x=names, y=[r["reference_s"] * 1e3 for r in res],
               name=res[0]["reference"] if res else "reference", marker_color=style.ORANGE)])
    goal = next((r["goal"] for r in res if "goal" in r), None)
    style.frame(fig, f"edu3d bench {report['benchmark']} on {report['world_size']} ranks",
                "medians of interleaved repetitions; ratio = edu3d / reference"
                + (f" (goal ≤ {goal:g})" if goal else ""),
                y="time per step (ms)", height=380)
    fig.update_layout(barmode="group")
    top = max([r["edu3d_s"] for r in res] + [r["reference_s"] for r in res] + [0]) * 1e3
    fig.update_yaxes(range=[0, top * 1.25 or 1])
    return fig


def prediction_figure(preds: dict[str, dict], chosen: str, measured: dict | None = None):
    """The predicted step time of every layout (bars), the chosen one highlighted, measured
    step times (markers) where a sweep has them."""
    names = list(preds)
    fig = go.Figure()
    for key, label, color in BUDGET:
        fig.add_bar(x=names, y=[preds[n][key] for n in names], name=f"{label} (predicted)",
                    marker_color=color,
                    marker_opacity=[1.0 if n == chosen else 0.35 for n in names],
                    marker_pattern=style.IDLE_PATTERN if key == "idle" else None)
    if measured:
        have = [n for n in names if n in measured]
        fig.add_scatter(x=have, y=[measured[n] for n in have], mode="markers",
                        name="measured step", marker={"symbol": "diamond", "size": 12,
                                                      "color": style.BLACK})
    p = preds[chosen]
    drawn = sum(p[key] for key, _, _ in BUDGET)  # the caption adds up the bar it sits over
    style.frame(fig, f"Predicted step time per layout; {chosen} highlighted",
                f"{chosen}: {drawn:.1f} ms = compute {p['compute']:.1f} + exposed comm "
                f"{p['exposed']:.1f} + bubble {p['idle']:.1f}",
                y="time per step (ms)", height=380)
    fig.update_layout(barmode="stack")
    return fig


def predicted_measured_figure(rows: list[dict]):
    """Measured (solid) and predicted (hatched) step time of each layout (``rows`` of
    ``{"name", "predicted", "measured", "error"}``, ms), the error written above."""
    names = [r["name"] for r in rows]
    fig = go.Figure()
    fig.add_bar(x=names, y=[r["measured"] for r in rows], name="measured",
                marker=style.measured_marker(style.BLUE))
    fig.add_bar(x=names, y=[r["predicted"] for r in rows], name="predicted",
                marker=style.estimate_marker(style.BLUE),
                text=[f"{round(r['error'], 2):+.0%}" for r in rows], textposition="outside")
    worst = max(rows, key=lambda r: abs(r["error"])) if rows else None
    errors = sorted(abs(r["error"]) for r in rows)
    median = errors[len(errors) // 2] if errors else 0.0
    style.frame(fig, "This machine: the performance model's step beside the measured one",
                f"median error {median:.0%}" + (f"; worst {worst['name']} {worst['error']:+.0%}"
                                                 if worst else ""),
                y="time per step (ms)", height=380)
    fig.update_layout(barmode="group")
    return fig


def published_figure(published: dict, source: str | None = None):
    """Predicted over measured for every published run (``points`` of
    :func:`edu3d.course.ch10_performance_predict.published`), log axes, coloured by source
    (``source`` highlighted, the others faded), ``y = x`` and the +-30 % band."""
    points, summary = published["points"], published["summary"]
    sources = sorted({p["framework"] for p in points})
    fig = go.Figure()
    lo = min(min(p["measured"], p["predicted"]) for p in points) / 1.5
    hi = max(max(p["measured"], p["predicted"]) for p in points) * 1.5
    for factor, name, dash in ((1.0, "y = x (perfect)", "solid"), (1.3, "+-30 %", "dot"),
                               (1 / 1.3, None, "dot")):
        fig.add_scatter(x=[lo, hi], y=[lo * factor, hi * factor], mode="lines", name=name,
                        line={"color": style.GREY, "dash": dash, "width": 1},
                        showlegend=name is not None, hoverinfo="skip")
    for i, src in enumerate(sources):
        mine = [p for p in points if p["framework"] == src]
        faded = source is not None and src != source
        fig.add_scatter(
            x=[p["measured"] for p in mine], y=[p["predicted"] for p in mine], mode="markers",
            name=src, text=[f"{p['id']}<br>{p['metric']}: {p['error']:+.0%}" for p in mine],
            hoverinfo="text", opacity=0.25 if faded else 1.0,
            marker={"color": style.group_color(i), "size": 9,
                    "line": {"color": style.BLACK, "width": [2 if p["miss"] else 0
                                                             for p in mine]}})
    misses = [p for p in points if p["miss"]]
    for i, p in enumerate(misses):  # a log axis places annotations in log10 units
        fig.add_annotation(x=math.log10(p["measured"]), y=math.log10(p["predicted"]),
                           text=p["id"], showarrow=True, arrowhead=0, ax=0,
                           ay=-30 if i % 2 == 0 else 36, font={"size": 10})
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    s = summary[source]["throughput"] if source else summary["overall"]["throughput"]
    style.frame(fig, "The model against published runs (each in its source's own unit: "
                     "tokens/s/GPU, TFLOP/s/GPU or s per step)",
                f"{source or 'all sources'}: {s['rows']} runs, median error {s['median']:.0%}, "
                f"worst {s['worst']:.0%}; " + (f"ringed: {len(misses)} known misses (> 30 %)"
                                               if misses else "none beyond 30 %"),
                x="measured (its source's unit, log)", y="predicted (same unit, log)", height=520)
    return fig
