"""Timeline: the trace of a run, one lane per rank, drawn from edu3d trace events.

After reading this file you should know how to read every timeline in the course:

* **lane = rank.** Each rank has a compute lane and, just under it, a thinner communication
  sub-lane (collectives and send/recv), so you see at a glance when a rank computes, when it
  talks, and when it does both at once (overlap).
* **x = time in milliseconds from the first event shown**: the trace's clock is aligned across
  ranks (every rank passed a barrier and called that instant zero, see :mod:`edu3d.distributed.trace`),
  and the chart shifts it so the shown step starts at 0 ms, not somewhere far along an axis
  that starts with the run. Theory (simulated) events start at their own 0.
* **colour = operation** (:mod:`edu3d.widgets.style`), **tint = model chunk**, **label =
  micro-batch**. Gaps in a compute lane between its first and last compute event are
  **idle** (hatched grey): in a pipeline that is the bubble.
* events with ``"sim": true`` (theory: a simulated schedule) are drawn as translucent
  **ghosts** under the measured bars, so prediction and measurement sit on one picture.

It is built for thousands of events: one plotly trace per operation (and per ghost/measured),
each holding all its bars as arrays (``go.Bar`` with ``base=``), never one shape per event.

Use :func:`timeline_figure` directly, or :func:`lanes` / :func:`add_bars` to build a
specialised chart (the pipeline Gantt) on the same lanes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from edu3d.widgets import style

DRAWN_LANES = ("compute", "comm")  # "mem" events are instants, drawn by the memory charts
LANE_HEIGHT = {"compute": 0.62, "comm": 0.28}
LANE_GAP = 0.12
GHOST_SCALE = 1.25  # ghosts are taller than measured bars, so theory peeks out around them
RANK_GAP = 0.3


@dataclass(frozen=True)
class Lanes:
    """Where each (rank, lane) sits on the y axis (rank 0 on top)."""

    center: dict  # (rank, lane) -> y of the lane's centre
    height: dict  # lane -> bar thickness
    tickvals: list
    ticktext: list
    extent: tuple  # (y_min, y_max)


def lanes(ranks, present=DRAWN_LANES, who: str = "rank") -> Lanes:
    """Stack the lanes: for every rank its compute lane, then its comm sub-lane; each named
    ``who`` and its number (a pipeline's lanes are its stages: ``who="stage"``)."""
    present = [lane for lane in DRAWN_LANES if lane in set(present)]
    center, y = {}, 0.0
    tickvals, ticktext = [], []
    for rank in sorted(set(ranks)):
        for i, lane in enumerate(present):
            h = LANE_HEIGHT[lane]
            center[(rank, lane)] = y + h / 2
            tickvals.append(y + h / 2)
            ticktext.append(f"{who} {rank}" if i == 0 else f"<span style='font-size:0.8em'>"
                            f"{lane}</span>")
            y += h + LANE_GAP
        y += RANK_GAP
    return Lanes(center, {k: LANE_HEIGHT[k] for k in present}, tickvals, ticktext,
                 (-RANK_GAP / 2, max(y - RANK_GAP / 2 - LANE_GAP, 0.5)))


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def _label(ev: dict) -> str:
    if ev.get("label") is not None:  # a span that names itself (chapter 03's units: "u3")
        return str(ev["label"])
    return "" if ev.get("mb") is None else str(ev["mb"])


def _details(ev: dict) -> str:
    parts = []
    if ev.get("group") is not None:
        parts.append(f"group {ev['group']}" + (f" (n={ev['n']})" if ev.get("n") else ""))
    if ev.get("peer") is not None:
        parts.append(f"peer {ev['peer']}")
    if ev.get("bytes") is not None:
        parts.append(f"bytes {_fmt_bytes(ev['bytes'])}")
    for key in ("step", "mb", "stage", "chunk", "unit"):
        if ev.get(key) is not None:
            parts.append(f"{key} {ev[key]}")
    return ", ".join(parts) if parts else " "


def add_bars(fig, events, where: Lanes, *, name: str, color, ghost: bool = False,
             pattern: dict | None = None, legendgroup: str | None = None,
             showlegend: bool = True, text: bool = True) -> None:
    """Add one ``go.Bar`` trace holding a bar per event (all on their (rank, lane) rows).

    ``color`` is one colour or one per event (chunk tints); ``ghost`` makes the bars
    translucent theory.
    """
    if not events:
        return
    t0 = np.fromiter((e["t0"] for e in events), float, len(events)) / 1e3
    t1 = np.fromiter((e["t1"] for e in events), float, len(events)) / 1e3
    y = np.fromiter((where.center[(e["rank"], e["lane"])] for e in events), float, len(events))
    scale = GHOST_SCALE if ghost else 1.0
    width = np.fromiter((where.height[e["lane"]] * scale for e in events), float, len(events))
    # numpy arrays (numbers and fixed-width strings) pass plotly's validation without a
    # per-element walk; lists and object arrays of 16000 entries would cost seconds
    hover = np.array([f"<b>{e['op']}</b> on rank {e['rank']}{' (theory)' if ghost else ''}<br>"
             f"start {a:.3f} ms, duration {b - a:.3f} ms<br>{_details(e)}"
             for e, a, b in zip(events, t0.tolist(), t1.tolist())])
    marker = {"color": color, "line": {"width": 0}}
    if pattern:
        marker["pattern"] = pattern
    fig.add_trace(go.Bar(
        orientation="h", base=t0, x=np.maximum(t1 - t0, 0.0), y=y, width=width,
        name=name, legendgroup=legendgroup or name, showlegend=showlegend,
        marker={**marker, **style.estimate_marker(color)} if ghost and isinstance(color, str)
        else marker, opacity=style.GHOST_OPACITY if ghost and not isinstance(color, str) else 1.0,
        text=np.array([_label(e) for e in events]) if text else None, textposition="inside",
        insidetextanchor="middle", textangle=0, constraintext="both",
        hovertext=hover, hoverinfo="text", cliponaxis=True,
    ))


def idle_gaps(events) -> list[dict]:
    """Idle spans of each rank's compute lane: the gaps between its compute events, from the
    earliest compute start to the latest compute end over all ranks (so a pipeline's warm-up
    and cool-down bubbles count too)."""
    busy = [e for e in events if e["lane"] == "compute" and not e.get("sim")]
    if not busy:
        return []
    start = min(e["t0"] for e in busy)
    end = max(e["t1"] for e in busy)
    out = []
    for rank in sorted({e["rank"] for e in busy}):
        t = start
        for e in sorted((e for e in busy if e["rank"] == rank), key=lambda e: e["t0"]):
            if e["t0"] > t:
                out.append({"rank": rank, "lane": "compute", "op": "idle", "t0": t, "t1": e["t0"]})
            t = max(t, e["t1"])
        if end > t:
            out.append({"rank": rank, "lane": "compute", "op": "idle", "t0": t, "t1": end})
    return out


def step_events(events, step: int | None = None, *, case: str | None = None,
                lanes=("compute", "comm"), ops=None, zero_at: str = "first") -> list[dict]:
    """The events of one step of a trace, shifted so the step starts at 0.

    ``step`` None: the trace's last step (all events when none has a step). ``case`` keeps one
    configuration's events; ``lanes`` (None: every lane) and ``ops`` (None: every operation)
    narrow the selection. ``zero_at="first"`` puts the selection's first start at 0;
    ``"compute"`` its first computation (a pipeline's receives are posted before it)."""
    evs = [e for e in events if "t1" in e and (case is None or e.get("case") == case)
           and (lanes is None or e.get("lane") in lanes) and (ops is None or e["op"] in ops)]
    steps = sorted({e["step"] for e in evs if e.get("step") is not None})
    if step is None and steps:
        step = steps[-1]
    if step is not None:
        evs = [e for e in evs if e.get("step") == step]
    starts = [e["t0"] for e in evs if zero_at == "first" or e["lane"] == "compute"]
    origin = min(starts, default=0.0)
    return [{**e, "t0": e["t0"] - origin, "t1": e["t1"] - origin} for e in evs]


def from_start(events) -> list[dict]:
    """``events`` shifted so the first of them starts at 0 (measured and simulated events
    each from their own first start: a simulation counts from 0, a run from its origin)."""
    out = []
    for sim in (False, True):
        sel = [e for e in events if bool(e.get("sim")) == sim]
        if sel:
            origin = min(e["t0"] for e in sel)
            out += [{**e, "t0": e["t0"] - origin, "t1": e["t1"] - origin} for e in sel]
    return out


def _colors(events, chunks: int):
    base = style.op_color(events[0]["op"])
    if chunks <= 1:
        return base
    return np.array([style.tint(base, e.get("chunk", 0) or 0, chunks) for e in events])


def timeline_figure(events, *, title: str = "Timeline", takeaway: str | None = None,
                    idle: bool = True, height: int | None = None, ops=None):
    """A plotly figure of ``events`` (a list of edu3d trace event dicts).

    ``ops`` restricts (and orders) the operations drawn; ``idle`` hatches compute-lane gaps.
    The x axis starts where the first shown event starts (:func:`from_start`).
    Returns a plain ``go.Figure`` (works in JupyterLab and in exported HTML).
    """
    evs = from_start([e for e in events if e.get("lane") in DRAWN_LANES and "t1" in e
                      and (ops is None or e["op"] in ops)])
    fig = go.Figure()
    if not evs:
        style.frame(fig, title, takeaway or "no compute or communication events recorded",
                    x="time (ms)")
        return fig
    where = lanes([e["rank"] for e in evs], {e["lane"] for e in evs})
    order = list(ops) if ops is not None else list(dict.fromkeys(
        e["op"] for e in sorted(evs, key=lambda e: (DRAWN_LANES.index(e["lane"]), e["t0"]))))
    chunks = 1 + max((e.get("chunk", 0) or 0 for e in evs), default=0)

    if idle:
        gaps = idle_gaps(evs)
        add_bars(fig, gaps, where, name="idle", color="rgba(0,0,0,0)",
                 pattern=style.IDLE_PATTERN, text=False)
    for ghost in (True, False):  # ghosts first, so measurements are drawn on top
        for op in order:
            sel = [e for e in evs if e["op"] == op and bool(e.get("sim")) == ghost]
            if sel:
                add_bars(fig, sel, where, name=f"{op} (theory)" if ghost else op,
                         legendgroup=op, color=_colors(sel, chunks), ghost=ghost)

    n_rows = len(where.tickvals)
    height = height or max(260, 120 + 34 * n_rows)
    style.frame(fig, title, takeaway, x="time since the first event shown (ms)", height=height)
    entries = sum(1 for t in fig.data if t.showlegend is not False)
    if entries * 24 > height - 140:  # a legend taller than the lanes: one row under the axis
        fig.update_layout(legend={"orientation": "h", "x": 0, "y": -0.35, "yanchor": "top"},
                          height=height + 40, margin={"b": 100})
    fig.update_layout(barmode="overlay", bargap=0, hoverlabel={"align": "left"},
                      uniformtext={"minsize": 8, "mode": "hide"})
    fig.update_yaxes(tickvals=where.tickvals, ticktext=where.ticktext, range=where.extent[::-1],
                     showgrid=False, zeroline=False)
    end = max(e["t1"] for e in evs) / 1e3
    fig.update_xaxes(range=[0, end * 1.01 or 1.0], showgrid=True)
    return fig
