"""Chapter 07's activation-offload curves: a rank's activations through one step, with
nothing freed, with the blocks' saved tensors offloaded to host memory, and recomputed.

After reading this file you should know how to read the chart :func:`offload_figure` draws:

* one **solid line per mode** (none, offloaded, full recomputation, both): the bytes of
  activations on the device at every event of the recorded step (the memory recorder's
  ``activations``; the x axis counts events, since a recomputed step has more of them);
  the top of each line is the mode's activation peak;
* a **dotted line** for each mode that offloads: the bytes waiting in the host pool (on a
  GPU, pinned host RAM; on a CPU, a second pool of the same RAM). It climbs through the
  forward and drains through the backward, as the device's line does without offloading;
* the **bands** behind show the step's phases of the first mode's timeline (forward,
  backward), so the curves' rise and fall can be matched to the step.

The numbers come from :func:`edu3d.course.ch07_memory_offload.curves`; the knobs are
:class:`edu3d.widgets.panels.ch07_memory_offload.OffloadControls`.
"""

from __future__ import annotations

import plotly.graph_objects as go

from edu3d.widgets import style
from edu3d.widgets.memory_timeline import PHASE_COLORS, unit_of

MODE_COLORS = {"none": style.BLACK, "offload": style.PURPLE, "full recompute": style.GREEN,
               "full + offload": style.SKY}


def offload_figure(curves: dict[str, dict], *, title: str, takeaway: str):
    """``curves``: ``{mode: {"x", "device", "host", "phase"}}``; one line per mode on the
    device, a dotted one per offloading mode for the host pool."""
    top = max(max(c["device"] + c["host"]) for c in curves.values())
    unit, size = unit_of(top)
    fig = go.Figure()
    first = next(iter(curves.values()))
    start = 0
    for i in range(1, len(first["x"]) + 1):  # the first mode's phases, as bands
        if i == len(first["x"]) or first["phase"][i] != first["phase"][start]:
            if first["phase"][start] in PHASE_COLORS and i - 1 > start:
                fig.add_vrect(x0=start, x1=i - 1, line_width=0, layer="below", opacity=0.07,
                              fillcolor=PHASE_COLORS[first["phase"][start]])
            start = i
    for mode, c in curves.items():
        color = MODE_COLORS.get(mode, style.GREY)
        fig.add_scatter(x=c["x"], y=[v / size for v in c["device"]], mode="lines",
                        name=f"{mode}: on the device", line={"color": color, "width": 2},
                        hovertemplate=f"{mode}, device: %{{y:.3f}} {unit}<extra></extra>")
        if any(c["host"]):
            fig.add_scatter(x=c["x"], y=[v / size for v in c["host"]], mode="lines",
                            name=f"{mode}: in the host pool",
                            line={"color": color, "width": 2, "dash": "dot"},
                            hovertemplate=f"{mode}, host: %{{y:.3f}} {unit}<extra></extra>")
    style.frame(fig, title, takeaway, x="event of the step (index)",
                y=f"activations ({unit})", height=460)
    fig.update_layout(legend={"x": 1.02, "y": 1, "yanchor": "top"}, margin={"r": 230})
    fig.update_yaxes(rangemode="tozero")
    return fig
