"""The auto-tuner's picture: the planner's prediction against the measurement, per candidate.

After reading this file you should know how to read :func:`tune_figure`:

* one marker per candidate that ran (hover: its layout), **predicted on x, measured on y**;
  the dashed diagonal ``y = x`` is a perfect cost model. In the *values* view (log axes)
  a point above the diagonal ran slower than predicted; in the *ranks* view (1 = the
  fastest, or the smallest) a point on the diagonal was put in its right place;
* the title gives Spearman's rank correlation of the two: how well the model *ordered*
  the candidates, whatever its absolute error;
* the winner (the fastest measured that fits) is a green star; a chosen candidate a
  vermillion ring.

Data in (:func:`edu3d.course.ch07_memory_tune.points`), a plotly figure out; the knobs that
redraw it are :mod:`edu3d.widgets.panels.ch07_memory`.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from edu3d.widgets import style

VIEWS = ("values", "ranks")


def _times(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2g}x"


def tune_figure(pts: dict, view: str = "values", highlight: str | None = None):
    """Predicted against measured ``pts["metric"]`` per candidate, in ``view`` (``values``
    on log axes, or ``ranks``), with the diagonal of a perfect model."""
    if view not in VIEWS:
        raise ValueError(f"view {view!r}: choose one of {', '.join(VIEWS)}")
    labels, metric, unit = pts["labels"], pts["metric"], pts["unit"]
    ranked = view == "ranks"
    xs = pts["predicted_rank"] if ranked else pts["predicted"]
    ys = pts["measured_rank"] if ranked else pts["measured"]
    fig = go.Figure()
    if xs:
        lo, hi = min(xs + ys), max(xs + ys)
        if not ranked:
            lo, hi = lo / 1.5, hi * 1.5
        fig.add_scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="y = x: a perfect model",
                        line={"dash": "dash", "color": style.GREY}, hoverinfo="skip")
    fig.add_scatter(x=xs, y=ys, mode="markers", name="candidates", text=labels,
                    marker={"size": 11, "color": style.BLUE},
                    hovertemplate="%{text}<br>predicted %{x:.3g}, measured %{y:.3g}"
                                  "<extra></extra>")
    for name, who, marker in (
            ("winner (fastest that fits)", pts["winner"],
             {"symbol": "star", "size": 18, "color": style.GREEN}),
            (f"chosen: {highlight}", highlight,
             {"symbol": "circle-open", "size": 22, "color": style.VERMILLION,
              "line": {"width": 3}})):
        if who in labels:
            i = labels.index(who)
            fig.add_scatter(x=[xs[i]], y=[ys[i]], mode="markers", name=name, marker=marker,
                            text=[who], hovertemplate="%{text}<extra></extra>")
    rho = pts["spearman"]
    grade = "undefined" if rho is None or math.isnan(rho) else f"{rho:+.2f}"
    if not xs:
        takeaway = "no candidate was measured"
    elif ranked:
        takeaway = (f"On the diagonal: ranked right. Furthest from it: {pts['misranked']}.")
    else:
        ratios = [y / x for x, y in zip(xs, ys) if x > 0]
        takeaway = (f"Measured {_times(min(ratios))} to {_times(max(ratios))} the prediction; "
                    "the order is what the correlation grades." if ratios else "")
    where = f"{pts['world_size']} ranks on {pts['device']}"
    style.frame(fig, f"Predicted vs measured {metric}, {len(xs)} candidates on {where}: "
                     f"Spearman ρ = {grade}", takeaway,
                x=f"predicted {metric} " + ("(place, 1 = least)" if ranked else
                                            f"({unit}, log scale)"),
                y=f"measured {metric} " + ("(place, 1 = least)" if ranked else
                                           f"({unit}, log scale)"), height=440)
    if not ranked:
        fig.update_xaxes(type="log")
        fig.update_yaxes(type="log")
    return fig
