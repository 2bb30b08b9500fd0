"""Documents of different lengths, batched five ways: one figure of three panels.

The length histogram the corpus draws from; the padding waste of each ``--batching`` mode,
measured (solid bars) beside the formula where there is one (``pad``: hatched); the tokens
per second each mode trained at (bars, the spread over steps as an error bar)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from edu3d.widgets.style import BLUE, FONT, GREY, ORANGE, TEAL, title_text

MODE_COLORS = {"fixed": GREY, "pad": ORANGE, "bucket": TEAL, "tokens": BLUE, "pack": "#CC79A7"}


def batching_figure(hist: dict, results: list[dict], formula: float) -> go.Figure:
    """``hist``: ``{"length", "count", "mean"}``; ``results``: one dict per mode (``mode``,
    ``waste``, ``tokens_per_s``, ``tokens_per_s_spread``); ``formula``: pad's expected waste."""
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.09, subplot_titles=(
        "document lengths", "padding waste (% of computed positions)", "target tokens/s"))
    fig.add_bar(x=hist["length"], y=hist["count"], marker_color=GREY, name="documents",
                showlegend=False, row=1, col=1)
    fig.add_vline(x=hist["mean"], line_dash="dash", line_color="black", row=1, col=1,
                  annotation_text=f"mean {hist['mean']:.1f}", annotation_position="top right")
    modes = [r["mode"] for r in results]
    colors = [MODE_COLORS.get(m, GREY) for m in modes]
    fig.add_bar(x=modes, y=[100 * r["waste"] for r in results], marker_color=colors,
                name="measured", row=1, col=2,
                text=[f"{100 * r['waste']:.0f}%" for r in results], textposition="outside")
    if "pad" in modes:
        fig.add_bar(x=["pad"], y=[100 * formula], name="formula 1 - E[n]/E[max]",
                    marker={"color": "rgba(0,0,0,0)", "line": {"color": ORANGE, "width": 2},
                            "pattern": {"shape": "/", "fgcolor": ORANGE}},
                    row=1, col=2, width=0.35, offset=0.05)
    rates = [r["tokens_per_s"] for r in results]
    lo = [r["tokens_per_s"] - r["tokens_per_s_spread"][0] for r in results]
    hi = [r["tokens_per_s_spread"][1] - r["tokens_per_s"] for r in results]
    fig.add_bar(x=modes, y=rates, marker_color=colors, showlegend=False, row=1, col=3,
                error_y={"type": "data", "array": hi, "arrayminus": lo, "color": "black"})
    fig.update_xaxes(title_text="document length (tokens)", row=1, col=1)
    fig.update_yaxes(title_text="documents (count)", row=1, col=1)
    fig.update_yaxes(title_text="padding waste (%)", rangemode="tozero", row=1, col=2)
    fig.update_yaxes(title_text="throughput (target tokens/s)", rangemode="tozero", row=1, col=3)
    best = min(results, key=lambda r: r["waste"] if r["mode"] != "fixed" else 2)
    fig.update_layout(
        title=title_text("Batching documents of different lengths",
                         f"{best['mode']} wastes least ({100 * best['waste']:.0f}% padding); "
                         "padding costs compute, never loss (it is masked out)"),
        font=FONT, height=430, width=1250, barmode="overlay", margin={"t": 110},
        legend={"orientation": "h", "y": -0.2, "x": 0.35})
    return fig
