"""3D parallelism: the capstone's pictures.

After reading this file you should know how to read chapter 06's charts:

* :func:`timeline_3d` — **lane = rank** (all 8 of dp2-tp2-pp2), x = time since the shown
  step's first event. The compute lane is coloured by operation (forward blue, backward
  orange, optimizer vermillion; hatched grey = idle); the communication sub-lane under it is
  coloured by **axis**: TP's all-reduces (inside every forward and backward), PP's sends and
  receives (between them), DP/ZeRO's reduce-scatter and all-gather (at the end of the step).
* :func:`memory_per_rank` — bytes per rank stacked by category (parameters, gradients,
  optimizer state, activations), measured, with the estimate as a ghost marker.
* :func:`pipeline_view` — the events of one pipeline of a 3D run, ranks renumbered by
  stage, to draw over the simulated schedule
  (:func:`edu3d.widgets.pipeline.simulated_pipeline`).

The chapter's knobs are :mod:`edu3d.widgets.panels.ch06_3d_parallelism`.
"""

from __future__ import annotations

import plotly.graph_objects as go

from edu3d.widgets import style
from edu3d.widgets.timeline import add_bars, idle_gaps, lanes, step_events

#: communication colours by axis, and the legend's words for them
AXIS_COLORS = {"tp": style.YELLOW, "pp": style.SEND, "dp": "#882255", "world": style.GREY}
AXIS_NAMES = {"tp": "TP all-reduce (tensor group)", "pp": "PP send/recv (pipeline group)",
              "dp": "DP/ZeRO reduce-scatter + all-gather", "world": "grad-norm all-reduce"}
MEMORY_COLORS = {"params": style.BLUE, "grads": style.ORANGE, "optimizer": style.GREEN,
                 "activations": style.PURPLE}
CATEGORIES = tuple(MEMORY_COLORS)


# ---- the timeline of one step ------------------------------------------------------------------
def rank_label(rank: int, layout=None) -> str:
    """``rank 5`` or, with the run's layout, ``rank 5 (pp1 dp0 tp1)``: where it sits."""
    if layout is None:
        return f"rank {rank}"
    c = layout.coords(rank)
    return f"rank {rank} (pp{c.pp} dp{c.dp} tp{c.tp})"


def timeline_3d(events: list[dict], step: int, *, title: str | None = None,
                takeaway: str | None = None, layout=None):
    """Every rank's lanes for one step: compute by operation, communication by axis; with
    ``layout`` each rank is labelled with its (pp, dp, tp) coordinates."""
    evs = step_events(events, step)
    fig = go.Figure()
    if not evs:
        return style.frame(fig, title or f"3D step {step}", "no events recorded for this step",
                           x="time since the step's first event (ms)")
    where = lanes([e["rank"] for e in evs], {e["lane"] for e in evs})
    add_bars(fig, idle_gaps(evs), where, name="idle", color="rgba(0,0,0,0)",
             pattern=style.IDLE_PATTERN, text=False)
    compute_ops = list(dict.fromkeys(e["op"] for e in evs if e["lane"] == "compute"))
    names = {"F": "forward (F)", "B": "backward (B)", "I": "input grad (I)",
             "W": "weight grad (W)", "optimizer": "optimizer step"}
    for op in compute_ops:
        sel = [e for e in evs if e["lane"] == "compute" and e["op"] == op]
        add_bars(fig, sel, where, name=names.get(op, op), color=style.op_color(op))
    groups = list(dict.fromkeys(e.get("group") or "world" for e in evs if e["lane"] == "comm"))
    for g in sorted(groups, key=lambda g: list(AXIS_COLORS).index(g) if g in AXIS_COLORS else 9):
        sel = [e for e in evs if e["lane"] == "comm" and (e.get("group") or "world") == g]
        add_bars(fig, sel, where, name=AXIS_NAMES.get(g, f"{g} collective"),
                 color=AXIS_COLORS.get(g, style.GREY), text=False)
    style.frame(fig, title or f"All {len(set(e['rank'] for e in evs))} ranks, step {step}",
                takeaway or "TP's all-reduces sit inside every F and B, PP's sends between "
                "them, DP/ZeRO's reduce-scatter and all-gather at the end of the step.",
                x="time since the step's first event (ms)",
                height=max(300, 130 + 30 * len(where.tickvals)))
    fig.update_layout(barmode="overlay", bargap=0, hoverlabel={"align": "left"},
                      uniformtext={"minsize": 8, "mode": "hide"})
    ticks = [rank_label(int(t.split()[1]), layout) if t.startswith("rank ") else t
             for t in where.ticktext]
    fig.update_yaxes(tickvals=where.tickvals, ticktext=ticks, range=where.extent[::-1],
                     showgrid=False, zeroline=False)
    end = max(e["t1"] for e in evs) / 1e3
    fig.update_xaxes(range=[0, end * 1.01 or 1.0])
    return fig


# ---- memory per rank ---------------------------------------------------------------------------
def memory_per_rank(measured: dict[int, dict], estimate: dict[int, dict] | None = None, *,
                    title: str = "Memory per rank", takeaway: str | None = None, layout=None):
    """Stacked bars per rank (KiB): params, grads, optimizer state, activations; the
    estimate's total as a ghost diamond over each bar; with ``layout`` each rank is labelled
    with its (pp, dp, tp) coordinates."""
    ranks = sorted(measured)
    x = [rank_label(r, layout).replace(" (", "<br>(") for r in ranks]
    fig = go.Figure()
    for cat in CATEGORIES:
        fig.add_bar(x=x, y=[measured[r].get(cat, 0) / 1024 for r in ranks], name=cat,
                    marker_color=MEMORY_COLORS[cat],
                    hovertemplate=f"{cat}: " + "%{y:.1f} KiB<extra>%{x}</extra>")
    if estimate:
        fig.add_scatter(x=x, y=[sum(estimate[r].get(c, 0) for c in CATEGORIES) / 1024
                                for r in ranks],
                        mode="markers", name="estimate (total)",
                        marker={"symbol": "diamond-open", "size": 14, "color": style.BLACK,
                                "line": {"width": 2}},
                        hovertemplate="estimate %{y:.1f} KiB<extra>%{x}</extra>")
    style.frame(fig, title, takeaway or "Each rank holds 1/tp of its stage; ZeRO-1 splits "
                "the optimizer state over dp.", x="rank", y="memory (KiB)")
    fig.update_layout(barmode="stack", height=380)
    return fig


def pipeline_view(events: list[dict], layout, dp: int = 0, tp: int = 0) -> list[dict]:
    """The events of the pipeline through (dp, tp), ranks renumbered by stage: what
    :func:`simulated_pipeline` draws over its simulation."""
    out = []
    for e in events:
        c = layout.coords(e["rank"])
        if c.dp == dp and c.tp == tp and (e["lane"] == "mem" or e["op"] in
                                           ("F", "B", "I", "W", "send", "recv")):
            out.append({**e, "rank": c.pp})
    return out
