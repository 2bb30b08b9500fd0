"""Incremental checkpoints as bars: per save, the bytes written and the bytes reused.

After reading this file you should know how chapter 08's last chart reads: one panel per
choice of frozen parameters, one bar per save, its solid part the blobs that save wrote, its
hatched part the blobs it named but earlier saves had written (:mod:`edu3d.ckpt.blobs`).
Both are measured: the manifests of real runs list them (the numbers come from
:mod:`edu3d.course.ch08_checkpoints_incremental`; this module only draws).
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from edu3d.widgets import style

WRITTEN, REUSED = style.VERMILLION, style.BLUE


def saved_bytes(results: dict[str, dict], takeaway: str | None = None,
                chosen: str | None = None) -> go.Figure:
    """``results``: ``{label: {"saves": [{"step", "written", "reused"}, ...]}}``, one panel
    per label, bars per save stacked written (solid) + reused (hatched), in KiB; the panel
    of ``chosen`` (the knob's case) has its title in bold, the others' bars are faded."""
    labels = list(results)
    fig = make_subplots(rows=1, cols=len(labels), shared_yaxes=True,
                        subplot_titles=labels, horizontal_spacing=0.04)
    for col, label in enumerate(labels, start=1):
        saves = results[label]["saves"]
        steps = [f"save {s['step']}" for s in saves]
        fig.add_trace(go.Bar(x=steps, y=[s["written"] / 2**10 for s in saves],
                             name="written by this save", marker_color=WRITTEN,
                             opacity=1.0 if chosen in (None, label) else 0.45,
                             legendgroup="w", showlegend=col == 1,
                             hovertemplate="%{x}: wrote %{y:.1f} KiB<extra></extra>"),
                      row=1, col=col)
        fig.add_trace(go.Bar(x=steps, y=[s["reused"] / 2**10 for s in saves],
                             name="reused (written by an earlier save)",
                             marker={"color": style.rgba(REUSED, 0.25),
                                     "line": {"color": REUSED, "width": 1},
                                     "pattern": {"shape": "/", "fgcolor": REUSED}},
                             legendgroup="r", showlegend=col == 1,
                             hovertemplate="%{x}: reused %{y:.1f} KiB<extra></extra>"),
                      row=1, col=col)
    fig.update_layout(barmode="stack", legend={"orientation": "h", "y": -0.18})
    style.frame(fig, "Bytes per incremental save, measured", takeaway, height=440)
    fig.update_yaxes(title_text="KiB per save", row=1, col=1)
    if takeaway:  # room between the takeaway line and the panels' titles
        fig.update_layout(margin={"t": 105})
    fig.update_annotations(font={"size": 12})
    for note in fig.layout.annotations:
        if chosen is not None and note.text == chosen:
            note.text = f"<b>{chosen}</b>"
    return fig
