"""One tensor-parallel layer's costs: the collectives it issues and the activations it keeps.

After reading this file you should be able to read chapter 04's panel charts:

* :func:`tp_collectives_figure` — one layer's collectives per phase (forward, backward),
  stacked by operation: the bytes one rank sends on a ring, predicted (ghost) and measured
  (solid), the predicted count under each phase. TP issues g's all-reduce after each row
  layer forward and f's before each column layer backward; SP swaps them for all-gather +
  reduce-scatter pairs;
* :func:`tp_memory_figure` — the activation bytes one layer keeps per rank for each tp, SP
  off and on: this model's formula (ghost bars), Korthikanti's 16-bit count (markers), and a
  run's measurement.
"""

from __future__ import annotations

import plotly.graph_objects as go

from edu3d.widgets import style

OP_NAMES = {"all_reduce": "all-reduce", "all_gather": "all-gather",
            "reduce_scatter": "reduce-scatter"}
KiB = 1024


def tp_collectives_figure(pred: dict, t: int, sp: bool, measured: dict | None = None):
    """One layer's collectives per phase, stacked by operation: bytes a rank sends on a ring
    (predicted ghost, measured solid), the count as the label."""
    fig = go.Figure()
    phases = ("forward", "backward")
    # the predicted counts in the tick labels (a ghost bar's own text would fade with it)
    x = [f"{p}<br>" + " + ".join(f"{v['count']} {OP_NAMES.get(op, op)}"
                                 for op, v in pred[p].items()) for p in phases]
    ops = list(dict.fromkeys(op for p in phases for op in pred[p]))
    if measured:
        ops += [op for p in phases for op in measured[p] if op not in ops]
    for source, data in (("predicted", pred), ("measured", measured)):
        if not data:
            continue
        for op in ops:
            color = style.op_color(op)
            counts = [data[p].get(op, {}).get("count", 0) for p in phases]
            fig.add_bar(
                x=x, y=[data[p].get(op, {}).get("ring_bytes", 0) / KiB for p in phases],
                name=f"{OP_NAMES.get(op, op)} ({source})", offsetgroup=source,
                legendgroup=op, marker=style.estimate_marker(color) if source == "predicted"
                else style.measured_marker(color, line={"color": style.GREY, "width": 1}),
                text=[f"{n} x" if n and source == "measured" else "" for n in counts],
                textposition="inside", customdata=counts,
                hovertemplate=f"{op}, {source}: " + "%{customdata} x, %{y:.1f} KiB sent"
                              "<extra></extra>")
    total = sum(v["ring_bytes"] for p in phases for v in pred[p].values())
    line = (("SP: all-gather + reduce-scatter pairs instead of all-reduces, and 2 more "
             "all-gathers in backward" if sp else "TP: g's all-reduce after each row layer "
             "forward, f's before each column layer backward")
            + f"; predicted {total / KiB:.0f} KiB per rank")
    if measured:
        got = sum(v["ring_bytes"] for p in phases for v in measured[p].values())
        line += f", measured {got / KiB:.0f} KiB"
    style.frame(fig, f"Collectives of one layer, tp = {t}{' + SP' if sp else ''} "
                "(under each phase: the predicted count)", line, x="phase of one layer (forward / backward)",
                y="bytes one rank sends on a ring (KiB)", height=380)
    fig.update_layout(barmode="stack", legend={"font": {"size": 11}})
    return fig


def tp_memory_figure(preds: dict, config, batch: int, t: int, sp: bool,
                     measured: dict | None = None):
    """Activation bytes one layer keeps per rank for each tp, SP off and on: this model's
    formula (ghost bars), Korthikanti's 16-bit count (markers), a run's measurement.
    ``preds`` maps ``(tp, sp)`` to
    :func:`edu3d.course.ch04_tensor_parallel.tp_activation_prediction`'s counts."""
    tps = sorted({k for k, _ in preds})
    x = [f"<b>tp={k} ◀</b>" if k == t else f"tp={k}" for k in tps]
    fig = go.Figure()
    for on, color in ((False, style.BLUE), (True, style.ORANGE)):
        name = "TP+SP" if on else "TP"
        row = [preds[(k, on)] for k in tps]
        fig.add_bar(x=x, y=[p["model_formula"] / KiB for p in row], offsetgroup=name,
                    name=f"{name}, formula (this model, fp32)",
                    marker_color=color, opacity=0.4 if on == sp else 0.15)
        fig.add_scatter(x=x, y=[p["korthikanti_16bit"] / KiB for p in row], mode="markers",
                        name=f"{name}, Korthikanti 16-bit", marker={
                            "symbol": "diamond-open", "size": 10, "color": color})
    mine = preds[(t, sp)]["model_formula"]
    line = (f"tp={t}{' + SP' if sp else ''}: {mine / KiB:.1f} KiB per rank; "
            + ("SP divides everything by t" if sp else "TP leaves the LayerNorm regions whole"))
    if measured:
        name = "TP+SP" if sp else "TP"
        fig.add_bar(x=[x[tps.index(t)]], y=[measured["measured"] / KiB],
                    offsetgroup=name, width=0.2, name=f"{name}, measured (rank 0)",
                    marker_color=style.ORANGE if sp else style.BLUE,
                    text=[f"{measured['measured'] / KiB:.1f}"], textposition="outside")
        line += f"; measured {measured['measured'] / KiB:.1f} KiB"
    style.frame(fig, f"Activation memory of one layer per rank (s={config.seq_len}, "
                f"b={batch}, h={config.d_model}, a={config.n_heads})", line,
                x="tensor-parallel degree (◀ = chosen)", y="activations per rank (KiB)",
                height=400)
    fig.update_layout(barmode="group", legend={"font": {"size": 11}})
    return fig
