"""Performance pictures: a profile, overlap, scaling, a benchmark report and a step's budget.

After reading this file you should know how to read chapter 10's charts:

* :func:`op_table_figure` — the operators of one profiled step by **self CPU time** (the
  time spent in the operator itself, not in what it called), coloured by what they serve:
  backward orange, communication yellow, the optimizer vermillion, the rest blue;
* :func:`profile_timeline` — the profiler's top-level events on the course's lanes
  (**lane = rank, x = time**): forward blue, backward orange, optimizer vermillion, the
  collectives' launches yellow on the comm sub-lane;
* :func:`budget_figure` — where a step's time goes, per configuration: **compute**,
  **exposed communication** (no forward or backward runs under it) and **idle** (bubble,
  waiting for a slower rank), with the communication hidden under compute written beside;
* :func:`scaling_figure` — tokens/s and step time per layout, measured, with the machine's
  core count marked: more ranks than cores share the cores;
* :func:`bench_figure` — an ``edu3d bench`` report: edu3d's time against PyTorch's;
* :class:`Controls` — a layout, overlap and micro-batches redraw the cost model's predicted
  budget (:func:`edu3d.course.ch10_performance.predict`) at once; "run it" measures the layout live and
  draws the measurement over the prediction.
"""

from __future__ import annotations

from edu3d.widgets import style

BUDGET = (("compute", "compute (F, B, optimizer)", style.BLUE),
          ("exposed", "exposed communication", style.YELLOW),
          ("idle", "idle: bubble, waiting", style.GREY))


def op_kind(name: str) -> str:
    """What an operator serves, from its name (for the table's colours)."""
    low = name.lower()
    if any(k in low for k in ("gloo", "nccl", "c10d", "allreduce", "all_reduce", "broadcast")):
        return "communication"
    if "backward" in low or low.startswith("autograd::"):
        return "backward"
    if low.startswith("optimizer.") or "adam" in low:
        return "optimizer"
    return "forward and shared"


KIND_COLORS = {"communication": style.YELLOW, "backward": style.ORANGE,
               "optimizer": style.VERMILLION, "forward and shared": style.BLUE}


def top_ops(table: list[dict], top: int = 12) -> list[dict]:
    """The ``top`` operators by self CPU time (the profiler's own marker left out)."""
    rows = [r for r in table if not r["name"].startswith(("edu3d:", "ProfilerStep"))]
    return sorted(rows, key=lambda r: -r["self_ms"])[:top]


def op_table_figure(table: list[dict], top: int = 12, rank: int = 0):
    """Horizontal bars: the ``top`` operators of one rank's profiled step by self CPU ms."""
    import plotly.graph_objects as go

    rows = top_ops(table, top)[::-1]
    total = sum(r["self_ms"] for r in table if not r["name"].startswith("edu3d:"))
    fig = go.Figure()
    for kind, color in KIND_COLORS.items():
        sel = [r for r in rows if op_kind(r["name"]) == kind]
        if sel:
            fig.add_bar(y=[r["name"] for r in sel], x=[r["self_ms"] for r in sel],
                        orientation="h", name=kind, marker_color=color,
                        text=[f"{r['self_ms']:.2f} ms × {r['calls']}" for r in sel],
                        textposition="auto",
                        hovertemplate="%{y}: %{x:.3f} ms self CPU<extra></extra>")
    lead = rows[-1] if rows else {"name": "-", "self_ms": 0.0}
    style.frame(fig, f"Where rank {rank}'s profiled step spent its CPU time",
                f"top {len(rows)} operators by self time; {lead['name']} alone is "
                f"{lead['self_ms'] / max(total, 1e-9):.0%} of {total:.1f} ms",
                x="self CPU time (ms)", height=140 + 28 * max(len(rows), 3))
    fig.update_yaxes(categoryorder="array", categoryarray=[r["name"] for r in rows])
    fig.update_layout(barmode="stack")
    return fig


def profile_timeline(events: list[dict]):
    """The profiler's top-level events of every rank on the course's lanes."""
    from edu3d.widgets.timeline import timeline_figure

    evs = [e for e in events if e.get("t1", 0) > e.get("t0", 0)]
    ranks = sorted({e["rank"] for e in evs})
    ops = [op for op in ("F", "B", "optimizer", "all_reduce", "broadcast", "send", "recv")
           if any(e["op"] == op for e in evs)]
    return timeline_figure(
        evs, ops=ops, idle=False,
        title=f"torch.profiler's events of one step, {len(ranks)} ranks",
        takeaway="each bar is a top-level operator (a matmul, a backward function, AdamW's "
                 "step); yellow: the collectives, on gloo's own thread")


def budget_figure(rows: dict[str, dict], *, title: str, takeaway: str,
                  ghosts: tuple = ()):
    """Stacked horizontal bars, one per configuration (keys of ``rows``): compute, exposed
    communication, idle (ms). Names in ``ghosts`` are drawn translucent: predictions. The
    text beside each bar gives its whole communication and the part compute hid."""
    import plotly.graph_objects as go

    names = list(rows)
    fig = go.Figure()
    for key, label, color in BUDGET:
        fig.add_bar(y=names, x=[rows[n].get(key, 0.0) for n in names], orientation="h",
                    name=label, marker_color=color,
                    marker_opacity=[style.GHOST_OPACITY if n in ghosts else 1.0 for n in names],
                    text=[f"{rows[n].get(key, 0.0):.1f}" for n in names],
                    textposition="inside",
                    marker_pattern=style.IDLE_PATTERN if key == "idle" else None,
                    hovertemplate=f"{label}: " + "%{x:.1f} ms<extra>%{y}</extra>")
    ends = [sum(rows[n].get(k, 0.0) for k, _, _ in BUDGET) for n in names]
    fig.add_scatter(y=names, x=ends, mode="text", textposition="middle right",
                    text=[f"  {e:.1f} ms; comm {rows[n].get('comm', 0.0):.1f} ms in all, "
                          f"{max(rows[n].get('comm', 0.0) - rows[n].get('exposed', 0.0), 0):.1f}"
                          " hidden" for n, e in zip(names, ends)],
                    hoverinfo="skip", showlegend=False)
    style.frame(fig, title, takeaway, x="time per step (ms)", height=200 + 50 * len(names))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(range=[0, max(ends + [1e-3]) * 1.6])
    fig.update_yaxes(autorange="reversed")
    return fig


def scaling_figure(rows: list[dict], cores: int):
    """Tokens/s (bars) and step time (labels) per layout, coloured by world size; the core
    count marked."""
    import plotly.graph_objects as go

    names = [r["name"] for r in rows]
    sizes = sorted({r["world_size"] for r in rows})
    fig = go.Figure()
    for i, n in enumerate(sizes):
        sel = [r for r in rows if r["world_size"] == n]
        fig.add_bar(x=[r["name"] for r in sel], y=[r["tokens_per_s"] for r in sel],
                    name=f"{style.plural(n, 'rank')}" + (" (more than the cores)"
                                                        if n > cores else ""),
                    marker_color=style.group_color(i),
                    marker_pattern=style.IDLE_PATTERN if n > cores else None,
                    text=[f"{r['median_s'] * 1e3:.0f} ms/step" for r in sel],
                    textposition="outside",
                    hovertemplate="%{x}: %{y:.0f} tokens/s<extra></extra>")
    best = max(rows, key=lambda r: r["tokens_per_s"])
    style.frame(fig, f"Throughput per layout on this machine ({style.plural(cores, 'core')})",
                f"{best['name']} is fastest here: on {style.plural(cores, 'core')} more ranks "
                "only share the cores, and every collective adds latency",
                x="layout (the tiny GPT, global batch 8)", y="throughput (tokens/s)")
    fig.update_xaxes(categoryorder="array", categoryarray=names)
    top = max(r["tokens_per_s"] for r in rows)
    fig.update_yaxes(range=[0, top * 1.2])
    return fig


def bench_figure(report: dict):
    """An ``edu3d bench`` report: edu3d's median time beside the reference's, the ratio on
    top."""
    import plotly.graph_objects as go

    res = report["results"]
    names = [r["name"] for r in res]
    fig = go.Figure([
        go.Bar(x=names, y=[r["edu3d_s"] * 1e3 for r in res], name="edu3d",
               marker_color=style.BLUE, text=[f"ratio {r['ratio']:.2f}" for r in res],
               textposition="outside"),
        go.Bar(x=names, y=[r["reference_s"] * 1e3 for r in res],
               name=res[0]["reference"] if res else "reference", marker_color=style.ORANGE)])
    goal = next((r["goal"] for r in res if "goal" in r), None)
    style.frame(fig, f"edu3d bench {report['benchmark']} on {report['world_size']} ranks",
                "medians of interleaved repetitions; ratio = edu3d / reference"
                + (f" (goal ≤ {goal:g})" if goal else ""),
                y="time per step (ms)", height=380)
    fig.update_layout(barmode="group")
    top = max([r["edu3d_s"] for r in res] + [r["reference_s"] for r in res] + [0]) * 1e3
    fig.update_yaxes(range=[0, top * 1.25 or 1])
    return fig


def prediction_figure(preds: dict[str, dict], chosen: str, measured: dict | None = None):
    """The predicted step time of every layout (bars), the chosen one highlighted, measured
    step times (markers) where a sweep has them."""
    import plotly.graph_objects as go

    names = list(preds)
    fig = go.Figure()
    for key, label, color in BUDGET:
        fig.add_bar(x=names, y=[preds[n][key] for n in names], name=f"{label} (predicted)",
                    marker_color=color,
                    marker_opacity=[1.0 if n == chosen else 0.35 for n in names],
                    marker_pattern=style.IDLE_PATTERN if key == "idle" else None)
    if measured:
        have = [n for n in names if n in measured]
        fig.add_scatter(x=have, y=[measured[n] for n in have], mode="markers",
                        name="measured step", marker={"symbol": "diamond", "size": 12,
                                                      "color": style.BLACK})
    p = preds[chosen]
    style.frame(fig, f"Predicted step time per layout; {chosen} highlighted",
                f"{chosen}: {p['step']:.1f} ms = compute {p['compute']:.1f} + exposed comm "
                f"{p['exposed']:.1f} + bubble {p['idle']:.1f}",
                y="time per step (ms)", height=380)
    fig.update_layout(barmode="stack")
    return fig


# ---- the control panel --------------------------------------------------------------------------
class Controls:
    """Layout, overlap and micro-batches -> the cost model's predicted step budget at once;
    "run it" measures the layout live and draws it over the prediction.

    ``costs`` calibrates the model (:func:`edu3d.course.ch10_performance.calibrate`); ``measured`` maps a
    layout name to its measured step (ms) from the chapter's sweep."""

    KNOB_LAYOUTS = ("dp1", "dp2", "tp2", "pp2", "dp4", "dp2-tp2", "dp2-pp2", "tp2-pp2")

    def __init__(self, costs: dict | None = None, measured: dict | None = None,
                 default: dict | None = None):
        self.costs, self.measured = costs, dict(measured or {})
        self.state = {"layout": "dp2", "overlap": "on", "microbatches": 0, **(default or {})}
        self.message, self.result = "", None
        self.live: dict | None = None
        self._box = self._out = None
        self.redraw()

    def prediction(self, name: str | None = None) -> dict:
        from edu3d.course.ch10_performance import predict

        s = self.state
        p = predict(name or s["layout"], s["overlap"], s["microbatches"] or None, self.costs)
        return {**p, "idle": p["bubble"]}

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        self.predicted = self.prediction()
        preds = {n: self.prediction(n) for n in self.KNOB_LAYOUTS}
        rows = {"predicted": self.predicted}
        live = bool(self.live) and self.live["key"] == (s["layout"], s["overlap"],
                                                       s["microbatches"])
        if live:
            rows["measured"] = self.live["budget"]
        m = self.predicted["microbatches"]
        self.budget_fig = budget_figure(
            rows, ghosts=("predicted",) if live else (),
            title=f"{s['layout']}, overlap {s['overlap']}, "
                  f"{style.plural(m, 'micro-batch', 'micro-batches')}"
                  f": {'measured against ' if live else ''}predicted step budget",
            takeaway=f"predicted {self.predicted['step']:.1f} ms per step on "
                     f"{style.plural(self.predicted['cores'], 'core')}"
                     + (f"; measured {self.live['budget']['step']:.1f} ms" if live else
                        "; press 'run it' to measure"))
        self.layouts_fig = prediction_figure(preds, s["layout"], self.measured)
        self._show()

    def run(self, steps: int = 3, timeout: float = 300):
        """Measure the chosen layout live and draw it over the prediction."""
        from edu3d.course.ch10_performance import run_layout

        s = self.state
        self.message = f"running {s['layout']} ..."
        self._show()
        row, brk = run_layout(s["layout"], s["overlap"], s["microbatches"] or None, steps,
                              timeout)
        med = brk["median"]
        budget = {"compute": med["compute_ms"], "exposed": med["exposed_ms"],
                  "idle": med["idle_ms"], "comm": med["comm_ms"], "step": med["step_ms"]}
        self.live = {"key": (s["layout"], s["overlap"], s["microbatches"]), "budget": budget,
                     "row": row}
        self.measured[s["layout"]] = row["median_s"] * 1e3
        self.message = (f"measured {s['layout']}: {row['median_s'] * 1e3:.1f} ms per step "
                        f"(slowest rank), {row['tokens_per_s']:.0f} tokens/s")
        self.redraw()
        return self.live

    @property
    def widget(self):
        if self._box is None:
            import ipywidgets as w

            s = self.state
            layout = w.Dropdown(options=list(self.KNOB_LAYOUTS), value=s["layout"],
                                description="layout")
            overlap = w.ToggleButtons(options=["on", "off"], value=s["overlap"],
                                      description="DP overlap")
            micro = w.IntSlider(min=0, max=8, value=s["microbatches"],
                                description="micro-batches", tooltip="0: the layout's default")
            for key, knob in (("layout", layout), ("overlap", overlap), ("microbatches", micro)):
                knob.observe(lambda ch, key=key: self.redraw(**{key: ch["new"]}), "value")
            button = w.Button(description="run it", button_style="primary")
            button.on_click(lambda _: self.run())
            self._out = w.Output()
            self._box = w.VBox([w.HBox([layout, overlap]), w.HBox([micro, button]), self._out])
            self._box.add_class("edu3d-controls")
            self._show()
        return self._box

    def _show(self) -> None:
        style.show_in(self._out, self.message, self.budget_fig, self.layouts_fig)


def controls(costs: dict | None = None, measured: dict | None = None,
             default: dict | None = None) -> Controls:
    """The chapter's control panel; display ``controls(...).widget`` in JupyterLab, or the
    static ``budget_fig`` / ``layouts_fig`` without a frontend."""
    return Controls(costs, measured, default)
