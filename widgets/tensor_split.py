"""Tensor parallelism drawn from real shards: each rank's piece of ``X·W``, and how they meet.

After reading this file you should know how to read the chapter-04 split picture:

* one row of heatmaps per rank: the input that rank holds, its weight shard, and the
  partial output it computes alone — real tensors returned by the ranks of a live run
  (:func:`edu3d.course.ch04_tensor_parallel.split_demo`);
* an arrow labelled with the collective that joins the partial outputs: **all-gather
  (concatenate)** for a column split, where each rank owns some output features, and
  **all-reduce (sum)** for a row split, where each rank owns a partial sum of every feature;
* on the right, the result after the collective next to the serial ``X·W``, and the largest
  difference between them printed in the title.

Colour scale: one diverging scale (blue negative, white zero, vermillion positive) shared by
all panels of a figure, so a value has the same colour everywhere.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from edu3d.widgets.style import BLUE, VERMILLION, frame

_SCALE = [[0.0, BLUE], [0.5, "#FFFFFF"], [1.0, VERMILLION]]
_HOW = {"column": ("all-gather<br>(concatenate)", "Column split: Y = X·[W₁ W₂ …]",
                   "Each rank computes some output features; concatenating them is X·W."),
        "row": ("all-reduce<br>(sum)", "Row split: Y = X₁·W₁ + X₂·W₂ + …",
                "Each rank computes a partial sum of every feature; adding them is X·W.")}


def split_figure(results: list[dict], kind: str = "column"):
    """Heatmaps of every rank's shards for ``kind`` in ``{"column", "row"}``.

    ``results`` are the per-rank return values of :func:`edu3d.course.ch04_tensor_parallel.split_demo`.
    """
    if kind not in _HOW:
        raise ValueError(f"kind must be 'column' or 'row', not {kind!r}")
    arrow, title, takeaway = _HOW[kind]
    t = len(results)
    parts = [r[kind] for r in results]
    result, serial = parts[0]["result"], results[0]["serial"]
    err = float((result - serial).abs().max())
    vmax = max(float(v.abs().max()) for p in parts for v in (p["x"], p["w"], p["partial"]))
    vmax = max(vmax, float(serial.abs().max()))

    # columns: input, weight shard, partial output, (arrow), after the collective, serial
    joined = [{"rowspan": t}, {"rowspan": t}]
    specs = [[{}, {}, {}, None] + (joined if i == 0 else [None, None]) for i in range(t)]
    names = []
    for i in range(t):
        names += [f"rank {i}: X{'' if kind == 'column' else f'{i + 1}'}", f"rank {i}: W{i + 1}",
                  f"rank {i}: partial Y"]
        if i == 0:
            names += ["after the collective", "serial X·W"]
    fig = make_subplots(rows=t, cols=6, specs=specs, subplot_titles=names,
                        horizontal_spacing=0.03, vertical_spacing=0.12,
                        column_widths=[0.15, 0.15, 0.17, 0.13, 0.2, 0.2])

    def heat(z, row, col):
        fig.add_trace(go.Heatmap(z=z.tolist(), zmin=-vmax, zmax=vmax, colorscale=_SCALE,
                                 showscale=(row, col) == (1, 6), xgap=1, ygap=1,
                                 hovertemplate="row %{y}, col %{x}: %{z:.3f}<extra></extra>"),
                      row=row, col=col)
        fig.update_yaxes(autorange="reversed", showticklabels=False, row=row, col=col)
        fig.update_xaxes(showticklabels=False, row=row, col=col)

    for i, p in enumerate(parts):
        heat(p["x"], i + 1, 1)
        heat(p["w"], i + 1, 2)
        heat(p["partial"], i + 1, 3)
    heat(result, 1, 5)
    heat(serial, 1, 6)
    left = fig.get_subplot(1, 3).xaxis.domain[1]
    right = fig.get_subplot(1, 5).xaxis.domain[0]
    fig.add_annotation(x=(left + right) / 2, y=0.5, xref="paper", yref="paper",
                       text=f"<b>{arrow}</b><br>➜", showarrow=False, font={"size": 13},
                       bgcolor="#F0E442")
    frame(fig, f"{title} on {t} ranks (max |difference| to serial = {err:.1e})", takeaway,
          height=170 * t + 120, legend=False)
    return fig
