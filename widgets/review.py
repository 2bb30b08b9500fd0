"""Chapter 11's pictures: the picture behind each review question.

After reading this file you should know what each review picture shows and where its
numbers come from (all of them computed by edu3d at once, no run needed):

* :func:`ring_figure` — bytes one rank sends per byte all-reduced, against N (edu3d's ring
  plan);
* :func:`zero_figure` — the model state per GPU under ZeRO stages 0-3 over N ranks
  (``16Ψ`` ...);
* :func:`zero_traffic_figure` — what one rank sends per step under each ZeRO stage (the
  planner's count);
* :func:`activations_figure` — one layer's activations against the TP degree: TP, TP+SP,
  TP+SP with selective recomputation (Korthikanti et al.);
* :func:`tp_figure` — the planner's step time by part for the fastest layout at each TP
  degree: TP's all-reduces explode once the group leaves the node;
* :func:`in_flight_figure` — micro-batches each pipeline rank keeps alive (replayed
  schedules);
* :func:`layout_figure` — the planner's fastest fitting layouts for a model and a cluster;
* :func:`zero_measured_figure` — a run's state per ZeRO stage beside the planner's count;
* :func:`recipe_figure` — the planner's decisions as a flowchart, one band per step of the
  recipe (fit a replica, scale to the batch, optimise throughput), from
  :func:`edu3d.course.ch11_review_recipe.decisions` (read from the planner's code).

The bubble against the micro-batches is chapter 05's chart
(:func:`edu3d.widgets.pipeline.bubble_figure`), DDP's step chapter 02's
(:func:`edu3d.widgets.overlap.bucket_timeline_figure`); the quiz panel that puts every picture behind
one set of knobs is :mod:`edu3d.widgets.panels.ch11_review`.
"""

from __future__ import annotations

import plotly.graph_objects as go

from edu3d.distributed.algorithms import ring_plan
from edu3d.model.shapes import spec_from
from edu3d.plan.estimate import in_flight
from edu3d.plan.formulas import activation_bytes_per_layer as act
from edu3d.widgets import style
from edu3d.widgets.memory_plan import zero_stages

PART_COLORS = {"compute": style.BLUE, "bubble": style.GREY, "tp": style.YELLOW,
               "pp": style.SEND, "dp": "#882255"}


# ---- the pictures ------------------------------------------------------------------------------
def ring_figure(n: int = 8):
    """Bytes a rank sends per byte of the buffer, from edu3d's ring plan, N = 2..16."""
    ns = list(range(2, 17))
    fig = go.Figure()
    for phases, name, color in ((("reduce_scatter", "all_gather"), "all-reduce", style.BLUE),
                                (("reduce_scatter",), "reduce-scatter (or all-gather)",
                                 style.ORANGE)):
        y = [sum(t.src == 0 for t in ring_plan(k, phases)) / k for k in ns]
        fig.add_scatter(x=ns, y=y, name=name, mode="lines+markers", line={"color": color})
    sent = sum(t.src == 0 for t in ring_plan(n)) / n
    fig.add_scatter(x=[n], y=[sent], name=f"N = {n}: {sent:.3g}·S", mode="markers",
                    marker={"size": 14, "symbol": "star", "color": style.VERMILLION})
    return style.frame(fig, f"Ring all-reduce over N = {n}: each rank sends {sent:.3g}·S",
                       "2(N-1)/N·S per rank: the traffic hardly grows with N, the steps do.",
                       x="ranks N", y="bytes sent per rank (× buffer size S)")


def zero_figure(model: str = "llama2-7b", n: int = 8, gpu_mem_gb: float = 80):
    psi = spec_from(model).num_params()
    return zero_stages(psi, n, gpu_mem_gb=gpu_mem_gb,
                       title=f"{model} ({psi / 1e9:.2f} B parameters) over dp = {n}: "
                             f"state per GPU; one GPU holds {gpu_mem_gb:g} GB")


def zero_traffic_figure(gb: dict[int, float], model: str = "llama2-7b", n: int = 8):
    """GB one rank sends per step over the data-parallel group, per ZeRO stage (``gb``:
    :func:`edu3d.course.ch11_review.zero_traffic_gb`, the planner's count)."""
    x = ["no ZeRO" if z == 0 else f"ZeRO-{z}" for z in gb]
    fig = go.Figure()
    fig.add_bar(x=x, y=list(gb.values()), marker_color=style.YELLOW, name="sent per rank",
                text=[f"{v:.1f} GB" for v in gb.values()], textposition="outside",
                hovertemplate="%{x}: %{y:.2f} GB per step<extra></extra>")
    base = gb[0]
    said = (f"ZeRO-3 moves {gb[3] / base:.2f}x plain DP's bytes: it gathers the weights again "
            "for the backward" if base else "one rank alone: nothing to send")
    fig.update_yaxes(range=[0, max(list(gb.values()) + [1e-9]) * 1.25])
    return style.frame(fig, f"{model} over dp = {n}: data-parallel traffic per rank and step, "
                            "by ZeRO stage", said, x="ZeRO stage",
                       y="sent per rank and step (GB, 16-bit)")


def activations_figure(model: str = "gpt3-175b"):
    sp = spec_from(model)
    kw = dict(d_ff=sp.ff, kv_heads=sp.kv_heads, mlp=sp.mlp)
    s, h, a = sp.seq_len, sp.d_model, sp.n_heads
    ts = [t for t in (1, 2, 4, 8, 16) if a % t == 0]
    fig = go.Figure()
    for name, extra, color in (("TP", {}, style.ORANGE), ("TP + SP", {"sp": True}, style.BLUE),
                               ("TP + SP + selective recompute",
                                {"sp": True, "recompute": "selective"}, style.GREEN)):
        fig.add_scatter(x=ts, y=[act(s, 1, h, a, t=t, **extra, **kw) / 1e6 for t in ts],
                        name=name, mode="lines+markers", line={"color": color})
    serial = act(s, 1, h, a, **kw) / 1e6
    fig.add_hline(y=serial, line={"dash": "dash", "color": style.BLACK},
                  annotation_text=f"serial: {serial:,.0f} MB", annotation_position="top right")
    fig.update_xaxes(type="log", tickvals=ts)
    fig.update_yaxes(type="log")
    return style.frame(fig, f"{model}: one layer's activations (s = {s}, b = 1, 16-bit)",
                       "TP alone leaves 10sbh whole on every rank; SP splits them too; "
                       "selective recomputation drops the 5as/h attention term.",
                       x="tensor-parallel degree", y="activations per layer and sequence (MB)")


def _parts_bars(fig, rows, labels) -> None:
    for part, color in PART_COLORS.items():
        fig.add_bar(x=labels, y=[r["time"][part] for r in rows], name=part,
                    marker_color=color, hovertemplate=f"{part}: " + "%{y:.2f} s<extra></extra>")
    fig.update_layout(barmode="stack")


def _label(st) -> str:
    return (f"dp{st.layout.dp}·tp{st.layout.tp}·pp{st.layout.pp}" + (f" Z{st.parallel.zero}" if st.parallel.zero else "")
            + ("" if st.memory.recompute == "none" else f" {st.memory.recompute[:3]}") + f" b{st.micro_batch}")


def tp_figure(rows, model: str = "llama2-7b", gpus: int = 16, all_reduces: int = 4):
    """The fastest layout (that fits, if any does) at each TP degree, step time by part, from
    the planner's ranking ``rows`` (:func:`edu3d.course.ch11_review.plan`); ``all_reduces``
    per layer and micro-batch (:func:`edu3d.course.ch11_review.tp_all_reduces`)."""
    best = {}
    for r in rows:  # sorted: fitting first, fastest first
        best.setdefault(r["setup"].layout.tp, r)
    tps = sorted(best)
    fig = go.Figure()
    _parts_bars(fig, [best[t] for t in tps], [f"tp={t}" + ("" if best[t]["fits"] else
                                                            " (no fit)") for t in tps])
    return style.frame(fig, f"{model} on {gpus} GPUs: the fastest layout at each TP degree",
                       f"TP's {all_reduces} all-reduces per layer ride NVLink inside a node "
                       "of 8; beyond "
                       "it they cross InfiniBand and dominate the step.",
                       x="tensor-parallel degree (best layout for it)", y="step time (s)")


def in_flight_figure(pp: int = 4, m: int = 8, schedules=("gpipe", "1f1b")):
    """Micro-batches each pipeline rank keeps alive at its peak, one bar group per schedule
    of ``schedules`` (interleaved with 2 chunks per rank)."""
    fig = go.Figure()
    for i, name in enumerate(schedules):
        v = 2 if name == "interleaved" else 1
        fig.add_bar(x=[f"pp rank {r}" for r in range(pp)], y=list(in_flight(name, pp, m, v)),
                    name=name, marker_color=style.GROUP_COLORS[i])
    return style.frame(fig, f"Micro-batches kept alive per pipeline rank: p = {pp}, m = {m}",
                       "GPipe keeps all m; 1F1B at most p on the first rank, one less per "
                       "rank down the pipe.", x="pipeline rank",
                       y="activations held at the peak (micro-batches)")


def layout_figure(rows, model: str = "llama2-13b", gpus: int = 16, top: int = 8):
    """The planner's ``top`` fastest fitting layouts from its ranking ``rows``
    (:func:`edu3d.course.ch11_review.plan`): every layout computes the same tokens, so the
    bars show what each pays *beyond* the compute they all share (the bubble, each axis's
    communication, recomputation's extra forward); the shared compute is in the title."""
    rows = [r for r in rows if r["fits"]][:top]
    fig = go.Figure()
    if not rows:
        return style.frame(fig, f"{model} on {gpus} GPUs: no layout fits",
                           "add GPUs, or memory per GPU")
    base = min(r["time"]["compute"] for r in rows)
    labels = [_label(r["setup"]) for r in rows]
    extra = {"recompute": [r["time"]["compute"] - base for r in rows],
             **{k: [r["time"][k] for r in rows] for k in PART_COLORS if k != "compute"}}
    colors = {"recompute": style.PURPLE, **PART_COLORS}
    for part, ys in extra.items():
        if any(ys):
            fig.add_bar(y=labels, x=ys, name=part, orientation="h", marker_color=colors[part],
                        hovertemplate=f"{part}: " + "%{x:.2f} s<extra>%{y}</extra>")
    fig.update_layout(barmode="stack")
    fig.update_yaxes(autorange="reversed")
    gap = rows[1]["time"]["total"] - rows[0]["time"]["total"] if len(rows) > 1 else 0.0
    return style.frame(
        fig, f"{model} on {gpus} GPUs of 80 GB: the planner's fastest layouts, beyond the "
             f"{base:.1f} s of compute they share",
        f"first: {labels[0]}, {rows[0]['time']['total']:.2f} s per step"
        + (f"; the runner-up pays {gap:.2f} s more" if len(rows) > 1 else ""),
        x="seconds per step beyond the shared compute (Z = ZeRO stage, sel = selective "
          "recompute, b = micro-batch)",
        height=140 + 34 * len(rows)).update_layout(margin={"l": 150})


def zero_measured_figure(rows: list[dict]):
    """Rank 0's state measured per ZeRO stage beside the planner's count (KiB)."""
    x = [f"ZeRO-{r['zero']}" for r in rows]
    fig = go.Figure()
    fig.add_bar(x=x, y=[r["estimate"] / 1024 for r in rows], name="estimate",
                marker={"color": style.GREEN, "opacity": style.GHOST_OPACITY})
    fig.add_bar(x=x, y=[r["measured"] / 1024 for r in rows], name="measured",
                marker_color=style.GREEN)
    return style.frame(fig, f"edu3d's tiny GPT over dp = {rows[0]['dp']}: rank 0's state, "
                            "measured", "weights + gradients + Adam state shrink stage by "
                       "stage, as the formula says.", x="ZeRO stage", y="state on rank 0 (KiB)")


RECIPE_COLORS = (style.BLUE, style.GREEN, style.VERMILLION)
KIND_WORDS = {"choose": "try every", "set": "derive", "yield": "a candidate:",
              "fit": "keep if it fits:", "rank": "rank:"}


def recipe_figure(decisions: list[dict], steps: tuple, note: str = ""):
    """The planner's ``decisions`` top to bottom in its own order: what it tries (a loop),
    derives and tests in the middle column, the guards that skip a candidate to the right;
    each box coloured by its step of ``steps`` and naming its chapter."""
    fig = go.Figure()
    y, rows = 0, []
    for d in decisions:
        if d["kind"] == "skip":
            rows[-1]["skips"].append(d)
        else:
            rows.append({**d, "y": y, "skips": []})
            y -= 1
    for r in rows:
        color = RECIPE_COLORS[r["step"]]
        fig.add_shape(type="rect", x0=0, x1=7.2, y0=r["y"] - 0.38, y1=r["y"] + 0.38,
                      line={"color": color, "width": 2}, fillcolor=style.rgba(color, 0.12))
        code = r["code"] if len(r["code"]) <= 58 else r["code"][:55] + "..."
        fig.add_annotation(x=0.1, y=r["y"], xanchor="left", showarrow=False,
                           text=f"{KIND_WORDS[r['kind']]} <b>{code}</b>  · ch {r['chapter']}",
                           font={"size": 11, "family": "monospace"})
        for k, sk in enumerate(r["skips"]):
            text = sk["code"] if len(sk["code"]) <= 44 else sk["code"][:41] + "..."
            fig.add_shape(type="rect", x0=7.6 + 5 * k, x1=12.4 + 5 * k, y0=r["y"] - 0.3,
                          y1=r["y"] + 0.3, line={"color": style.GREY, "dash": "dot"})
            fig.add_annotation(x=10 + 5 * k, y=r["y"], showarrow=False,
                               text=f"skip if {text}", font={"size": 10, "family": "monospace"})
            fig.add_annotation(x=7.6 + 5 * k, y=r["y"], ax=7.2, ay=r["y"], xref="x",
                               yref="y", axref="x", ayref="y", text="", arrowhead=2)
    for a, b in zip(rows, rows[1:]):
        fig.add_annotation(x=1.0, y=b["y"] + 0.38, ax=1.0, ay=a["y"] - 0.38, xref="x",
                           yref="y", axref="x", ayref="y", text="", arrowhead=2)
    for i, name in enumerate(steps):
        fig.add_scatter(x=[None], y=[None], mode="markers", name=name,
                        marker={"symbol": "square", "size": 12, "color": RECIPE_COLORS[i]})
    fig.update_xaxes(visible=False, range=[-0.1, 12.6])
    fig.update_yaxes(visible=False, range=[y + 0.4, 0.6])
    return style.frame(fig, "edu3d plan's recipe, read from its own code (edu3d/plan/search.py)",
                       note or "each loop tries every option; guards skip a candidate; the "
                       "survivors that fit are ranked by the cost model's step time",
                       height=110 + 42 * len(rows), legend=True).update_layout(
        legend={"orientation": "h", "y": 0, "x": 0, "yanchor": "top"})
