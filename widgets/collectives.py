"""Collectives, drawn from live runs: the gallery of buffers, and the ring all-reduce replay.

After reading this file you should be able to read two pictures:

* :func:`gallery_figure` — for each collective (a dropdown), every rank's buffer **before** and
  **after**, one row per rank. Rank ``r`` starts with values ``10r, 10r+1, ...``, so every
  number in the "after" panel says which ranks it came from;
* :func:`ring_replay_figure` — the N x N grid of a ring all-reduce (row = rank, column =
  chunk), stepped through both phases by a slider. A cell shows how many ranks' contributions
  that rank holds for that chunk (``k/N``); arrows are the step's transfers. During
  reduce-scatter the counts grow by one per step until each rank owns one complete chunk
  (the arrow from the last rank back up to rank 0 closes the ring);
  all-gather then copies complete chunks around. The counter compares the bytes sent so far,
  summed from the trace's ``send`` events, with ``2(N-1)/N · S``.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from edu3d.widgets import style


def _pad(rows: list, width: int) -> list:
    return [(r or []) + [None] * (width - len(r or [])) for r in rows]


def gallery_figure(results: list[dict], op: str = "all_reduce"):
    """``results``: per-rank return values of :func:`edu3d.course.ch01_collectives.collectives_gallery`."""
    ops = list(results[0])
    n = len(results)
    takeaways = {
        "broadcast": "one rank's buffer is copied to every rank",
        "reduce": "the sum arrives on one rank (rank 0); the others end with partial sums",
        "all_reduce": "every rank ends with the sum of all buffers (reduce + broadcast)",
        "all_gather": "every rank ends with every rank's piece, concatenated",
        "reduce_scatter": "rank i ends with chunk i of the sum: 1/N of an all-reduce's result",
        "all_to_all": "rank i sends its j-th piece to rank j: a transpose across ranks",
    }

    def panels(o):
        before = [r[o]["before"] for r in results]
        after = [r[o]["after"] for r in results]
        width = max(len(x or []) for x in before + after)
        return _pad(before, width), _pad(after, width)

    fig = make_subplots(rows=1, cols=2, subplot_titles=("before", "after"),
                        horizontal_spacing=0.08)
    before, after = panels(op)
    for col, z in ((1, before), (2, after)):
        fig.add_trace(go.Heatmap(z=z, text=[[("" if v is None else f"{v:g}") for v in row]
                                            for row in z], texttemplate="%{text}",
                                 colorscale="Blues", showscale=False, xgap=2, ygap=2,
                                 hovertemplate="rank %{y}, element %{x}: %{z}<extra></extra>"),
                      row=1, col=col)
    buttons = []
    for o in ops:
        b, a = panels(o)
        buttons.append({"label": o.replace("_", "-"), "method": "update", "args": [
            {"z": [b, a], "text": [[[("" if v is None else f"{v:g}") for v in row] for row in z]
                                   for z in (b, a)]},
            {"title.text": style.title_text(f"{o.replace('_', '-')} on {n} ranks", takeaways[o])}]})
    style.frame(fig, f"{op.replace('_', '-')} on {n} ranks", takeaways[op], height=330,
                legend=False)
    fig.update_layout(updatemenus=[{"buttons": buttons, "x": 1.0, "xanchor": "right", "y": 1.25,
                                    "active": ops.index(op)}])
    fig.update_yaxes(title_text="rank", autorange="reversed", dtick=1)
    fig.update_xaxes(title_text="element index", dtick=1)
    return fig


def ring_states(events: list[dict], n: int, case: str | None = None) -> list[dict]:
    """Replay a ring all-reduce from its trace: one state per (phase, step).

    Returns ``[{"phase", "step", "counts": N x N contributions, "moves": [(src, dst, chunk)],
    "sent": bytes sent so far by all ranks}]``, starting with the initial state.
    """
    sends = sorted((e for e in events if e["op"] == "send" and e.get("algo") == "ring_all_reduce"
                    and (case is None or e.get("case") == case)),
                   key=lambda e: (e["phase"] != "reduce_scatter", e["ring_step"], e["rank"]))
    counts = [[1] * n for _ in range(n)]
    states = [{"phase": "start", "step": -1, "counts": [r[:] for r in counts], "moves": [],
               "sent": 0}]
    sent = 0
    keys = list(dict.fromkeys((e["phase"], e["ring_step"]) for e in sends))
    for phase, step in keys:
        moves = [(e["rank"], e["peer"], e["chunk"]) for e in sends
                 if e["phase"] == phase and e["ring_step"] == step]
        prev = [r[:] for r in counts]
        for src, dst, chunk in moves:
            counts[dst][chunk] = (prev[dst][chunk] + prev[src][chunk]
                                  if phase == "reduce_scatter" else prev[src][chunk])
        sent += sum(e["bytes"] for e in sends if e["phase"] == phase and e["ring_step"] == step)
        states.append({"phase": phase, "step": step, "counts": [r[:] for r in counts],
                       "moves": moves, "sent": sent})
    return states


def ring_replay_figure(events: list[dict], n: int, total_bytes: int, case: str | None = None,
                       title: str | None = None):
    """Animate a ring all-reduce of a ``total_bytes`` buffer over ``n`` ranks from its trace
    (or from the simulated sends of :func:`edu3d.course.ch01_collectives.ring_sends`)."""
    states = ring_states(events, n, case)
    formula = 2 * (n - 1) / n * total_bytes  # per rank

    def heat(s):
        z = [[c / n for c in row] for row in s["counts"]]
        text = [[f"{c}/{n}" for c in row] for row in s["counts"]]
        return go.Heatmap(z=z, text=text, texttemplate="%{text}", zmin=0, zmax=1,
                          colorscale=[[0, "#FFFFFF"], [1, style.BLUE]], showscale=False,
                          xgap=3, ygap=3,
                          hovertemplate="rank %{y}, chunk %{x}: %{text} of the sum"
                                        "<extra></extra>")

    def arrows(s):
        return [{"x": c, "y": dst, "ax": c, "ay": src, "xref": "x", "yref": "y", "axref": "x",
                 "ayref": "y", "showarrow": True, "arrowhead": 3, "arrowwidth": 2,
                 "arrowcolor": style.VERMILLION, "opacity": 0.8}
                for src, dst, c in s["moves"]]

    def label(s):
        per_rank = s["sent"] / n
        phase = ("start" if s["phase"] == "start"
                 else f"{s['phase'].replace('_', '-')} step {s['step']}")
        return (f"{phase}: sent {per_rank:,.0f} B per rank so far; "
                f"formula 2(N-1)/N·S = {formula:,.0f} B")

    def step_label(s):
        if s["phase"] == "start":
            return "start"
        return f"{'RS' if s['phase'] == 'reduce_scatter' else 'AG'}{s['step']}"

    title = title or f"Ring all-reduce, {n} ranks"
    # the figure opens on frame 0: its picture, its arrows, its label and the slider on it
    fig = go.Figure(data=[heat(states[0])],
                    frames=[go.Frame(data=[heat(s)], name=str(i),
                                     layout={"annotations": arrows(s), "title.text":
                                             style.title_text(title, label(s))})
                            for i, s in enumerate(states)])
    style.frame(fig, title, label(states[0]), height=440, legend=False)
    fig.update_layout(
        margin={"b": 130}, annotations=arrows(states[0]),
        sliders=[{"steps": [{"label": step_label(s), "method": "animate",
                             "args": [[str(i)], {"mode": "immediate",
                                                 "frame": {"duration": 0, "redraw": True}}]}
                            for i, s in enumerate(states)],
                  "currentvalue": {"prefix": "step "}, "active": 0,
                  "x": 0.12, "len": 0.88, "pad": {"t": 50}}],
        updatemenus=[{"type": "buttons", "x": 0, "y": 0, "yanchor": "top", "xanchor": "left",
                      "pad": {"t": 60}, "buttons": [
            {"label": "play", "method": "animate",
             "args": [None, {"frame": {"duration": 700, "redraw": True},
                             "fromcurrent": False}]}]}])
    fig.update_yaxes(title_text="rank", autorange="reversed", dtick=1)
    fig.update_xaxes(title_text="chunk", dtick=1)
    return fig


def bytes_figure(measured: dict[int, float], total_bytes: int, op: str = "all_reduce"):
    """Bytes sent per rank (from traces) against the formula, for several world sizes N."""
    factor = 2 if op == "all_reduce" else 1
    ns = sorted(measured)
    theory = [factor * (n - 1) / n * total_bytes for n in ns]
    fig = go.Figure([
        go.Bar(x=ns, y=theory, name=f"formula {factor}(N-1)/N·S", marker_color=style.YELLOW,
               opacity=style.GHOST_OPACITY),
        go.Scatter(x=ns, y=[measured[n] for n in ns], name="measured (trace)", mode="markers",
                   marker={"color": style.BLACK, "size": 11, "symbol": "x"})])
    style.frame(fig, f"Bytes sent per rank by a ring {op.replace('_', '-')} of S = "
                     f"{total_bytes:,} B", f"approaches {factor}·S as N grows: the ring's cost "
                     "hardly depends on how many ranks there are", x="ranks N",
                y="bytes sent per rank (B)")
    fig.update_layout(barmode="overlay")
    return fig


def cost_model_figure(rep: dict):
    """All-reduce time against message size (log-log) for edu3d's ring and the library, with
    the fitted alpha-beta line of each (a report of :mod:`edu3d.bench.bench_comm`)."""
    rows = [r for r in rep["results"] if r.get("op") == "all_reduce"]
    n = rep["world_size"]
    xs = [r["bytes"] for r in rows]
    fig = go.Figure()
    for key, col, color, label in (("edu3d", "edu3d_s", style.BLUE, "edu3d ring"),
                                   ("reference", "reference_s", style.ORANGE,
                                    rows[0]["reference"])):
        alpha, beta = rows[0][f"{key}_alpha_s"], rows[0][f"{key}_beta_s_per_byte"]
        fig.add_trace(go.Scatter(x=xs, y=[r[col] * 1e3 for r in rows], mode="markers",
                                 marker={"color": color, "size": 9}, name=f"{label} (measured)"))
        fig.add_trace(go.Scatter(x=xs, y=[r[f"{key}_model_s"] * 1e3 for r in rows],
                                 mode="lines", line={"color": color, "dash": "dash"},
                                 opacity=0.6,
                                 name=f"{label}: α = {alpha * 1e6:.0f} µs, "
                                      f"1/β = {1 / max(beta, 1e-30) / 1e9:.2f} GB/s"))
    style.frame(fig, f"All-reduce time vs message size, {n} ranks",
                "t = 2(N-1)·α + 2(N-1)/N·S·β: flat (latency α) for small messages, "
                "linear (bandwidth 1/β) for large ones", x="message size S (bytes)",
                y="time (ms)")
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return fig


def _fmt_size(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:,.0f} {unit}" if unit == "B" else f"{b:,.4g} {unit}"
        b /= 1024


def ring_steps_figure(predicted: list[dict], n: int, total_bytes: int,
                      measured: list[dict] | None = None, *, alpha: float, beta: float):
    """The ring's ``2(N-1)`` steps: bytes all ranks sent in each (top) and each step's time
    (bottom), the alpha-beta prediction as ghost bars
    (:func:`edu3d.course.ch01_collectives.ring_step_costs`), a run's measurement
    (:func:`~edu3d.course.ch01_collectives.measured_ring_steps`) as black markers over it."""
    steps = [r["step"] for r in predicted]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    fig.add_trace(go.Bar(x=steps, y=[r["bytes"] / 1024 for r in predicted],
                         name="predicted (ring plan, α-β)", marker_color=style.YELLOW,
                         opacity=0.55, legendgroup="p",
                         hovertemplate="%{x}: %{y:,.1f} KiB predicted<extra></extra>"),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=steps, y=[r["s"] * 1e3 for r in predicted], marker_color=style.YELLOW,
                         opacity=0.55, legendgroup="p", showlegend=False,
                         hovertemplate="%{x}: %{y:.3f} ms predicted<extra></extra>"),
                  row=2, col=1)
    total = sum(r["s"] for r in predicted)
    latency = 2 * (n - 1) * alpha
    takeaway = (f"predicted t = 2(N-1)α + 2(N-1)/N·S·β = {latency * 1e3:.2f} + "
                f"{(total - latency) * 1e3:.2f} = {total * 1e3:.2f} ms: "
                f"{'latency α' if latency > total / 2 else 'bandwidth β'} dominates"
                f"<br>each step, every rank sends S/N = {_fmt_size(total_bytes / n)} "
                "(top: all ranks together) and pays one α")
    if measured:
        fig.add_trace(go.Scatter(x=[r["step"] for r in measured],
                                 y=[r["bytes"] / 1024 for r in measured], mode="markers",
                                 name="measured (trace, median of runs)", legendgroup="m",
                                 marker={"color": style.BLACK, "size": 11, "symbol": "x"},
                                 hovertemplate="%{x}: %{y:,.1f} KiB sent<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Scatter(x=[r["step"] for r in measured],
                                 y=[r["s"] * 1e3 for r in measured], mode="markers",
                                 legendgroup="m", showlegend=False,
                                 marker={"color": style.BLACK, "size": 11, "symbol": "x"},
                                 hovertemplate="%{x}: %{y:.3f} ms measured<extra></extra>"),
                      row=2, col=1)
        got, want = (sum(r["bytes"] for r in rows) for rows in (measured, predicted))
        takeaway = (f"measured {sum(r['s'] for r in measured) * 1e3:.2f} ms, predicted "
                    f"{total * 1e3:.2f} ms (x = median of the runs, bars = α-β)<br>bytes sent "
                    f"{got:,} " + ("= the plan's, exactly" if got == want
                                   else f"(the plan says {want:,})"))
    style.frame(fig, f"Ring all-reduce of S = {_fmt_size(total_bytes)} on N = {n} ranks, "
                "step by step", takeaway, height=540)
    fig.update_layout(barmode="overlay", legend={"orientation": "h", "x": 0, "y": -0.18,
                                                 "yanchor": "top"}, margin={"t": 110, "b": 110})
    fig.update_yaxes(title_text="sent (KiB)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="time (ms)", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text="ring step (RS = reduce-scatter, AG = all-gather)", row=2, col=1)
    return fig


def alpha_beta_figure(n: int, total_bytes: int, *, alpha: float, beta: float, time_s,
                      measured_s: float | None = None, ns=(2, 4, 8)):
    """The alpha-beta prediction against message size (log-log) for a few N, the chosen
    (N, S) marked, and a run's measured time beside it. ``time_s(size, n, alpha, beta)`` is
    the model (:func:`edu3d.course.ch01_collectives.ring_all_reduce_s`)."""
    sizes = [2 ** k for k in range(8, 29)]
    fig = go.Figure()
    for i, k in enumerate(sorted({*ns, n})):
        fig.add_trace(go.Scatter(
            x=sizes, y=[time_s(s, k, alpha, beta) * 1e3 for s in sizes],
            mode="lines", name=f"N = {k}", line={"color": style.group_color(i),
                                                 "width": 4 if k == n else 1.5},
            hovertemplate=f"N={k}, " + "S=%{x:,} B: %{y:.3f} ms<extra></extra>"))
    t = time_s(total_bytes, n, alpha, beta)
    fig.add_trace(go.Scatter(x=[total_bytes], y=[t * 1e3], mode="markers",
                             name="this choice (predicted)",
                             marker={"color": style.YELLOW, "size": 16, "symbol": "circle",
                                     "line": {"color": style.BLACK, "width": 1}}))
    if measured_s is not None:
        fig.add_trace(go.Scatter(x=[total_bytes], y=[measured_s * 1e3], mode="markers",
                                 name="measured", marker={"color": style.BLACK, "size": 12,
                                                          "symbol": "x"}))
    knee = alpha * n / beta  # where latency 2(N-1)α equals bandwidth 2(N-1)/N·S·β
    style.frame(fig, f"Alpha-beta prediction: α = {alpha * 1e6:,.0f} µs, "
                     f"1/β = {1 / beta / 1e9:.2f} GB/s",
                f"below S ≈ {_fmt_size(knee)} (N = {n}) latency dominates and more ranks cost "
                "more steps; above it the time grows with S and hardly with N",
                x="message size S (bytes)", y="all-reduce time (ms)", height=400)
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return fig
