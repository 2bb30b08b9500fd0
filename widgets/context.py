"""Chapter 13's charts: context parallelism's work, exchanges, merge and memory.

After reading this file you should know how to read each picture:

* :func:`score_blocks_figure`: left, the causal score matrix (query x key) coloured by the
  rank whose queries compute each entry (white: hidden by the mask); right, the work per
  rank: the causal entries (:func:`edu3d.parallel.cp.work`) as a ghost, what the ring's
  block rule computes (theory) and, after a run, what its counter measured;
* :func:`ring_steps_figure`: one lane per rank, x = time, a bar per send of the ring from a
  live trace, each kind on its own row of the lane (so a short send never hides another):
  K, V blocks (dark yellow), their positions (sand), the dK, dV sums of backward (orange, a
  gradient), labelled with the ring step;
* :func:`ring_work_figure`: the causal work of each rank at each ring step, plain split
  beside zigzag: each step waits for its busiest rank;
* :func:`overlap_figure`: measured, one ring step's attention against moving one K, V block,
  per sequence length: the ring hides the transfer where the attention line is above;
* :func:`merge_figure`: one query's two partial outputs, their merge, full attention (ghost)
  and the wrong merge (the plain average), element by element;
* :func:`exchange_figure`: bytes one rank sends per attention layer for ring, all-gather and
  Ulysses, forward and backward, measured beside the formula (ghost);
* :func:`activation_figure`: bytes one layer keeps for backward against sequence length, per
  cp degree, measured (markers) over the formula (lines);
* :func:`scale_figure`: the same law at Llama 3 8B's size and 128k tokens, against a GPU.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from edu3d.widgets import style

KIND_COLORS = {"K,V": style.SEND, "positions": style.SAND, "dK,dV": style.ORANGE}


def _rank_scale(cp: int) -> list:
    """A discrete colour scale: -1 white, rank r its group colour."""
    stops, n = [], cp + 1
    colors = ["#FFFFFF"] + [style.group_color(r) for r in range(cp)]
    for i, c in enumerate(colors):
        stops += [[i / n, c], [(i + 1) / n, c]]
    return stops


def score_blocks_figure(owner: list[list[int]], cp: int, split: str, causal: list[int],
                        predicted: list[int], measured: list[int] | None = None):
    """The owner map and the work per rank (see the module docstring)."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45], horizontal_spacing=0.12,
                        subplot_titles=("who computes each score entry",
                                        "score entries per rank"))
    s = len(owner)
    fig.add_trace(go.Heatmap(z=owner, zmin=-1.5, zmax=cp - 0.5, colorscale=_rank_scale(cp),
                             showscale=False, name="owner", xgap=0.5, ygap=0.5,
                             hovertemplate="query %{y}, key %{x}: rank %{z}<extra></extra>"),
                  1, 1)
    ranks = [f"rank {r}" for r in range(cp)]
    fig.add_bar(x=ranks, y=causal, name="causal entries (formula)", row=1, col=2,
                marker=style.estimate_marker(style.BLUE), width=0.8)
    fig.add_bar(x=ranks, y=predicted, name="ring computes (theory)", row=1, col=2,
                marker=style.estimate_marker(style.SKY), width=0.5)
    if measured is not None:
        fig.add_bar(x=ranks, y=measured, name="ring computed (measured)", row=1, col=2,
                    marker={"color": style.BLUE}, width=0.25)
    style.frame(fig, f"Causal attention over cp={cp} ranks, {split} split, s={s}",
                blocks_takeaway(causal, predicted, measured), height=420)
    fig.update_layout(barmode="overlay")
    fig.update_xaxes(title_text="key position (token)", row=1, col=1)
    fig.update_yaxes(title_text="query position (token)", autorange="reversed", row=1, col=1)
    fig.update_yaxes(title_text="score entries (count)", row=1, col=2)
    return fig


def blocks_takeaway(causal: list[int], predicted: list[int],
                    measured: list[int] | None = None) -> str:
    """The busiest rank over the mean, for the causal entries and for what the ring computes
    (measured when given, else its block rule): the numbers the bars draw."""
    def ratio(xs):
        return max(xs) / (sum(xs) / len(xs))
    ring = measured if measured is not None else predicted
    worst = ratio(causal)
    return (f"busiest rank / mean: {worst:.2f}x the causal entries, {ratio(ring):.2f}x what the "
            f"ring computes ({'measured' if measured is not None else 'block rule'})"
            + ("; balanced" if worst < 1.001 else "; the others wait for it"))


def ring_steps_figure(rows: list[dict], cp: int):
    """The ring's sends from a live trace (:func:`edu3d.course.ch13_context_parallelism_ring.
    ring_steps` rows), one lane per rank, one row of it per kind of send."""
    fig = go.Figure()
    origin = min((r["t0"] for r in rows), default=0.0)
    for kind, color in KIND_COLORS.items():
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        fig.add_bar(y=[f"rank {r['rank']}" for r in sel],
                    x=[(r["t1"] - r["t0"]) / 1e3 for r in sel],
                    base=[(r["t0"] - origin) / 1e3 for r in sel], orientation="h",
                    name=f"send {kind}", offsetgroup=kind,
                    marker={"color": color, "line": {"width": 0.5}},
                    text=[f"{r['phase'][0].upper()}{r['ring_step']}" for r in sel],
                    textposition="inside",
                    customdata=[[r["phase"], r["ring_step"], r["peer"], r["bytes"]]
                                for r in sel],
                    hovertemplate="%{customdata[0]} step %{customdata[1]}: to rank "
                                  "%{customdata[2]}, %{customdata[3]} B<extra></extra>")
    fwd = sum(1 for r in rows if r["phase"] == "forward" and r["kind"] == "K,V")
    bwd = sum(1 for r in rows if r["phase"] == "backward" and r["kind"] == "dK,dV")
    style.frame(fig, f"Ring attention on cp={cp} ranks: every send of one forward and "
                     "backward (live trace)",
                f"per rank: {fwd / max(cp, 1):g} K,V sends forward (cp-1 = {cp - 1}); "
                f"backward K,V again and {bwd / max(cp, 1):g} dK,dV sends, the last one home",
                x="time since the first send (ms)", y="rank", height=160 + 70 * cp)
    fig.update_layout(barmode="group", bargap=0.25, bargroupgap=0.05,
                      uniformtext={"minsize": 8, "mode": "hide"})  # no label too small to read
    fig.update_yaxes(categoryorder="category descending")
    return fig


def ring_work_figure(plain: list[list[int]], zigzag: list[list[int]], summary: dict):
    """``[ring step][rank]`` causal entries (:func:`~edu3d.course.ch13_context_parallelism_ring.
    ring_step_work`) for both splits side by side; ``summary[split]`` is its
    :func:`~edu3d.course.ch13_context_parallelism_ring.step_imbalance`."""
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True,
                        subplot_titles=("plain split", "zigzag split"))
    cp = len(plain[0])
    for col, work in ((1, plain), (2, zigzag)):
        for r in range(cp):
            fig.add_bar(x=[f"step {i}" for i in range(len(work))], y=[row[r] for row in work],
                        name=f"rank {r}", legendgroup=f"rank {r}", showlegend=col == 1,
                        marker={"color": style.group_color(r)}, row=1, col=col)
    p, z = summary["plain"], summary["zigzag"]
    style.frame(fig, f"Work of each rank at each ring step, cp={cp} (each step waits for its "
                     "busiest rank)",
                f"sum over steps of the busiest rank: plain {p['slowest']:g} entries, "
                f"{p['ratio']:.2f}x balanced; zigzag {z['slowest']:g}, {z['ratio']:.2f}x",
                x="step of the ring (index)", height=420)
    fig.update_yaxes(title_text="causal score entries (count)", row=1, col=1)
    fig.update_layout(barmode="group", margin={"t": 115})  # the panels' titles under the takeaway
    return fig


def overlap_figure(rows: list[dict], hidden_from: int | None, cp: int):
    """Measured per sequence length (``rows`` of
    :func:`~edu3d.course.ch13_context_parallelism_ring.overlap_probe`): one ring step's
    attention and one K, V block's transfer, in ms, on log axes."""
    fig = go.Figure()
    xs = [r["seq_len"] for r in rows]
    fig.add_scatter(x=xs, y=[r["attention_ms"] for r in rows], mode="lines+markers",
                    name="attention of one ring step (s/cp queries x s/cp keys)",
                    line={"color": style.BLUE})
    fig.add_scatter(x=xs, y=[r["transfer_ms"] for r in rows], mode="lines+markers",
                    name="moving one K,V block (2·(s/cp)·h values)",
                    line={"color": style.SEND})
    take = (f"measured: the attention outlasts the transfer from s = {hidden_from} on (s/cp = "
            f"{hidden_from // cp} tokens a rank): there the ring hides it"
            if hidden_from is not None else
            f"measured: the transfer outlasts the attention at every s up to {max(xs)}: the "
            "ring's communication is exposed here")
    style.frame(fig, f"When the ring hides its communication (cp={cp}, live ranks)", take,
                x="sequence length s (tokens)", y="time per ring step (ms)", height=400)
    fig.update_xaxes(type="log", tickvals=xs, ticktext=[str(x) for x in xs])
    fig.update_yaxes(type="log", dtick=1)  # a label per power of ten, none between
    return fig


def merge_figure(demo: dict):
    """One query's merge (:func:`edu3d.course.ch13_context_parallelism.merge_demo`)."""
    dims = [f"d{i}" for i in range(len(demo["full"]))]
    fig = go.Figure()
    fig.add_bar(x=dims, y=demo["full"], name="full attention (all keys)",
                marker={"color": style.BLUE}, opacity=style.GHOST_OPACITY, width=0.9)
    for key, name, color in (("out_a", f"keys 0..{demo['cut'] - 1} alone", style.SKY),
                             ("out_b", f"keys {demo['cut']}..{demo['seq_len'] - 1} alone",
                              style.TEAL),
                             ("merged", "merged by log-sum-exp", style.BLUE),
                             ("average", "plain average (wrong)", style.VERMILLION)):
        fig.add_bar(x=dims, y=demo[key], name=name, marker={"color": color}, width=0.18,
                    offset=-0.4 + 0.2 * ("out_a", "out_b", "merged", "average").index(key))
    style.frame(fig, "Two partial attentions merged = attention over all keys",
                f"weights e^(lse_a-lse) = {demo['weight_a']:.3f} and e^(lse_b-lse) = "
                f"{demo['weight_b']:.3f}; merge error {demo['error']:.1e}, the average's "
                f"{demo['average_error']:.1e}",
                x="output element (head dimension)", y="value (fp32)", height=380)
    fig.update_layout(barmode="overlay")
    return fig


def exchange_figure(measured: dict | None, formulas: dict, step_ms: dict | None = None,
                    cp: int = 4):
    """Bytes per rank per attention layer for each impl in ``formulas`` (ghost), measured
    beside them when ``measured`` is given."""
    impls = list(formulas)
    fig = go.Figure()
    for phase, color, offset in (("forward", style.SEND, -0.4), ("backward", style.OLIVE, 0.0)):
        fig.add_bar(x=impls, y=[formulas[i][phase] / 1024 for i in impls],
                    name=f"{phase} (formula)", width=0.4, offset=offset,
                    marker=style.estimate_marker(color))
        if measured:
            fig.add_bar(x=impls, y=[measured[i][phase] / 1024 for i in impls],
                        name=f"{phase} (measured)", width=0.26, offset=offset + 0.07,
                        marker={"color": color})
    take = exchange_takeaway(measured or formulas)
    if step_ms:
        take += "; fwd+bwd " + ", ".join(f"{i} {step_ms[i]:.0f} ms" for i in impls
                                         if i in step_ms)
    style.frame(fig, f"What one rank sends per attention layer, cp={cp}", take,
                x="attention implementation (cp group)", y="sent (KiB)", height=400)
    fig.update_layout(barmode="overlay")
    return fig


def exchange_takeaway(sent: dict[str, dict[str, float]]) -> str:
    """Which of the drawn implementations sends least and most per rank (forward and backward
    together), from the bytes the bars draw."""
    total = {i: v["forward"] + v["backward"] for i, v in sent.items()}
    least, most = min(total, key=total.get), max(total, key=total.get)
    if total[least] == total[most]:
        return f"every implementation drawn sends {total[least] / 1024:.1f} KiB per rank"
    return (f"{least} sends least per rank ({total[least] / 1024:.1f} KiB forward and backward), "
            f"{most} the most ({total[most] / 1024:.1f} KiB)")


def activation_figure(rows: list[dict], extra=None):
    """One layer's saved bytes against sequence length (``rows`` from
    :func:`edu3d.course.ch13_context_parallelism.activation_sweep`); ``extra(row)``: the bytes
    the formula leaves out, added to the line if given."""
    fig = go.Figure()
    cps = sorted({r["cp"] for r in rows})
    for i, cp in enumerate(cps):
        sel = sorted((r for r in rows if r["cp"] == cp), key=lambda r: r["seq_len"])
        color = style.group_color(i)
        xs = [r["seq_len"] for r in sel]
        fig.add_scatter(x=xs, y=[(r["formula"] + (extra(r) if extra else 0)) / 1024
                                 for r in sel], mode="lines", name=f"cp={cp} formula",
                        line={"color": color, "dash": "dot"}, legendgroup=str(cp))
        fig.add_scatter(x=xs, y=[r["measured"] / 1024 for r in sel], mode="markers",
                        name=f"cp={cp} measured", marker={"color": color, "size": 10},
                        legendgroup=str(cp))
    style.frame(fig, "Activations one layer keeps for backward, per rank",
                activation_takeaway(rows), x="sequence length s (tokens)",
                y="saved for backward (KiB)", height=400)
    return fig


def activation_takeaway(rows: list[dict]) -> str:
    """At the longest sequence measured, how many times less each cp keeps than one rank,
    from the measured bytes the markers draw."""
    longest = max(r["seq_len"] for r in rows)
    at = {r["cp"]: r["measured"] for r in rows if r["seq_len"] == longest}
    if 1 not in at or len(at) == 1:
        return f"measured at s = {longest}"
    return (f"measured at s = {longest}: " + ", ".join(f"cp={c} keeps {at[1] / at[c]:.2f}x less"
                                                      for c in sorted(at) if c > 1)
            + " than one rank (cp x less, less the ring's small extras)")


def scale_figure(rows: list[dict], gpu_gb: float = 80.0, name: str = "Llama 3 8B",
                 seq_len: int = 131072):
    """Activation GB per GPU per cp degree (:func:`~edu3d.course.ch13_context_parallelism.playbook_scale`)."""
    fig = go.Figure()
    x = [f"cp={r['cp']}" for r in rows]
    colors = [style.PURPLE if r["total_gb"] > gpu_gb else style.GREEN for r in rows]
    fig.add_bar(x=x, y=[r["total_gb"] for r in rows], marker={"color": colors},
                name="activations (formula)", text=[f"{r['total_gb']:.0f}" for r in rows],
                textposition="outside")
    fig.add_scatter(x=x, y=[gpu_gb] * len(rows), mode="lines", name=f"{gpu_gb:.0f} GB GPU",
                    line={"color": style.BLACK, "dash": "dash"})
    first = next((r["cp"] for r in rows if r["total_gb"] <= 0.5 * gpu_gb), None)
    style.frame(fig, f"{name} at {seq_len // 1024}k tokens: activations per GPU",
                "Korthikanti's 16-bit count, selective recomputation, b=1"
                + (f"; cp={first} brings it under half an {gpu_gb:.0f} GB GPU" if first else ""),
                x="context-parallel degree (cp)", y="activations (GB)", height=380)
    return fig
