"""Chapter 09's pictures: why training is distributed, and edu3d beside the libraries.

After reading this file you should know how to read chapter 09's charts:

* :func:`need_figure` — bytes one GPU would need to train each published model alone
  (the planner, :mod:`edu3d.plan.estimate`: bf16 weights and gradients, fp32 Adam state,
  activations of one sequence), against one GPU's memory (log scale);
* :func:`comparison_figure` — each strategy measured on edu3d and on ``--impl torch``: the
  bytes a rank holds, the median step time, the bytes edu3d's collectives moved per step
  with the formula beside it, and the lines of edu3d's code that implement it;
* :func:`accelerate_figure` — what ``accelerator.prepare`` returned and which collectives
  ran, from the run's own record;
* :func:`fsdp_figure` — FSDP's four sharding strategies: what a rank holds at rest, in
  forward, in backward and at the optimizer step (formula, this model's units);
* :func:`offload_figure` — edu3d's ``--offload`` run: where the optimizer state lives, the
  bytes that cross to the host and back each step, and the step time;
* :func:`mapping_table` — one strategy's edu3d code, PyTorch API and knobs as a table.

The chapter's strategy dropdown is :mod:`edu3d.widgets.panels.ch09_in_production`.
"""

from __future__ import annotations

import math
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

import edu3d.parallel as par
from edu3d.model import shapes
from edu3d.plan import estimate as plan_memory
from edu3d.widgets import style

CATS = {"params": style.BLUE, "grads": style.ORANGE, "optimizer": style.GREEN,
        "activations": style.PURPLE}
IMPL_COLORS = {"edu3d": style.BLUE, "torch": style.VERMILLION}
KIB = 1024


# ---- the need for distributed training ---------------------------------------------------------
def need_figure(device_gb: float = 80.0):
    """Stacked bytes per published model (planner, one sequence, bf16 + fp32 Adam) against
    one device's memory."""
    names = list(shapes.REAL)
    est = [plan_memory.estimate(shapes.spec_from(n), plan_memory.setup(precision="bf16"),
                                at="rest") for n in names]
    total = [e["total_bytes"] / 1e9 for e in est]
    parts = ["<br>".join(f"{c}: {e[f'{c}_bytes'] / 1e9:.1f} GB" for c in CATS) for e in est]
    fig = go.Figure()
    fig.add_bar(x=names, y=total, name="weights + grads + Adam + activations",
                marker_color=[style.BLUE if t <= device_gb else style.VERMILLION for t in total],
                text=[f"{math.ceil(t / device_gb)} GPU" + ("s" if t > device_gb else "")
                      for t in total], textposition="outside", customdata=parts,
                hovertemplate="%{x}: %{y:.1f} GB<br>%{customdata}<extra></extra>")
    fig.add_hline(y=device_gb, line={"color": style.BLACK, "dash": "dash"},
                  annotation_text=f"one GPU: {device_gb:g} GB", annotation_position="top left")
    first = next((n for n, e in zip(names, est) if e["total_bytes"] / 1e9 > device_gb), None)
    style.frame(fig, "Training memory of one replica, by model (planner)",
                f"From {first} on (red), one GPU cannot hold it alone; the label is the GPUs "
                "its bytes fill: they must be sharded (ZeRO/FSDP, TP, PP)." if first else
                "Every model fits one GPU.",
                y="memory (GB, log scale)", height=420)
    fig.update_yaxes(type="log", range=[0, math.log10(max(total)) + 0.5])
    return fig


# ---- strategies side by side --------------------------------------------------------------------
def _edu3d_lines(name: str) -> int:
    """Lines of edu3d's modules that implement a strategy (their source, counted)."""
    root = Path(par.__file__).parent
    folders = {"DP": ["dp"], "ZeRO-1": ["zero"], "ZeRO-2": ["zero"], "ZeRO-3": ["zero"],
               "TP/SP": ["tp"], "PP": ["pp", "../schedules"]}[name]
    return sum(len(f.read_text().splitlines()) for d in folders for f in (root / d).glob("*.py"))


def traffic_formula(name: str, psi: int, n: int) -> float | None:
    """Bytes per rank per step the formula predicts for data-parallel strategies (fp32):
    ring all-reduce ``2(N-1)/N · 4Ψ``; ZeRO-3 adds an all-gather: ``3(N-1)/N · 4Ψ``."""
    k = {"DP": 2, "ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 3}.get(name)
    return None if k is None else k * (n - 1) / n * 4 * psi


def comparison_figure(results: dict, highlight: str | None = None, psi: int | None = None,
                      names: list[str] | None = None):
    """Measured per strategy: bytes held by the fullest rank (edu3d / torch), median step
    time, edu3d's bytes on the wire per step (formula as a ghost) and edu3d's lines.
    ``names``: the strategies to show, in order (default: those of ``results``)."""
    names = list(names or results)
    fig = make_subplots(rows=1, cols=4, horizontal_spacing=0.07, subplot_titles=(
        "held per rank (KiB)", "median step (ms)", "edu3d on the wire / step (KiB)",
        "edu3d lines of code"))
    for impl, off in (("edu3d", -0.2), ("torch", 0.2)):
        for cat in ("params", "grads", "optimizer"):
            fig.add_bar(x=names, y=[results[n][f"{impl}_mem"][cat] / KIB if n in results else 0
                                    for n in names],
                        name=cat, legendgroup=cat, showlegend=impl == "edu3d",
                        marker={"color": CATS[cat], "opacity": 1.0 if impl == "edu3d" else 0.55,
                                "line": {"color": IMPL_COLORS[impl], "width": 2}},
                        offsetgroup=impl, hovertemplate=f"{impl} {cat}: " + "%{y:.0f} KiB"
                        "<extra>%{x}</extra>", row=1, col=1)
        fig.add_bar(x=names, y=[results[n][f"{impl}_step_s"] * 1e3 if n in results else 0
                                for n in names], name=f"{impl} step time", offsetgroup=impl,
                    marker_color=IMPL_COLORS[impl], row=1, col=2)
    fig.update_layout(barmode="relative")
    if psi:
        ghost = [traffic_formula(n, psi, 2) for n in names]
        fig.add_bar(x=names, y=[g / KIB if g else None for g in ghost], name="formula", offsetgroup="formula",
                    marker_color=style.YELLOW, opacity=style.GHOST_OPACITY,
                    marker_line={"color": style.OLIVE, "width": 1}, row=1, col=3)
    fig.add_bar(x=names, y=[results[n]["edu3d_wire_bytes"] / KIB if n in results else 0
                            for n in names], name="measured (edu3d)", marker_color=style.OLIVE, offsetgroup="measured",
                row=1, col=3)
    fig.add_bar(x=names, y=[_edu3d_lines(n) for n in names], name="edu3d lines",
                marker_color=style.GREY, row=1, col=4, showlegend=False)
    if highlight in names:
        for col in range(1, 5):
            fig.add_vrect(x0=names.index(highlight) - 0.5, x1=names.index(highlight) + 0.5,
                          fillcolor=style.rgba(style.SKY, 0.15), line_width=0, row=1, col=col)
    worst = max((results[n]["worst_rel"] for n in names if n in results), default=None)
    style.frame(fig, "edu3d beside PyTorch's APIs, per strategy"
                + (f" — {highlight}" if highlight else ""),
                "Same losses" + (f" (worst relative difference {worst:.0e})" if worst is not None
                                 else "") + "; held bytes as ZeRO's formulas say (edu3d "
                "left, torch right);<br>ZeRO-3 moves 3Ψ per step, DP to ZeRO-2 2Ψ, PP only "
                "activations.",
                height=500)
    # three title lines, then the subplot titles above the plots: room for both
    fig.update_layout(legend={"orientation": "h", "y": -0.3, "x": 0}, margin={"t": 150})
    fig.update_xaxes(tickangle=-30)
    return fig


def loss_figure(row: dict):
    """One strategy's losses per step, edu3d and torch (the same curve)."""
    fig = go.Figure()
    for impl, dash in (("edu3d", "solid"), ("torch", "dot")):
        ys = row[f"{impl}_losses"]
        fig.add_scatter(x=list(range(1, len(ys) + 1)), y=ys, name=f"{impl}",
                        mode="lines+markers", line={"color": IMPL_COLORS[impl], "dash": dash})
    style.frame(fig, f"{row['name']}: loss per step, edu3d and --impl torch",
                f"worst relative difference {row['worst_rel']:.1e} (float rounding)",
                x="step", y="loss (nats)", height=300)
    fig.update_xaxes(dtick=1)  # steps are whole numbers
    return fig


# ---- Accelerate ---------------------------------------------------------------------------------
def accelerate_figure(result: dict):
    """prepare()'s wrapping (left) and the collectives each step ran (right), from the run."""
    w = result["wrapped"]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55], horizontal_spacing=0.1,
                        subplot_titles=("accelerator.prepare(model, optimizer)",
                                        "collectives per step (rank 0's DDP hook)"))
    boxes = [(0, 2, w["model_before"], style.BLUE), (1, 2, w["model"], style.BLUE),
             (0, 1, w["optimizer_before"], style.GREEN),
             (1, 1, f"{w['optimizer']}<br>({w['inner_optimizer']})", style.GREEN)]
    for x, y, text, color in boxes:
        x0 = 0 if x == 0 else 1.6
        fig.add_shape(type="rect", x0=x0, x1=x0 + (1.0 if x == 0 else 2.2), y0=y - 0.3,
                      y1=y + 0.3, line={"color": color, "width": 2},
                      fillcolor=style.rgba(color, 0.12), row=1, col=1)
        fig.add_annotation(x=x0 + (0.5 if x == 0 else 1.1), y=y, text=text, showarrow=False,
                           font={"size": 12}, row=1, col=1)
    for y in (1, 2):
        fig.add_annotation(x=1.6, y=y, ax=1.0, ay=y, xref="x", yref="y", axref="x", ayref="y",
                           showarrow=True, arrowhead=2, text="", row=1, col=1)
    fig.add_annotation(x=1.9, y=0.3, showarrow=False, row=1, col=1,
                       text=f"{w['distributed_type'].split('.')[-1]}, {w['backend']}, "
                            f"{w['world_size']} ranks; bucket_cap_mb {w.get('bucket_cap_mb', 0):g}")
    fig.update_xaxes(visible=False, range=[-0.1, 3.9], row=1, col=1)
    fig.update_yaxes(visible=False, range=[0, 2.6], row=1, col=1)
    calls = result["collectives"]
    buckets = sorted({c["bucket"] for c in calls})
    for b in buckets:
        sel = [c for c in calls if c["bucket"] == b]
        fig.add_bar(x=[c["step"] for c in sel], y=[c["bytes"] / KIB for c in sel],
                    name=f"all_reduce bucket {b}", marker_color=style.op_color("all_reduce"),
                    marker_line={"color": style.OLIVE, "width": 1},
                    customdata=[c["params"] for c in sel],
                    hovertemplate="step %{x}: %{y:.0f} KiB, %{customdata} parameters"
                                  "<extra></extra>", row=1, col=2)
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="step", dtick=1, row=1, col=2)
    fig.update_yaxes(title_text="bytes all-reduced (KiB)", row=1, col=2)
    n = len({c['bucket'] for c in calls})
    style.frame(fig, "What Accelerate did with edu3d's GPT",
                f"prepare() wrapped the model in DDP and the optimizer in a proxy; each backward "
                f"all-reduced {style.plural(n, 'bucket')} of the gradients, nothing else.",
                height=380)
    return fig


# ---- FSDP's sharding strategies -----------------------------------------------------------------
PHASES = ("at rest", "forward", "backward", "optimizer step")

#: the FSDP1 sharding strategies and their FSDP2 / ZeRO / edu3d names
FSDP_STRATEGIES = {
    "FULL_SHARD": ("fully_shard(reshard_after_forward=True)", "ZeRO-3", "--zero 3"),
    "SHARD_GRAD_OP": ("fully_shard(reshard_after_forward=False)", "ZeRO-2", "--zero 2"),
    "NO_SHARD": ("replicate(module) / DDP", "DP (ZeRO-0)", "--dp N"),
    "HYBRID_SHARD": ("fully_shard(mesh=2-D (replicate, shard))", "ZeRO-3 inside a node, DP "
                     "across nodes (ZeRO++ hpZ)", "(no edu3d flag: --zero 3 over one dp group)"),
}


def fsdp_held(strategy: str, psi: int, unit: int, n: int, node: int = 2) -> dict:
    """Bytes one rank holds in each phase (fp32 AdamW: 4 + 4 + 8 bytes per parameter), with
    FSDP units of ``unit`` parameters: ``gathered`` are parameters all-gathered for compute.
    HYBRID_SHARD shards within groups of ``node`` ranks and replicates across them."""
    shard = {"FULL_SHARD": n, "SHARD_GRAD_OP": n, "NO_SHARD": 1, "HYBRID_SHARD": node}[strategy]
    p, g, o = 4 * psi / shard, 4 * psi / shard, 8 * psi / shard
    if strategy == "SHARD_GRAD_OP":  # parameters stay gathered from forward to backward
        fwd, bwd = 4 * psi - p, 4 * psi - p
    elif strategy == "NO_SHARD":
        fwd = bwd = 0.0
    else:  # one unit gathered at a time (two with prefetch)
        fwd, bwd = 4 * unit, 4 * unit
    grad_unit = 0.0 if strategy == "NO_SHARD" else 4 * unit  # a unit's full gradient before
    return {                                                 # its reduce-scatter
        "at rest": {"params": p, "gathered": 0.0, "grads": 0.0, "optimizer": o},
        "forward": {"params": p, "gathered": fwd, "grads": 0.0, "optimizer": o},
        "backward": {"params": p, "gathered": bwd, "grads": g + grad_unit, "optimizer": o},
        "optimizer step": {"params": p, "gathered": 0.0, "grads": g, "optimizer": o},
    }


def fsdp_figure(psi: int, unit: int, n: int = 4, node: int = 2, highlight: str | None = None):
    """The four FSDP1 strategies side by side: stacked bytes per phase."""
    names = list(FSDP_STRATEGIES)
    fig = make_subplots(rows=1, cols=4, shared_yaxes=True, horizontal_spacing=0.03,
                        subplot_titles=[f"<b>{s}</b>" if s == highlight else s for s in names])
    colors = {**CATS, "gathered": style.SKY}
    for col, s in enumerate(names, 1):
        held = fsdp_held(s, psi, unit, n, node)
        for cat in ("params", "gathered", "grads", "optimizer"):
            fig.add_bar(x=list(PHASES), y=[held[ph][cat] / KIB for ph in PHASES],
                        name={"gathered": "params gathered (all-gather)"}.get(cat, cat),
                        legendgroup=cat, showlegend=col == 1, marker_color=colors[cat],
                        hovertemplate=f"{s} {cat}: " + "%{y:.0f} KiB<extra>%{x}</extra>",
                        row=1, col=col)
        fsdp2, zero, _ = FSDP_STRATEGIES[s]
        fig.add_annotation(text=f"{fsdp2}<br>= {zero}", showarrow=False, xref=f"x{col if col > 1 else ''} domain",
                           yref="paper", x=0.5, y=-0.32, font={"size": 10})
    fig.update_layout(barmode="stack", margin={"b": 130})
    style.frame(fig, f"FSDP's sharding strategies: what one of {n} ranks holds, phase by phase",
                f"Ψ = {psi:,} parameters, units of {unit:,}; HYBRID_SHARD shards within groups "
                f"of {node} and replicates across them.", height=460)
    fig.update_yaxes(title_text="bytes held (KiB)", row=1, col=1)
    fig.update_layout(margin={"b": 130})
    return fig


# ---- offload ------------------------------------------------------------------------------------
def offload_figure(result: dict):
    """edu3d ZeRO-1 without and with ``--offload``: device and host bytes, the bytes moved
    per step and the step times (measured)."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.12,
                        subplot_titles=("where the state lives (rank 0, KiB)", "median step (ms)"))
    runs = ("device", "offload")
    labels = ["ZeRO-1", "ZeRO-1 --offload"]
    for cat in ("params", "grads", "optimizer"):
        fig.add_bar(x=labels, y=[result[r]["mem"][cat] / KIB for r in runs], name=f"device {cat}",
                    marker_color=CATS[cat], row=1, col=1)
    fig.add_bar(x=labels, y=[result[r]["host_bytes"] / KIB for r in runs],
                name="host (optimizer state + master copy)",
                marker={"color": style.GREY, "pattern": {"shape": "x"}}, row=1, col=1)
    fig.add_bar(x=labels, y=[result[r]["step_s"] * 1e3 for r in runs], name="step time",
                marker_color=style.VERMILLION, showlegend=False, row=1, col=2)
    moved = result["offload"]["moved_bytes"]
    fig.add_annotation(x=labels[1], y=result["offload"]["step_s"] * 1e3, yshift=14,
                       text=f"{moved / KIB:.0f} KiB crossed per step", showarrow=False,
                       row=1, col=2)
    fig.update_layout(barmode="stack")
    same = result["device"]["losses"] == result["offload"]["losses"]
    style.frame(fig, "Offload: the optimizer's work moves to host memory",
                f"each step: the gradient shard to the host ({moved / 2 / KIB:.0f} KiB), the "
                f"updated shard back ({moved / 2 / KIB:.0f} KiB); losses "
                + ("identical" if same else "differ") + ". On a CPU both sides are RAM.",
                height=380)
    return fig


# ---- the mapping table --------------------------------------------------------------------------
def mapping_table(name: str, rows: list[tuple[str, str, str]], argv: str):
    """One strategy's edu3d code, PyTorch API and the other libraries' knobs: ``rows`` from
    :func:`edu3d.course.ch09_in_production.strategy_rows`, ``argv`` its ``edu3d train``
    options."""
    # a table cell does not grow with its text: give each row the lines its longest cell
    # wraps into at a notebook's width (about 30, 40, 40 characters per column)
    lines = [max(math.ceil(len(text) / width) for text, width in zip(row, (30, 40, 40)))
             for row in rows]
    fig = go.Figure(go.Table(
        columnwidth=[3, 4, 4],
        header={"values": ["<b>edu3d</b>", "<b>PyTorch</b>", "<b>Accelerate / DeepSpeed / "
                           "FSDP1 / Megatron</b>"], "align": "left",
                "fill_color": style.rgba(style.BLUE, 0.15)},
        cells={"values": [list(c) for c in zip(*rows)], "align": "left",
               "height": 20 * max(lines) + 8}))
    style.html_export_renderer()  # frame() labels legends, which a table has not
    fig.update_layout(title={"text": style.title_text(
        f"{name}: edu3d ↔ PyTorch ↔ the libraries",
        f"the same layout runs as `edu3d train {argv}` and with "
        "`--impl torch`"), "x": 0.0, "xanchor": "left"}, font=style.FONT,
        margin={"l": 20, "r": 20, "t": 90, "b": 10},
        height=150 + (20 * max(lines) + 10) * len(rows))
    return fig
