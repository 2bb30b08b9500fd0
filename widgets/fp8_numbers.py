"""FP8 drawn from live numbers: one tensor's error by scale, loss curves, ZeRO-3's bytes.

After reading this file you should be able to read the three charts of chapter 07's FP8
section: each row's cast error against the row's magnitude (one tensorwise scale flushes
the small rows, a rowwise scale keeps every row at E4M3's 3 mantissa bits); the losses of
fp32, bf16 and FP8 with their gap to fp32 underneath; and the bytes one ZeRO-3 gather of
the blocks' linear weights fills in fp32, bf16 and FP8, measured from the trace.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from edu3d.widgets import style

SCALE_COLORS = {"tensorwise": style.BLUE, "rowwise": style.ORANGE, "unscaled": style.GREY}
PRECISION_COLORS = {"fp32": style.BLACK, "bf16": style.BLUE, "fp8": style.VERMILLION}


def scale_error_figure(report: dict, chosen: str | None = None):
    """Each row's relative cast error (log) against its largest magnitude (log), one line
    per way of scaling (:func:`edu3d.course.ch07_memory_fp8.tensor_report`); ``chosen``
    (a way of scaling) drawn bold, the others faded."""
    x = report["row_amax"]
    fig = go.Figure()
    for name, color in SCALE_COLORS.items():
        r = report[name]
        bold = chosen is None or name == chosen
        fig.add_trace(go.Scatter(
            x=x, y=[max(e, 1e-4) for e in r["row_errors"]], mode="lines+markers",
            name=f"{name}: {r['rel_error']:.1%} overall, {r['flushed']:.0%} flushed",
            opacity=1.0 if bold else 0.35,
            line={"color": color, "dash": "dot" if name == "unscaled" else None,
                  "width": 3 if chosen is not None and bold else 2}))
    fig.add_hline(y=2.0**-4, line={"color": style.GREY, "dash": "dash"},
                  annotation_text="2^-4: E4M3's worst rounding of a normal number")
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log", range=[-4.2, 0.3])
    return style.frame(fig, "One tensor cast to E4M3: each row's error",
                       "one scale for the tensor flushes the small rows to 0; one per row keeps "
                       "3 mantissa bits in every row", x="the row's largest magnitude (|x|, log)",
                       y="relative error of the row (log)")


def loss_curves_figure(losses: dict, gaps: dict):
    """The three precisions' losses (top) and each one's relative gap to fp32 (bottom)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.65, 0.35],
                        vertical_spacing=0.06)
    ref = losses["fp32"]
    for p, curve in losses.items():
        steps = list(range(1, len(curve) + 1))
        color = PRECISION_COLORS.get(p, style.GREY)
        fig.add_trace(go.Scatter(x=steps, y=curve, mode="lines", name=p,
                                 line={"color": color}), row=1, col=1)
        if p != "fp32":
            fig.add_trace(go.Scatter(
                x=steps, y=[abs(a - b) / abs(b) for a, b in zip(curve, ref)], mode="lines",
                name=f"{p} gap (mean of the last steps {gaps[p]['mean']:.1e})",
                line={"color": color, "dash": "dot"}), row=2, col=1)
    fig.update_yaxes(title_text="loss (nats)", row=1, col=1)
    fig.update_yaxes(title_text="gap to fp32 (relative)", type="log", row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    return style.frame(fig, "The same run in fp32, bf16 and FP8 (ZeRO-3, dp=2)",
                       "the curves overlap; their gap to fp32, measured at every step, is "
                       "drawn underneath", height=480)


def gather_bytes_figure(table: dict):
    """Bytes per gather of the blocks' linear weights (left) and of every unit (right, the
    planner's formula as a ghost bar) (:func:`edu3d.course.ch07_memory_fp8.gather_table`)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "the blocks' linear weights", "every unit (embeddings, norms, biases too)"))
    w = table["weights"]
    names = ["fp32", "bf16", "fp8"]
    fig.add_trace(go.Bar(x=names, y=[w[n] / 1024 for n in names], name="measured (trace)",
                         marker_color=[PRECISION_COLORS[n] for n in names],
                         text=[f"{w[n] / 1024:.0f} KiB" for n in names],
                         textposition="outside"), row=1, col=1)
    whole, formula = table["whole"], table["formula"]
    cases = [("fp32", "fp32"), ("bf16 gathers", "bf16"), ("fp8", "fp8")]
    fig.add_trace(go.Bar(x=[label for _, label in cases],
                         y=[formula.get(c, float("nan")) / 1024 for c, _ in cases],
                         name="formula (planner)", marker=style.estimate_marker(style.OLIVE)),
                  row=1, col=2)
    fig.add_trace(go.Bar(x=[label for _, label in cases], y=[whole[c] / 1024 for c, _ in cases],
                         name="measured", marker_color=[PRECISION_COLORS[n] for _, n in cases],
                         width=0.4, showlegend=False,
                         text=[f"{whole[c] / 1024:.0f}" for c, _ in cases],
                         textposition="inside"), row=1, col=2)
    fig.update_layout(barmode="overlay")
    return style.frame(fig, "One ZeRO-3 all-gather, bytes by precision (dp=2, gloo)",
                       "the FP8 weights travel in 1 byte: half of bf16's 2, a quarter of fp32's",
                       y="bytes per gather (KiB)", height=420)
