"""The course's visual grammar in one place: colours per operation and the chart frame.

After reading this file you should know how every edu3d chart is coloured and framed, so a
new visualizer looks like the others:

* **colour = operation.** Forward blue, backward orange, input-grad teal, weight-grad green,
  communication yellow (always on its own sub-lane), idle hatched grey. The colours come from
  the Okabe-Ito palette (and Paul Tol's teal/green, which stay apart from it under the common
  colour-vision deficiencies), so nobody has to tell red from green.
* **tint = model chunk.** Interleaved pipelines put several chunks on one rank; chunk ``c`` of
  ``v`` is the operation's colour mixed towards white.
* **theory is a ghost** (the same colour, translucent) drawn under the measurement.
* **frame:** every chart has a title, axis titles with units, and a one-line takeaway under
  the title (:func:`frame`).

The colours are plain strings and dicts; :func:`frame` and :func:`html_export_renderer`
also set plotly's layout and renderer.
"""

from __future__ import annotations

import numpy as np
import plotly.io as pio

# Okabe & Ito (2008), "Color Universal Design"; TEAL and GREEN from Paul Tol's muted scheme.
BLUE = "#0072B2"
ORANGE = "#E69F00"
SKY = "#56B4E9"
TEAL = "#44AA99"
GREEN = "#117733"
YELLOW = "#F0E442"
SAND = "#DDCC77"
OLIVE = "#999933"
VERMILLION = "#D55E00"
PURPLE = "#CC79A7"
GREY = "#9E9E9E"
BLACK = "#000000"
SEND = "#997700"  # Paul Tol's medium-contrast dark yellow
RECV = "#EECC66"  # ... and light yellow

#: operation -> colour (compute ops in pipeline notation, then collectives).
OP_COLORS = {
    "F": BLUE, "forward": BLUE,
    "B": ORANGE, "backward": ORANGE,
    "I": TEAL, "input_grad": TEAL,
    "W": GREEN, "weight_grad": GREEN,
    "optimizer": VERMILLION, "step": VERMILLION,
    "recompute": PURPLE,
    # communication: the yellow family, so every transfer reads as "talking"
    "all_reduce": YELLOW, "all_gather": SAND, "reduce_scatter": OLIVE,
    # send and receive differ in lightness (Paul Tol's dark and light yellow), so they stay
    # apart under every colour-vision deficiency and in greyscale
    "broadcast": "#E5D36B", "send": SEND, "recv": RECV,
    "SEND_F": SEND, "RECV_F": RECV, "SEND_B": SEND, "RECV_B": RECV,
    "barrier": "#D8D3A0",
    # expert parallelism's all-to-alls (chapter 12): rows out dark, outputs back light, the
    # tiny exchange of counts before them grey (never an extra colour an optimizer has)
    "dispatch": SEND, "combine": SAND, "counts": GREY,
    "idle": GREY,
}
#: colours for operations that have no fixed colour, handed out in order of first use.
EXTRA_COLORS = (VERMILLION, PURPLE, SKY, BLACK, "#882255", "#332288")
#: one colour per group in pictures of groups (mesh cube, collectives).
GROUP_COLORS = (BLUE, ORANGE, GREEN, VERMILLION, PURPLE, SKY, OLIVE, "#882255",
                TEAL, "#332288", SAND, BLACK)

COMM_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv",
                      "barrier", "SEND_F", "RECV_F", "SEND_B", "RECV_B"})

GHOST_OPACITY = 0.3  # theory under measurement
IDLE_PATTERN = {"shape": "/", "fgcolor": GREY, "bgcolor": "rgba(0,0,0,0)", "solidity": 0.3}
FONT = {"family": "Inter, Helvetica, Arial, sans-serif", "size": 13}


_extra_assigned: dict[str, str] = {}  # unknown op -> colour, stable within a session


def op_color(op: str) -> str:
    """The colour of an operation; unknown operations get a stable extra colour."""
    if op in OP_COLORS:
        return OP_COLORS[op]
    if op not in _extra_assigned:
        _extra_assigned[op] = EXTRA_COLORS[len(_extra_assigned) % len(EXTRA_COLORS)]
    return _extra_assigned[op]


def group_color(i: int) -> str:
    """Colour of the ``i``-th group in a picture of groups."""
    return GROUP_COLORS[i % len(GROUP_COLORS)]


def hex_to_rgb(color: str) -> tuple[int, int, int]:
    c = color.lstrip("#")
    return int(c[0:2], 16), int(c[2:4], 16), int(c[4:6], 16)


def rgba(color: str, alpha: float) -> str:
    """``"#0072B2", 0.3`` -> ``"rgba(0,114,178,0.3)"``."""
    r, g, b = hex_to_rgb(color)
    return f"rgba({r},{g},{b},{alpha:g})"


def tint(color: str, chunk: int = 0, chunks: int = 1) -> str:
    """The colour of model chunk ``chunk`` of ``chunks``: chunk 0 is the colour itself, later
    chunks are mixed towards white (at most 45 %, so they stay recognisable and do not look
    like translucent theory ghosts)."""
    if chunks <= 1 or chunk <= 0:
        return color
    mix = 0.45 * chunk / (chunks - 1)
    r, g, b = (round(v + (255 - v) * mix) for v in hex_to_rgb(color))
    return f"#{r:02X}{g:02X}{b:02X}"


#: a formula's hatching: estimates and measurements must differ in the legend too, where a
#: translucent swatch beside a solid one of the same colour is easy to miss
ESTIMATE_HATCH = "/"


def estimate_marker(color: str, **extra) -> dict:
    """The marker of a bar drawn from a formula or a simulation (theory): hatched in the
    colour and outlined, on no fill, so it reads as an estimate in the plot and in the
    legend. Measurements use :func:`measured_marker` (solid)."""
    return {"color": "rgba(0,0,0,0)",
            "pattern": {"shape": ESTIMATE_HATCH, "fgcolor": color, "solidity": 0.35},
            "line": {"color": color, "width": 1.5}, **extra}


def measured_marker(color: str, **extra) -> dict:
    """The marker of a measured bar: the colour solid (theory is :func:`estimate_marker`)."""
    return {"color": color, **extra}


def title_text(title: str, takeaway: str | None = None) -> str:
    """A title with the takeaway as a smaller second line (works in every plotly version and
    in exported HTML)."""
    if not takeaway:
        return f"<b>{title}</b>"
    return f"<b>{title}</b><br><span style='font-size:0.85em'>{takeaway}</span>"


def html_export_renderer() -> None:
    """Inside a Jupyter kernel plotly's default renderer emits only plotly's own mime type,
    which JupyterLab draws but an exported HTML page does not. Add the ``notebook`` renderer
    (plotly.js embedded once, works offline) so every chart survives ``nbconvert --to html``.
    A renderer the user chose is left alone."""
    if pio.renderers.default == "plotly_mimetype":
        pio.renderers.default = "plotly_mimetype+notebook"


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 layer``, ``3 layers`` (``words`` for an irregular plural)."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


def shows_in_legend(fig, trace) -> bool:
    """Whether plotly puts ``trace`` in the figure's legend (heatmaps never; a lone trace only
    when the layout asks for a legend)."""
    if trace.type in ("heatmap", "contour", "surface", "mesh3d", "cone", "streamtube"):
        return bool(trace.showlegend)
    if fig.layout.showlegend is False or trace.showlegend is False:
        return False
    return fig.layout.showlegend is True or len(fig.data) > 1


def label_legend(fig, legend: bool | None = None) -> None:
    """Keep meaningless entries (plotly's ``trace 0``) out of the legend: a trace without a
    name never shows there, and the legend is shown only when some named trace is in it."""
    for trace in fig.data:
        if not trace.name and trace.showlegend is not False:
            trace.showlegend = False
    named = [t for t in fig.data if t.name and t.showlegend is not False
             and t.type not in ("heatmap", "contour", "surface")]
    fig.update_layout(showlegend=bool(named) if legend is None else legend and bool(named))


def frame(fig, title: str, takeaway: str | None = None, *, x: str | None = None,
          y: str | None = None, height: int | None = None, legend: bool | None = None):
    """Apply the shared chart frame to a plotly figure and return it.

    ``x`` and ``y`` are axis titles *with units* (``"time (ms)"``); ``takeaway`` is the one
    line the learner should remember. The legend lists named traces only
    (:func:`label_legend`); ``legend=False`` hides it. Also makes sure the chart shows in
    exported HTML (:func:`html_export_renderer`).
    """
    html_export_renderer()
    text = title_text(title, takeaway)
    lines = text.count("<br>") + 1  # a takeaway on two lines must not run into the plot
    fig.update_layout(
        title={"text": text, "x": 0.0, "xanchor": "left"},
        font=FONT, template="plotly_white",
        margin={"l": 70, "r": 20, "t": 60 if lines == 1 else 90 + 20 * (lines - 2), "b": 50},
    )
    label_legend(fig, legend)
    if height is not None:
        fig.update_layout(height=height)
    # an axis that already has its own title (a right-hand axis) keeps it
    if x is not None:
        fig.for_each_xaxis(lambda ax: ax.update(title_text=x) if not ax.title.text else None)
    if y is not None:
        fig.for_each_yaxis(lambda ax: ax.update(title_text=y) if not ax.title.text else None)
    integer_ticks(fig)
    return fig


def _integers(values) -> list[int] | None:
    """``values`` as ints when every one is a whole number (not a bool, not a label)."""
    out = []
    for v in values if values is not None else ():
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer,
                                                                  np.floating)):
            return None
        if v != v or float(v) != int(v):
            return None
        out.append(int(v))
    return out or None


def integer_ticks(fig) -> None:
    """Steps, ranks, micro-batches are counted in whole numbers: an x axis whose every point
    is a whole number gets ticks on whole numbers only (plotly would put some at 0.5), one
    per value while there are at most 20."""
    axes: dict[str, list[int] | None] = {}
    for trace in fig.data:
        if trace.type not in ("scatter", "bar") or getattr(trace, "orientation", None) == "h":
            continue
        xs = _integers(trace.x)
        name = "xaxis" + (trace.xaxis or "x")[1:]
        if xs is None:
            axes[name] = None  # one trace with other x values: leave the axis to plotly
        elif name not in axes:
            axes[name] = xs
        elif axes[name] is not None:
            axes[name] += xs
    for name, xs in axes.items():
        axis = fig.layout[name]
        if not xs or axis.type in ("category", "log", "date") or axis.dtick is not None \
                or axis.tickvals is not None:
            continue
        span = max(xs) - min(xs)
        axis.update(tickformat="d", **({"dtick": 1} if span <= 20 else {}))
