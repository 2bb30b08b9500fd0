"""ZeRO, drawn from live runs: who owns what, how much memory each rank holds, and ZeRO-3's
gather/free rhythm.

After reading this file you should be able to read three pictures:

* :func:`sharding_map_figure` — x = position in the model's flat parameter vector (units laid
  end to end, each padded to a multiple of N), one row per rank and category (params blue,
  grads orange, optimizer state vermillion). A full-width bar means the rank keeps all of it;
  a short bar is its shard. The dropdown steps through stages 0-3: optimizer state is sharded
  from stage 1, gradients from 2, parameters from 3;
* :func:`memory_bars_figure` — bytes per rank per category, measured from the tensors each
  rank holds (solid, stacked) next to the formula (ghost), for each stage;
* :func:`resident_params_figure` — ZeRO-3's resident parameter bytes over one step, from the
  ``mem`` events the run recorded: a sawtooth between the shard ``4Ψ/N`` and the shard plus
  one gathered unit, never the full ``4Ψ``;
* :func:`zero_memory_figure` and :func:`zero_traffic_figure` — the chapter panel's bars for
  all four stages at N ranks: memory per rank (the paper's formula as a ghost, the planner's
  exact count solid) and traffic per step (2Ψ, 3Ψ), the chosen stage marked, a run's
  measurement beside it;
* :func:`hsdp_figure` — HSDP (``--hsdp R``) on N ranks for each R: the bytes a rank sends per
  step inside its replica group and across the groups (the formula's as ghosts, a run's
  solid) and the state it holds (shards of ``1/(N/R)``), the chosen R marked.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from edu3d.plan.formulas import zero_bytes
from edu3d.widgets import style

CATS = ("params", "grads", "optimizer")
CAT_COLORS = {"params": style.BLUE, "grads": style.ORANGE, "optimizer": style.VERMILLION}
MB = 1e6
FIRST_SHARDED_STAGE = {"optimizer": 1, "grads": 2, "params": 3}


def sharding_map_figure(units: list[tuple[str, int, int]], n: int, stage: int = 1,
                        menu: bool = True):
    """``units``: ``(name, numel, padded)`` per flat unit, in order (see
    :class:`edu3d.parallel.zero.flat_unit.FlatUnit`). ``menu``: the figure's own dropdown through the
    stages (off in a control panel, whose stage knob redraws the figure)."""
    starts, pos = [], 0
    for _, _, padded in units:
        starts.append(pos)
        pos += padded
    total = pos
    rows = [f"rank {r} · {c}" for r in range(n) for c in CATS]

    def bars(st):
        out = {c: ([], [], []) for c in CATS}  # y, base, length
        for r in range(n):
            for c in CATS:
                y = f"rank {r} · {c}"
                if st >= FIRST_SHARDED_STAGE[c]:
                    for (_, _, padded), s0 in zip(units, starts):
                        k = padded // n
                        out[c][0].append(y)
                        out[c][1].append(s0 + r * k)
                        out[c][2].append(k)
                else:
                    out[c][0].append(y)
                    out[c][1].append(0)
                    out[c][2].append(total)
        return out

    def traces(st):
        b = bars(st)
        return [go.Bar(y=b[c][0], base=b[c][1], x=b[c][2], orientation="h", name=c,
                       marker_color=CAT_COLORS[c],
                       hovertemplate="%{y}: elements %{base} .. %{x}<extra></extra>")
                for c in CATS]

    def takeaway(st):
        held = {0: "every rank holds everything: 16Ψ bytes each",
                1: "optimizer state sharded: each rank steps only its slice",
                2: "gradients sharded too: reduce-scatter as backward produces them",
                3: "parameters sharded too: gathered per unit just before use"}
        return held[st]

    fig = go.Figure(traces(stage))
    buttons = [] if not menu else [{"label": f"stage {st}", "method": "update",
                "args": [{"base": [bars(st)[c][1] for c in CATS],
                          "x": [bars(st)[c][2] for c in CATS],
                          "y": [bars(st)[c][0] for c in CATS]},
                         {"title.text": style.title_text(
                             f"ZeRO-{st} sharding map, {n} ranks", takeaway(st))}]}
               for st in range(4)]
    style.frame(fig, f"ZeRO-{stage} sharding map, {n} ranks", takeaway(stage),
                x="position in the flat parameter vector (elements)",
                height=140 + 24 * len(rows))
    fig.update_layout(barmode="overlay")
    if menu:
        fig.update_layout(updatemenus=[{"buttons": buttons, "active": stage, "x": 1.0,
                                        "xanchor": "right", "y": 1.18}])
    fig.update_yaxes(categoryorder="array", categoryarray=rows[::-1])
    # one layout update for all unit boundaries (add_vline per unit is slow in plotly)
    fig.update_layout(
        shapes=[{"type": "line", "x0": s0, "x1": s0, "xref": "x", "y0": 0, "y1": 1,
                 "yref": "paper", "line": {"color": style.GREY, "width": 1, "dash": "dot"}}
                for s0 in starts],
        annotations=[{"x": s0, "y": 1.0, "yref": "paper", "text": name, "showarrow": False,
                      "xanchor": "left", "yanchor": "bottom", "font": {"size": 10}}  # above
                     for (name, _, _), s0 in zip(units, starts)])  # the bars, not on them
    return fig


def memory_bars_figure(measured: dict[int, dict], psi: int, n: int, **bytes_per):
    """``measured[stage]``: bytes per category on one rank (:func:`edu3d.distributed.meter.measure`).
    ``bytes_per`` goes to :func:`edu3d.plan.formulas.zero_bytes` (fp32 Adam by default)."""
    stages = sorted(measured)
    x_meas = [f"stage {s}" for s in stages]
    fig = go.Figure()
    for c in CATS:
        fig.add_trace(go.Bar(x=x_meas, y=[zero_bytes(psi, n, s, **bytes_per)[c] / 1e6
                                          for s in stages],
                             name=f"{c} (formula)", marker=style.estimate_marker(CAT_COLORS[c]),
                             offsetgroup="formula",
                             legendgroup=c))
        fig.add_trace(go.Bar(x=x_meas, y=[measured[s][c] / 1e6 for s in stages],
                             name=f"{c} (measured)", marker_color=CAT_COLORS[c],
                             offsetgroup="measured", legendgroup=c))
    ratios = ", ".join(f"stage {s}: {measured[s]['total'] / zero_bytes(psi, n, s, **bytes_per)['total']:.4f}"
                       for s in stages)
    style.frame(fig, f"Memory per rank, {n} ranks, Ψ = {psi:,} parameters (fp32 Adam)",
                f"measured / formula = {ratios}", x="ZeRO stage", y="memory per rank (MB)")
    fig.update_layout(barmode="stack")
    return fig


def resident_params_figure(events: list[dict], psi: int, n: int, step: int, rank: int = 0,
                           case: str | None = None):
    """ZeRO-3's resident parameter bytes over one step, with the shard and full-model lines."""
    mem = sorted((e for e in events if e.get("lane") == "mem" and e["rank"] == rank
                  and e.get("step") == step and "params" in e.get("mem", {})
                  and (case is None or e.get("case") == case)), key=lambda e: e["t0"])
    t0 = mem[0]["t0"] if mem else 0.0
    xs = [(e["t0"] - t0) / 1e3 for e in mem]
    ys = [e["mem"]["params"] / 1e6 for e in mem]
    if xs:  # hold the last level a little, so the final free is not hidden by the axis edge
        xs.append(xs[-1] * 1.04 + 0.1)
        ys.append(ys[-1])
    fig = go.Figure([
        go.Scatter(x=xs, y=ys, mode="lines", line={"shape": "hv", "color": style.BLUE},
                   name="resident parameters (measured)"),
        go.Scatter(x=[0, max(xs, default=1)], y=[4 * psi / n / 1e6] * 2, mode="lines",
                   line={"dash": "dash", "color": style.GREY}, name="shard 4Ψ/N (formula)"),
        go.Scatter(x=[0, max(xs, default=1)], y=[4 * psi / 1e6] * 2, mode="lines",
                   line={"dash": "dot", "color": style.VERMILLION},
                   name="full model 4Ψ (what DP holds)")])
    style.frame(fig, f"ZeRO-3: parameters held by rank {rank} during step {step}",
                "each unit is gathered before its forward and again before its backward, "
                "and freed right after", x="time since the step's first record (ms)",
                y="parameters held (MB)")
    return fig


def zero_memory_figure(pred: dict, measured: dict | None = None):
    """Bytes per rank by category for stages 0-3 at N ranks: formula (ghost), the planner's
    exact count (solid), and a run's measurement (rank 0) at its stage. ``pred`` is
    :func:`edu3d.course.ch03_zero.zero_prediction`'s, ``measured``
    :func:`edu3d.course.ch03_zero.zero_measured`'s."""
    n, chosen, psi = pred["n"], pred["stage"], pred["psi"]
    x = [f"<b>stage {s} ◀</b>" if s == chosen else f"stage {s}" for s in range(4)]
    fig = go.Figure()
    for c in CAT_COLORS:
        fig.add_bar(x=x, y=[pred["formula"][s][c] / MB for s in range(4)],
                    name=f"{c} (formula)", marker=style.estimate_marker(CAT_COLORS[c]),
                    offsetgroup="formula", legendgroup=c,
                    hovertemplate=f"{c}, formula: " + "%{y:.3f} MB<extra>%{x}</extra>")
        fig.add_bar(x=x, y=[pred["estimate"][s][c] / MB for s in range(4)],
                    name=f"{c} (planner)", marker_color=CAT_COLORS[c], offsetgroup="planner",
                    legendgroup=c,
                    hovertemplate=f"{c}, planner: " + "%{y:.3f} MB<extra>%{x}</extra>")
    f = pred["formula"][chosen]["total"]
    e = pred["estimate"][chosen]["total"]
    line = (f"ZeRO-{chosen}: {pred['formula_text'][chosen]} = {f / MB:.3f} MB; planner "
            f"{e / MB:.3f} MB (padding, step counters)")
    if measured:
        got = measured["memory"][0]
        xm = [x[measured["stage"]]]
        for c in CAT_COLORS:
            fig.add_bar(x=xm, y=[got[c] / MB], name=f"{c} (measured, rank 0)",
                        marker={"color": CAT_COLORS[c], "pattern": {"shape": "x"}},
                        offsetgroup="measured", legendgroup=c,
                        hovertemplate=f"{c}, measured: " + "%{y:.3f} MB<extra>%{x}</extra>")
        totals = [m["total"] for m in measured["memory"].values()]
        line += (f"; measured {got['total'] / MB:.3f} MB "
                 f"(x {got['total'] / pred['formula'][measured['stage']]['total']:.4f} formula)"
                 + (f", the {len(totals)} ranks within {max(totals) - min(totals):,} bytes"
                    if len(totals) > 1 else ""))
    style.frame(fig, f"Memory per rank, N = {n} ranks, Ψ = {psi:,} parameters (fp32 Adam)",
                line, x="ZeRO stage (◀ = chosen)", y="memory per rank (MB)", height=430)
    fig.update_layout(barmode="stack", legend={"font": {"size": 11}})
    return fig


def zero_traffic_figure(pred: dict, measured: dict | None = None):
    """Bytes one rank moves per step for stages 0-3 (the paper's count: 2Ψ, 2Ψ, 2Ψ, 3Ψ in
    4-byte parameters), and a run's measurement at its stage."""
    chosen, psi = pred["stage"], pred["psi"]
    # the formula's value in the tick label: a ghost bar's own text would fade with it
    x = [f"<b>stage {s} ◀</b><br>{pred['traffic_psi'][s]}Ψ" if s == chosen
         else f"stage {s}<br>{pred['traffic_psi'][s]}Ψ" for s in range(4)]
    fig = go.Figure(go.Bar(
        x=x, y=[pred["traffic"][s] / MB for s in range(4)], name="formula",
        marker=style.estimate_marker(style.OLIVE), offsetgroup="formula",
        customdata=[pred["collectives"][s] for s in range(4)],
        hovertemplate="%{customdata}: %{y:.3f} MB<extra>%{x}</extra>"))
    line = f"ZeRO-{chosen}: {pred['collectives'][chosen]} = {pred['traffic_psi'][chosen]}Ψ"
    if measured:
        got = measured["traffic"]
        fig.add_bar(x=[x[measured["stage"]]], y=[got / MB], name="measured (trace, rank 0)",
                    marker_color=style.OLIVE, offsetgroup="measured",
                    text=[f"{got / (4 * psi):.3f}Ψ"], textposition="outside")
        line += f"; measured {got / (4 * psi):.3f}Ψ (padding: the last digits)"
    style.frame(fig, f"Traffic per rank per step, Ψ = {psi:,} parameters x 4 bytes", line,
                x="ZeRO stage (◀ = chosen)", y="bytes per step (MB)", height=360)
    fig.update_yaxes(range=[0, max(pred["traffic"].values()) / MB * 1.25])
    return fig


HSDP_GROUPS = {"shard": ("inside a replica group", style.OLIVE),
               "replicate": ("across the groups", style.PURPLE)}


def hsdp_figure(rows: list[dict], chosen: int | None = None):
    """HSDP on N ranks, one column per R: bytes one rank sends per step by group (left) and
    the state it holds (right). ``rows``: :func:`edu3d.course.ch03_zero_hsdp.table`'s (the
    formula's ``shard``, ``replicate``, ``params``...; a run's ``*_measured`` where run)."""
    n = rows[0]["R"] * rows[0]["S"]
    x = [f"<b>R = {r['R']} ◀</b><br>{r['R']} x {r['S']}" if r["R"] == chosen
         else f"R = {r['R']}<br>{r['R']} x {r['S']}" for r in rows]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
        "bytes sent per rank and step, by group", "training state held per rank"))
    for g, (label, color) in HSDP_GROUPS.items():
        fig.add_bar(x=x, y=[r[g] / MB for r in rows], name=f"{label}, formula",
                    marker=style.estimate_marker(color), offsetgroup=f"{g}-formula",
                    row=1, col=1)
        got = [r.get(f"{g}_measured") for r in rows]
        if any(v is not None for v in got):
            fig.add_bar(x=x, y=[None if v is None else v / MB for v in got],
                        name=f"{label}, measured", marker_color=color,
                        offsetgroup=f"{g}-measured", row=1, col=1)
    state = {"planner": [sum(r[c] for c in CATS) for r in rows],
             "measured": [sum(r[f"{c}_measured"] for c in CATS) if "params_measured" in r
                          else None for r in rows]}
    for src, vals in state.items():
        if any(v is not None for v in vals):
            fig.add_bar(x=x, y=[None if v is None else v / MB for v in vals],
                        name=f"params + grads + optimizer, {src}",
                        marker=(style.estimate_marker(style.BLUE) if src == "planner" else
                                {"color": style.BLUE}), offsetgroup=src, row=1, col=2)
    done = [r for r in rows if "shard_measured" in r]
    line = (f"{len(done)} runs measured; bytes per group equal the formula's to the byte in "
            f"{sum(all(r[f'{g}_measured'] == r[g] for g in HSDP_GROUPS) for r in done)}"
            if done else "the formula (ghosts); 'run it' measures")
    style.frame(fig, f"HSDP on {n} ranks: R replica groups of N/R shards (ZeRO-"
                f"{rows[0].get('zero', 3)})", line, height=420)
    fig.update_layout(barmode="group", margin={"t": 130})  # room for the panels' titles
    fig.update_xaxes(title_text="replica groups R (R x shards)")
    fig.update_yaxes(title_text="sent per step (MB)", row=1, col=1)
    fig.update_yaxes(title_text="held (MB)", row=1, col=2)
    return fig
