"""The pipeline Gantt chart: a measured pipeline step over its theory, with its memory.

After reading this file you should know how to read the course's pipeline pictures:

* **lanes = pipeline ranks**, x = time in ms; each rank has its compute lane and a thin
  communication sub-lane under it (sends are instants, receives last as long as the rank
  waited);
* **colour = operation**: forward blue, full backward orange, input-gradient ``I`` teal,
  weight-gradient ``W`` green; **tint = model chunk** (interleaving); **label = micro-batch**;
  hatched grey = idle, the bubble;
* the **ghost** under the bars is the simulated schedule
  (:func:`edu3d.schedules.simulate.simulate`) with the *measured* mean cost of each action,
  so any gap between ghost and bars is what the theory leaves out (message latency, Python
  overhead, an uneven stage);
* the title prints the bubble fraction measured next to the formula ``(p-1)/(v·m+p-1)``
  (:func:`formula_label`; the V-shaped ZBV and DualPipeV: ``(p-1)/(6m+p-1)`` with
  ``F = I = W`` per chunk);
* under the lanes, a strip per rank shows the bytes of activations held (measured by the
  engine): GPipe's grows to m micro-batches, 1F1B's stays at most p.

:func:`pipeline_figure` draws one step; :func:`compare_figure` puts several schedules one
under the other on the same time axis; :func:`simulated_pipeline` draws a schedule's
simulation alone (a forward 1 ms, a backward 2 ms) or a run over it; :func:`bubble_figure` draws the bubble against the
number of micro-batches (the formula as a line, the simulation as markers).
"""

from __future__ import annotations

import random
import statistics

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from edu3d.schedules.actions import build, chunks
from edu3d.schedules.simulate import Costs, bubble_formula, bubble_of, simulate
from edu3d.widgets import style
from edu3d.widgets.timeline import add_bars, idle_gaps, lanes, step_events

_COMPUTE = ("F", "B", "I", "W")


def formula_label(name: str) -> str:
    """The bubble formula a schedule's pictures print (ZB-H1 has none: 1F1B's is shown)."""
    return {"interleaved": "(p-1)/(v·m+p-1)", "zbv": "(p-1)/(6m+p-1)",
            "dualpipev": "(p-1)/(6m+p-1)"}.get(name, "(p-1)/(m+p-1)")


def measured_costs(events: list[dict]) -> Costs:
    """Mean measured duration of each compute kind (µs) and the median receive wait."""
    def mean(op, default):
        d = [e["t1"] - e["t0"] for e in events if e["lane"] == "compute" and e["op"] == op
             and not e.get("sim")]
        return statistics.fmean(d) if d else default

    f = mean("F", 1.0)
    b = mean("B", 2 * f)
    i, w = mean("I", b / 2), mean("W", b / 2)
    return Costs(F=f, B=b, I=i, W=w, p2p=0.0)


def theory(name: str, pp: int, m: int, vpp: int = 1, events: list[dict] | None = None):
    """The simulated timeline of a schedule, with costs measured from ``events`` if given."""
    costs = measured_costs(events) if events else Costs()
    return simulate(build(name, pp, m, vpp), pp, costs)


def add_schedule(fig, evs: list[dict], ghost: list[dict], row: int, ranks, show_legend: bool,
                 vpp: int = 1):
    """Draw one schedule's lanes (ghost, idle, compute, comm) into subplot ``row``: one per
    pipeline stage (a pipeline rank holding ``vpp`` of them when interleaved)."""
    where = lanes(ranks, who="stage" if vpp == 1 else "pp rank")
    before = len(fig.data)
    chunks = 1 + max((e.get("chunk", 0) or 0 for e in evs + ghost), default=0)
    add_bars(fig, idle_gaps(evs), where, name="idle", color="rgba(0,0,0,0)",
             pattern=style.IDLE_PATTERN, text=False, showlegend=show_legend)
    for is_ghost, source in ((True, ghost), (False, evs)):
        for op in (*_COMPUTE, "send", "recv"):
            sel = [e for e in source if e["op"] == op and e["lane"] in ("compute", "comm")]
            if not sel:
                continue
            color = [style.tint(style.op_color(op), e.get("chunk", 0) or 0, chunks) for e in sel]
            add_bars(fig, sel, where, name=f"{op} (theory)" if is_ghost else op,
                     legendgroup=op + ("-theory" if is_ghost else ""), color=color,
                     ghost=is_ghost, showlegend=show_legend,
                     text=not is_ghost and op in _COMPUTE)
    for trace in fig.data[before:]:
        trace.update(xaxis=f"x{'' if row == 1 else row}", yaxis=f"y{'' if row == 1 else row}")
    return where


def _memory_strip(fig, evs: list[dict], row: int, ranks, show_legend: bool) -> None:
    for r in ranks:
        mem = sorted((e for e in evs if e["lane"] == "mem" and e["rank"] == r),
                     key=lambda e: e["t0"])
        if not mem:
            continue
        fig.add_trace(go.Scatter(
            x=[0.0] + [e["t0"] / 1e3 for e in mem],
            y=[0.0] + [e["mem"]["activations"] / 2**20 for e in mem],
            mode="lines", line={"shape": "hv", "width": 1.5,
                                "color": style.group_color(r)},
            name=f"activations rank {r}", legendgroup=f"mem{r}", showlegend=show_legend,
            hovertemplate=f"rank {r}: " + "%{y:.2f} MiB at %{x:.2f} ms<extra></extra>"),
            row=row, col=1)


def compare_figure(runs: list[dict], *, title: str = "Pipeline schedules, measured over "
                   "theory", takeaway: str | None = None, memory: bool = True):
    """Several pipeline steps one under the other on one time axis.

    Each run is ``{"name", "pp", "m", "vpp", "events"}`` (``events``: a run's trace, one
    step of it is drawn; ``vpp`` only for interleaved). Returns a ``go.Figure``.
    """
    rows, titles, heights = [], [], []
    for run in runs:
        evs = step_events(run["events"], run.get("step"), lanes=None, zero_at="compute")
        vpp = run.get("vpp", 1)
        ghost = theory(run["name"], run["pp"], run["m"], vpp, evs).events
        measured, formula = bubble_of(evs), bubble_formula(run["name"], run["pp"], run["m"], vpp)
        label = formula_label(run["name"])
        titles.append(f"{run['name']}  p={run['pp']} m={run['m']}"
                      + (f" v={vpp}" if vpp > 1 else "")
                      + f": bubble measured {measured:.1%}, "
                      + (f"formula {label} = {formula:.1%}" if run["name"] != "zb-h1" else
                         f"1F1B formula {formula:.1%}, ZB-H1 simulated "
                         f"{bubble_of(ghost):.1%}"))
        rows.append((evs, ghost, run["pp"], vpp))
        heights.append(0.2 + 0.5 * run["pp"])
        if memory:
            titles.append("activations held (MiB)")
            heights.append(0.45)  # tall enough for three readable ticks
    # room between panels for each panel's own title, so titles never sit on a chart
    fig = make_subplots(rows=len(heights), cols=1, shared_xaxes=True, subplot_titles=titles,
                        row_heights=heights, vertical_spacing=min(0.1, 0.32 / len(heights)))
    row = 1
    for k, (evs, ghost, pp, vpp) in enumerate(rows):
        ranks = list(range(pp))
        where = add_schedule(fig, evs, ghost, row, ranks, show_legend=True, vpp=vpp)
        fig.update_yaxes(tickvals=where.tickvals, ticktext=where.ticktext,
                         range=where.extent[::-1], showgrid=False, zeroline=False,
                         row=row, col=1)
        row += 1
        if memory:
            _memory_strip(fig, evs, row, ranks, show_legend=(k == 0))
            fig.update_yaxes(title_text="MiB", rangemode="tozero", nticks=3, row=row, col=1)
            row += 1
    named = set()  # each operation once in the legend, where it first appears (a V's I, W)
    for trace in fig.data:
        if trace.legendgroup in named:
            trace.showlegend = False
        elif trace.showlegend is not False:
            named.add(trace.legendgroup)
    style.frame(fig, title, takeaway or "Bars: measured; translucent: the schedule simulated "
                "with the measured costs; hatched: idle (the bubble).",
                height=max(360, int(170 * sum(heights))) + 120)
    fig.update_layout(barmode="overlay", bargap=0, uniformtext={"minsize": 8, "mode": "hide"},
                      margin={"t": 120})
    fig.update_annotations(font_size=12)  # the panel titles, smaller than the chart's
    fig.update_xaxes(title_text="time since the step's first compute (ms)", row=row - 1, col=1)
    fig.update_xaxes(rangemode="tozero")
    return fig


def pipeline_figure(events: list[dict], name: str, pp: int, m: int, vpp: int = 1, *,
                    step: int | None = None, title: str | None = None,
                    takeaway: str | None = None, memory: bool = True):
    """One measured pipeline step drawn over its theory, with the activation strip."""
    return compare_figure([{"name": name, "pp": pp, "m": m, "vpp": vpp, "events": events,
                            "step": step}],
                          title=title or f"Pipeline Gantt: {name}", takeaway=takeaway,
                          memory=memory)


def synthetic_trace(name: str, pp: int, m: int, vpp: int = 1, jitter: float = 0.1,
                    seed: int = 0) -> list[dict]:
    """A measured-looking trace made from the simulator with noisy costs (µs), for testing
    and for drawing a schedule nobody has time to run (8 ranks, 32 micro-batches)."""
    rng = random.Random(seed)
    t = simulate(build(name, pp, m, vpp), pp, Costs(F=1000, B=2000, I=1000, W=1000, p2p=50),
                 activation_bytes=[2**20] * (pp * chunks(name, vpp)))
    out = []
    for e in t.events:
        e = {k: v for k, v in e.items() if k != "sim"}
        if e["lane"] == "compute":
            e["t1"] = e["t0"] + (e["t1"] - e["t0"]) * (1 + jitter * rng.random())
        e["step"] = 0
        out.append(e)
    return out


SIM_COSTS_US = {"F": 1000.0, "B": 2000.0, "I": 1000.0, "W": 1000.0, "p2p": 50.0}


def simulate_schedule(pp: int, m: int, schedule: str, vpp: int = 1):
    return simulate(build(schedule, pp, m, vpp), pp, Costs(**SIM_COSTS_US))


def simulated_pipeline(pp: int, m: int, schedule: str, vpp: int = 1, measured=None, *,
                     title: str | None = None):
    """The schedule simulated (F = 1 ms, B = 2 ms); with ``measured`` (pipeline events of one
    dp/tp coordinate, ranks renumbered 0..pp-1) the run is drawn over it instead."""
    if measured:
        return compare_figure([{"name": schedule, "pp": pp, "m": m, "vpp": vpp,
                                "events": measured}],
                              title=title or f"{schedule}, pp={pp}, m={m}: measured over "
                              "the simulation", memory=False)

    sim = simulate_schedule(pp, m, schedule, vpp)
    evs = [{k: v for k, v in e.items() if k != "sim"} for e in sim.events]
    fig = go.Figure()
    where = add_schedule(fig, evs, [], 1, list(range(pp)), show_legend=True, vpp=vpp)
    style.frame(fig, title or f"Simulated {schedule}: pp={pp}, m={m}"
                + (f", v={vpp}" if vpp > 1 else ""),
                f"bubble simulated {sim.bubble:.1%}, " + (
                    f"1F1B's formula {bubble_formula('1f1b', pp, m):.1%} (ZB-H1 has no "
                    "closed form: about a third of it)" if schedule == "zb-h1" else
                    f"formula {bubble_formula(schedule, pp, m, vpp):.1%}") + "; hatched = idle",
                x="time (ms, a forward = 1 ms, a backward = 2 ms)",
                height=max(240, 140 + 40 * len(where.tickvals)))
    fig.update_layout(barmode="overlay", bargap=0, uniformtext={"minsize": 8, "mode": "hide"})
    fig.update_yaxes(tickvals=where.tickvals, ticktext=where.ticktext,
                     range=where.extent[::-1], showgrid=False, zeroline=False)
    fig.update_xaxes(rangemode="tozero")
    return fig


def bubble_figure(curve: dict, schedule: str, pp: int, m: int, vpp: int = 1,
                  measured: float | None = None):
    """Bubble fraction against m for ``schedule`` on ``pp`` ranks: the formula (line), the
    simulation (markers), the chosen m ringed, and a run's measured bubble. ``curve`` is
    :func:`edu3d.course.ch05_pipeline_parallel.pp_bubble_curve`'s (``p2p``: a message's cost
    in forwards of 1 ms)."""
    label = formula_label(schedule) + (", 1F1B's" if schedule == "zb-h1" else "")
    p2p = curve.get("p2p", 0.0)
    fig = go.Figure([
        go.Scatter(x=curve["m"], y=curve["formula"], mode="lines", name=f"formula {label}",
                   line={"dash": "dash", "color": style.GREY}),
        go.Scatter(x=curve["m"], y=curve["simulated"], mode="markers",
                   name="simulated" + (f" (+ {p2p:g} ms per message)" if p2p else ""),
                   marker={"color": style.BLUE, "size": 8})])
    sim = dict(zip(curve["m"], curve["simulated"]))
    if m in sim:
        fig.add_scatter(x=[m], y=[sim[m]], mode="markers", name=f"chosen m = {m}",
                        marker={"symbol": "circle-open", "size": 18, "color": style.BLACK,
                                "line": {"width": 2}})
    line = (f"m = {m}: simulated {sim.get(m, float('nan')):.1%}, formula "
            f"{bubble_formula(schedule, pp, m, vpp):.1%}")
    if measured is not None:
        fig.add_scatter(x=[m], y=[measured], mode="markers", name="measured (live run)",
                        marker={"symbol": "x", "size": 14, "color": style.VERMILLION})
        line += f", measured {measured:.1%}"
    style.frame(fig, f"{schedule}, p = {pp}" + (f", v = {vpp}" if vpp > 1 else "")
                + ": the bubble against the micro-batches", line, x="micro-batches m",
                y="bubble (share of the step)", height=340)
    fig.update_yaxes(tickformat=".0%", rangemode="tozero")
    return fig
