"""ZeRO under gradient accumulation: gradient memory and bytes on the wire against micro-batches.

After reading this file you should be able to read one chart with two panels, x = the
number of micro-batches ``m`` of a step:

* left, the **gradient bytes a rank holds during the step** (between two micro-batches);
  right, the **bytes it sends per step** over the data-parallel group;
* colour = the way of reducing (DDP grey, ZeRO-1 sky, ZeRO-2 orange, ZeRO-3 vermillion);
  line style = the mode of ZeRO-2/3, solid ``per-microbatch`` (reduce-scatter every
  micro-batch, keep the ``1/N`` shard), dotted ``per-step`` (accumulate full gradients,
  reduce once);
* the planner's formula is the line (a ghost, DESIGN.md's visual grammar), the run's
  measurement the solid marker on it (filled: per-microbatch, open: per-step). Lines that
  coincide are the lesson: per-step ZeRO-2 holds ZeRO-1's gradients, and DDP, ZeRO-1 and
  per-step ZeRO-2 send the same bytes.

Rows come from :func:`edu3d.course.ch03_zero_reduce.table`; this module only draws them.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from edu3d.widgets import style

STAGE_COLORS = {0: style.GREY, 1: style.SKY, 2: style.ORANGE, 3: style.VERMILLION}
DASH = {"per-microbatch": "solid", "per-step": "dot"}
SYMBOL = {"per-microbatch": "circle", "per-step": "diamond-open"}
FADED = 0.15  # a case the panel did not choose
SIZES = (22, 14, 12, 12, 7, 7)  # by case: coinciding markers nest as rings, all visible


def _unit(values) -> tuple[str, float]:
    top = max(values, default=0)
    return ("MB", 1e6) if top >= 1e6 else ("kB", 1e3)


def _cases(rows: list[dict]) -> list[tuple]:
    seen = []
    for r in rows:
        key = (r["label"], r["zero"], r["grad_reduce"])
        if key not in seen:
            seen.append(key)
    return seen


def takeaway(rows: list[dict]) -> str:
    """The chart's one line, from its own numbers (measured where the run has them): the two
    modes of ZeRO-2 (and ZeRO-3's traffic) at the largest ``m``."""
    def val(zero, mode, what):
        mine = [r for r in rows if r["zero"] == zero and r["grad_reduce"] == mode]
        r = max(mine, key=lambda r: r["m"], default=None)
        return None if r is None else r.get(f"{what}_measured", r[what])

    m = max(r["m"] for r in rows)
    g_mb, g_ps = val(2, "per-microbatch", "grads"), val(2, "per-step", "grads")
    w_mb, w_ps = val(2, "per-microbatch", "wire"), val(2, "per-step", "wire")
    if None in (g_mb, g_ps, w_mb, w_ps):
        return "per-microbatch keeps the 1/N gradient shard and sends more as m grows"
    w3 = val(3, "per-microbatch", "wire")
    return (f"at m={m}, ZeRO-2 per-microbatch holds {g_mb / g_ps:.0%} of per-step's gradient "
            f"bytes and sends {w_mb / w_ps:.1f}x its bytes"
            + ("" if w3 is None else f" (ZeRO-3 per-microbatch: {w3 / w_ps:.1f}x)"))


def _label_lines(fig, rows: list[dict], what: str, div: float, col: int) -> None:
    """Name the cases on each line at its right end: lines that coincide get one label
    listing them all (DDP = ZeRO-1 = ZeRO-2 per-step), so no case hides under another."""
    last = max(r["m"] for r in rows)
    groups: dict = {}
    for label, zero, mode in _cases(rows):
        ys = tuple(round(r[what]) for r in sorted(rows, key=lambda r: r["m"])
                   if r["label"] == label)
        groups.setdefault(ys, []).append(label)
    for ys, labels in groups.items():
        fig.add_annotation(x=math.log10(last), y=ys[-1] / div if col == 1 else
                           math.log10(ys[-1] / div), xref=f"x{col}", yref=f"y{col}",
                           text=" = ".join(labels), showarrow=False, xanchor="right",
                           yanchor="bottom", yshift=6, xshift=-14, font={"size": 11})


def grad_reduce_figure(rows: list[dict], chosen: tuple[int, str] | None = None,
                       title: str | None = None):
    """Both panels for ``rows`` (one per case and ``m``); ``chosen`` = ``(stage, mode)``
    fades the other cases. Measured markers are drawn where a row has them."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, subplot_titles=(
        "gradient bytes a rank holds during the step", "bytes a rank sends per step"))
    ms = sorted({r["m"] for r in rows})
    for col, what in ((1, "grads"), (2, "wire")):
        unit, div = _unit([r[what] for r in rows] + [r.get(f"{what}_measured", 0) for r in rows])
        for k, (label, zero, mode) in enumerate(_cases(rows)):
            mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["m"])
            lit = chosen is None or chosen == (zero, mode) or zero < 2 and chosen[0] == zero
            color = STAGE_COLORS[zero]
            fig.add_trace(go.Scatter(
                x=[r["m"] for r in mine], y=[r[what] / div for r in mine], mode="lines",
                name=label, legendgroup=label, showlegend=col == 1,
                line={"color": color, "dash": DASH[mode], "width": 3},
                opacity=(0.55 if lit else FADED),
                hovertemplate=f"{label}<br>m=%{{x}}<br>planner %{{y:.3f}} {unit}<extra></extra>"),
                row=1, col=col)
            got = [r for r in mine if f"{what}_measured" in r]
            if got:
                fig.add_trace(go.Scatter(
                    x=[r["m"] for r in got], y=[r[f"{what}_measured"] / div for r in got],
                    mode="markers", name=f"{label} (measured)", legendgroup=label,
                    showlegend=False, opacity=1.0 if lit else FADED,
                    marker={"color": color, "symbol": SYMBOL[mode], "size": SIZES[k % 6],
                            "line": {"color": color, "width": 2}},
                    hovertemplate=(f"{label}<br>m=%{{x}}<br>measured %{{y:.3f}} {unit}"
                                   "<extra></extra>")), row=1, col=col)
        _label_lines(fig, rows, what, div, col)
        if col == 1:
            fig.update_yaxes(title_text=f"per rank ({unit})", rangemode="tozero", row=1, col=col)
        else:  # constant lines and lines growing with m, a decade apart: log
            values = [r[what] / div for r in rows]
            ticks = [k * 10 ** e for e in range(-3, 7) for k in (1, 2, 5)
                     if min(values) / 2 <= k * 10 ** e <= max(values) * 2]
            fig.update_yaxes(title_text=f"per rank ({unit}, log)", type="log", tickvals=ticks,
                             row=1, col=col)
        fig.update_xaxes(title_text="micro-batches per step (m, log)", type="log", tickvals=ms,
                         range=[-0.15, 1.05], row=1, col=col)
    measured = any("grads_measured" in r for r in rows)
    style.frame(fig, title or ("ZeRO under gradient accumulation: lines the planner, markers "
                               "a run" if measured else "ZeRO under gradient accumulation: the "
                               "planner (press 'run it' to measure)"),
                takeaway(rows), height=460)
    fig.update_layout(legend={"orientation": "h", "y": -0.2, "x": 0, "font": {"size": 12}},
                      margin={"b": 110, "t": 110})
    return fig
