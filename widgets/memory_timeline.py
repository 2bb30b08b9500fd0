"""Chapter 07's step timeline: a rank's memory through one training step, by kind.

After reading this file you should know how to read the charts:

* :func:`step_memory_figure` — one rank's bytes at every event of a recorded step
  (``edu3d train --memory-timeline``, :mod:`edu3d.train.memory_recorder`) as **stacked
  areas**, bottom to top: weights (blue), optimizer state (green), gradients (orange),
  communication buffers (sand), activations (purple, the kind that comes and goes). The
  bands behind say which phase the step is in (forward, backward, gradient reduction,
  optimizer). The **dashed line** is the planner's peak for this rank (a formula: drawn as a
  line), the **black point** the measured peak, labelled with its kind. On a GPU the
  allocator's ``allocated`` and ``reserved`` bytes are drawn as thin lines over the areas:
  the gap between them is the caching allocator's pool;
* :func:`peaks_figure` — the measured peak of several settings side by side, stacked by the
  kinds at that moment, the planner's peak as a dash over each bar.

Units follow the size (bytes, KB, MB, GB, powers of 1000). The chapter's knobs are
:mod:`edu3d.widgets.panels.ch07_memory`.
"""

from __future__ import annotations

import plotly.graph_objects as go

from edu3d.widgets import style
from edu3d.widgets.memory_plan import COLORS, NAMES

STACK = ("params", "optimizer", "grads", "comm", "activations")  # steady kinds at the bottom
PHASE_COLORS = {"forward": style.BLUE, "backward": style.ORANGE, "reduce": style.SAND,
                "optimizer": style.VERMILLION}
PHASE_NAMES = {"forward": "forward", "backward": "backward", "reduce": "grad reduction",
               "optimizer": "optimizer"}


def unit_of(nbytes: float) -> tuple[str, float]:
    """The unit a size reads best in: ``("MB", 1e6)`` for 4.2e6 bytes."""
    for name, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return name, size
    return "bytes", 1.0


def _fullest(doc: dict) -> dict:
    return max(doc["ranks"], key=lambda r: r["peak"]["total"])


def _phase_spans(xs: list[float], phases: list[str]) -> list[tuple[str, float, float]]:
    spans: list[list] = []
    for x, p in zip(xs, phases):
        if spans and spans[-1][0] == p:
            spans[-1][2] = x
        else:
            if spans:
                spans[-1][2] = x  # a phase lasts until the next begins
            spans.append([p, x, x])
    return [tuple(s) for s in spans if s[0] in PHASE_COLORS and s[2] > s[1]]


def _label(s: dict) -> str:
    where = f" mb{s['mb']}" if "mb" in s else ""
    return f"{s['op']}{where} {s['edge']} ({s['phase']})"


def step_memory_figure(doc: dict, rank: int | None = None, x: str = "time", *,
                       title: str | None = None, takeaway: str | None = None):
    """One rank's recorded step as stacked areas (default: the rank whose peak is highest),
    the planner's peak as a dashed line and the measured peak as a point. ``x``: ``"time"``
    (ms since the step began) or ``"event"`` (samples evenly spaced, every event readable)."""
    tl = _fullest(doc) if rank is None else next(r for r in doc["ranks"] if r["rank"] == rank)
    samples = tl["samples"]
    plan = doc["planner"]["peak"]["per_stage"][tl["coord"][0]]
    gpu = "allocated" in samples[0]
    top = max([plan["total"], tl["peak"]["total"]]
              + ([max(s["reserved"] for s in samples)] if gpu else []))
    unit, size = unit_of(top)
    xs = [s["t"] / 1e3 for s in samples] if x == "time" else list(range(len(samples)))
    fig = go.Figure()
    for phase, a, b in _phase_spans(xs, [s["phase"] for s in samples]):
        fig.add_vrect(x0=a, x1=b, fillcolor=PHASE_COLORS[phase], opacity=0.07, line_width=0,
                      layer="below")
    seen_phases = []
    for phase, *_ in _phase_spans(xs, [s["phase"] for s in samples]):
        if phase not in seen_phases:
            seen_phases.append(phase)
    for phase in seen_phases:  # the bands' key, as legend entries
        fig.add_scatter(x=[None], y=[None], mode="markers", name=f"{PHASE_NAMES[phase]} (band)",
                        marker={"symbol": "square", "size": 12, "color": PHASE_COLORS[phase],
                                "opacity": 0.3}, legendgroup="phases")
    labels = [_label(s) for s in samples]
    for kind in STACK:
        ys = [s[kind] / size for s in samples]
        if not any(ys):
            continue
        fig.add_scatter(x=xs, y=ys, name=NAMES[kind], stackgroup="held", mode="lines",
                        line={"color": COLORS[kind], "width": 0.8},
                        fillcolor=style.rgba(COLORS[kind], 0.75), customdata=labels,
                        hovertemplate=f"{NAMES[kind]}: %{{y:.3f}} {unit}"
                                      "<extra>%{customdata}</extra>")
    if gpu:
        for key, dash in (("allocated", "solid"), ("reserved", "dot")):
            fig.add_scatter(x=xs, y=[s[key] / size for s in samples], mode="lines",
                            name=f"CUDA {key} (allocator)",
                            line={"color": style.BLACK, "width": 1.2, "dash": dash})
    fig.add_scatter(x=[xs[0], xs[-1]], y=[plan["total"] / size] * 2, mode="lines",
                    name=f"planner's peak: {plan['total'] / size:.2f} {unit}",
                    line={"color": style.BLACK, "dash": "dash", "width": 1.5},
                    hovertemplate="planner's peak %{y:.3f} " + unit + "<extra></extra>")
    p = tl["peak"]
    px = xs[p["index"]]
    fig.add_scatter(x=[px], y=[p["total"] / size], mode="markers",
                    name=f"measured peak: {p['total'] / size:.2f} {unit}",
                    marker={"color": style.BLACK, "size": 9},
                    hovertemplate=f"measured peak %{{y:.3f}} {unit}<br>{labels[p['index']]}"
                                  "<extra></extra>")
    o = doc["options"]
    mode = f", {o['grad_reduce']}" if o.get("grad_reduce") and o["zero"] >= 2 else ""
    mode += f", --freeze {o['freeze']}" if o.get("freeze") else ""  # the planner counts it too
    style.frame(fig, title or f"Rank {tl['rank']}'s memory through step {doc['step']}: "
                              f"dp={o['dp']} ZeRO-{o['zero']}, {o['microbatches']} "
                              f"micro-batch(es), recompute {o['recompute']}{mode}",
                takeaway or "Weights and optimizer state stay; activations grow with each "
                            "forward and drain in backward; gradients fill as backward runs.",
                x="time in the step (ms)" if x == "time" else "event of the step (index)",
                y=f"bytes held ({unit})", height=480)
    fig.update_layout(legend={"x": 1.02, "y": 1, "yanchor": "top", "traceorder": "normal"},
                      margin={"r": 230}, hovermode="x unified")
    fig.update_yaxes(rangemode="tozero")
    fig.update_xaxes(range=[xs[0], xs[-1]])
    return fig


def peaks_figure(rows: list[dict], *, title: str | None = None, takeaway: str | None = None):
    """Measured peaks of several settings (rows of
    :func:`edu3d.course.ch07_memory_timeline.peaks`: ``label``, ``by_kind``, ``planner``),
    stacked by the kinds held at that moment; the planner's peak as a dash on each."""
    top = max(max(r["measured"], r["planner"]) for r in rows)
    unit, size = unit_of(top)
    labels = [r["label"] for r in rows]
    fig = go.Figure()
    for kind in STACK:
        ys = [r["by_kind"][kind] / size for r in rows]
        if any(ys):
            fig.add_bar(x=labels, y=ys, name=NAMES[kind], marker_color=COLORS[kind],
                        hovertemplate=f"{NAMES[kind]}: %{{y:.3f}} {unit}<extra>%{{x}}</extra>")
    fig.add_scatter(x=labels, y=[r["planner"] / size for r in rows], mode="markers",
                    name="planner's peak", marker={"symbol": "line-ew-open", "size": 34,
                                                   "color": style.BLACK,
                                                   "line": {"width": 2.5, "color": style.BLACK}},
                    hovertemplate="planner's peak %{y:.3f} " + unit + "<extra>%{x}</extra>")
    style.frame(fig, title or "The step's peak, setting by setting",
                takeaway or "What the fullest rank held at its fullest moment, by kind.",
                x="configuration (mb: micro-batches, rc: recomputation, per-mb / per-step: "
                  "--grad-reduce)", y=f"peak bytes held ({unit})", height=440)
    fig.update_xaxes(tickangle=0)
    fig.update_layout(barmode="stack", legend={"x": 1.02, "y": 1, "yanchor": "top",
                                               "traceorder": "reversed"}, margin={"r": 170})
    return fig
