"""Mixture of experts: chapter 12's pictures (data in, plotly figure out).

After reading this file you should know how to read chapter 12's charts:

* :func:`load_heatmap` — x = training step, y = expert, colour = assignments the expert got
  in that step (first MoE layer); a balanced router paints one even colour at ``T·k/E``;
* :func:`gate_histogram` — how sure the router is: the gate of each token's first and second
  choice (with k = 2 and renormalised gates they sum to 1: 0.5/0.5 is a coin toss);
* :func:`balance_chart` — one line per balancer, the busiest expert's load over the mean per
  step (1 = perfect balance, ``E/k`` = every token on the same k experts);
* :func:`scope_chart` — the same measure side by side for two ``--aux-scope`` runs: the whole
  step's loads and the busiest data rank's own micro-batch;
* :func:`capacity_chart` — for one capacity factor, the share of assignments dropped and the
  loss per step, the dropless run as a grey ghost;
* :func:`token_matrix` — the all-to-all's rank-to-rank token matrix (row = sender, column =
  receiver); the diagonal stays home, the rest crosses the network;
* :func:`memory_bars` — weights, gradients and optimizer state per model or rank, stacked; a
  row computed from a formula is drawn hatched.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from edu3d.widgets import style

LINE_COLORS = (style.VERMILLION, style.BLUE, style.GREEN, style.PURPLE, style.ORANGE)
MEMORY_COLORS = {"params": style.BLUE, "grads": style.ORANGE, "optimizer": style.GREEN}


def load_heatmap(loads: list[list[int]], *, title: str, takeaway: str, fair: float):
    """``loads[step][expert]``: assignments per expert per step; ``fair`` = ``T·k/E``."""
    steps = list(range(1, len(loads) + 1))
    experts = list(range(len(loads[0]))) if loads else []
    z = [[row[e] for row in loads] for e in experts]
    fig = go.Figure(go.Heatmap(
        z=z, x=steps, y=[f"expert {e}" for e in experts], colorscale="Cividis", zmid=fair,
        colorbar={"title": "tokens"},
        hovertemplate="step %{x}, %{y}: %{z} assignments<extra></extra>"))
    style.frame(fig, title, takeaway, x="training step", y="expert (first MoE layer)",
                height=300)
    return fig


def gate_histogram(gates: list[list[float]], *, title: str, takeaway: str):
    """``gates[token]``: the k gates of each token, highest first."""
    fig = go.Figure()
    k = len(gates[0]) if gates else 0
    for j in range(k):
        fig.add_trace(go.Histogram(x=[g[j] for g in gates], name=f"choice {j + 1}",
                                   xbins={"start": 0, "end": 1.0001, "size": 0.025},
                                   marker_color=LINE_COLORS[j % len(LINE_COLORS)],
                                   opacity=0.75))
    fig.update_layout(barmode="overlay")
    style.frame(fig, title, takeaway, x="gate (weight of the expert's output)",
                y="tokens", height=320)
    return fig


def balance_chart(series: dict[str, list[float]], *, title: str, takeaway: str,
                  collapse: float):
    """``series[name][step]``: max load / mean load per step, one line per balancer;
    ``collapse`` = ``E/k``, the most it can be."""
    fig = go.Figure()
    for i, (name, ys) in enumerate(series.items()):
        fig.add_trace(go.Scatter(x=list(range(1, len(ys) + 1)), y=ys, name=name,
                                 mode="lines", line={"color": LINE_COLORS[i % 5]}))
    _balance_axes(fig, series.values(), collapse)
    style.frame(fig, title, takeaway, x="training step", y=BALANCE_AXIS, height=380)
    return fig


BALANCE_AXIS = "busiest / mean load (ratio)"  # short: a rotated title longer than the plot overlaps


def _balance_axes(fig, curves, collapse: float, **where) -> None:
    """The perfect-balance line and a y range from 0.9 to the highest point (at most the
    collapse value ``E/k``)."""
    fig.add_hline(y=1.0, line={"dash": "dot", "color": style.GREY},
                  annotation_text="perfect balance", annotation_position="bottom right",
                  **where)
    top = max((max(c) for c in curves if c), default=2)
    fig.update_yaxes(range=[0.9, min(collapse, 1.1 * top)], **where)


def scope_chart(series: dict[str, dict[str, list[float]]], *, title: str, takeaway: str,
                collapse: float):
    """``series[scope][curve][step]``: one panel per ``--aux-scope`` run, side by side, the
    same curves in each (the whole step, each rank's micro-batch), on one y scale."""
    scopes = list(series)
    fig = make_subplots(rows=1, cols=len(scopes), shared_yaxes=True,
                        subplot_titles=[f"--aux-scope {s}" for s in scopes])
    curves = list(series[scopes[0]])
    for col, scope in enumerate(scopes, start=1):
        for i, name in enumerate(curves):
            ys = series[scope][name]
            fig.add_trace(go.Scatter(x=list(range(1, len(ys) + 1)), y=ys, name=name,
                                     legendgroup=name, showlegend=col == 1, mode="lines",
                                     line={"color": LINE_COLORS[i % 5]}), row=1, col=col)
    every = [ys for curves_ in series.values() for ys in curves_.values()]
    for col in range(1, len(scopes) + 1):
        _balance_axes(fig, every, collapse, row=1, col=col)
    style.frame(fig, title, takeaway, x="training step", height=400)
    fig.update_yaxes(title_text=BALANCE_AXIS, row=1, col=1)
    fig.update_xaxes(dtick=5, tick0=0)  # half-width panels: a tick per step would stand on end
    top = fig.layout.margin.t
    fig.update_layout(margin={"t": top + 50})  # the panels' titles under the takeaway
    return fig


def capacity_chart(runs: dict[float, dict], chosen: float, *, title: str, takeaway: str):
    """``runs[factor] = {"dropped_pct": [...], "loss": [...]}`` per step; draws ``chosen``
    over the dropless run (factor 0) as a ghost."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("assignments dropped (%)",
                                                        "training loss"))
    for ghost, factor in ((True, 0.0), (False, chosen)):
        run = runs.get(factor)
        if run is None or (ghost and chosen == 0.0):
            continue
        steps = list(range(1, len(run["loss"]) + 1))
        color = style.GREY if ghost else style.VERMILLION
        name = "dropless (C = 0)" if factor == 0 else f"C = {factor:g}"
        fig.add_trace(go.Scatter(x=steps, y=run["dropped_pct"], name=name, legendgroup=name,
                                 line={"color": color, "dash": "dot" if ghost else "solid"}),
                      row=1, col=1)
        fig.add_trace(go.Scatter(x=steps, y=run["loss"], name=name, legendgroup=name,
                                 showlegend=False,
                                 line={"color": color, "dash": "dot" if ghost else "solid"}),
                      row=1, col=2)
    style.frame(fig, title, takeaway, height=340)
    fig.update_xaxes(title_text="training step")
    fig.update_yaxes(title_text="% of T·k assignments", row=1, col=1, rangemode="tozero")
    fig.update_yaxes(title_text="loss (nats)", row=1, col=2)
    return fig


def token_matrix(matrix: list[list[int]], *, title: str, takeaway: str):
    """Row = sending rank, column = receiving rank, value = tokens (rows of h numbers)."""
    n = len(matrix)
    names = [f"rank {r}" for r in range(n)]
    fig = go.Figure(go.Heatmap(
        z=matrix, x=names, y=names, colorscale="Cividis", colorbar={"title": "tokens"},
        text=[[str(v) for v in row] for row in matrix], texttemplate="%{text}",
        hovertemplate="%{y} sends %{z} tokens to %{x}<extra></extra>"))
    style.frame(fig, title, takeaway, x="receiving rank (holds the expert)",
                y="sending rank (holds the token)", height=340)
    fig.update_yaxes(autorange="reversed")
    return fig


def memory_bars(rows: list[dict], *, title: str, takeaway: str):
    """``rows``: ``{"name", "params", "grads", "optimizer"[, "formula"]}`` in bytes; one
    horizontal stacked bar per row, a formula's row hatched."""
    fig = go.Figure()
    names = [r["name"] for r in rows]
    for cat, color in MEMORY_COLORS.items():
        fig.add_trace(go.Bar(
            y=names, x=[r[cat] / 1024 for r in rows], name=cat, orientation="h",
            marker={"color": color,
                    "pattern": {"shape": ["/" if r.get("formula") else "" for r in rows]}},
            hovertemplate="%{y}: %{x:.1f} KiB<extra>" + cat + "</extra>"))
    fig.update_layout(barmode="stack")
    style.frame(fig, title, takeaway, x="bytes held (KiB)", height=120 + 40 * len(rows))
    fig.update_yaxes(autorange="reversed")
    return fig
