"""The pipeline Gantt chart: lanes, colours, ghosts, bubble in the title, memory strip, and
the trace count that keeps it fast."""

from __future__ import annotations

from edu3d.schedules.simulate import bubble_formula
from edu3d.widgets import style
from edu3d.widgets.pipeline import compare_figure, pipeline_figure, synthetic_trace


def test_gantt_has_measured_ghost_idle_and_memory():
    events = synthetic_trace("interleaved", 4, 8, 2)
    fig = pipeline_figure(events, "interleaved", 4, 8, 2)
    names = {t.name for t in fig.data}
    assert {"F", "B", "F (theory)", "B (theory)", "idle", "send", "recv"} <= names
    assert {f"activations rank {r}" for r in range(4)} <= names
    head = fig.layout.annotations[0].text
    assert "bubble measured" in head and f"{bubble_formula('interleaved', 4, 8, 2):.1%}" in head
    forward = next(t for t in fig.data if t.name == "F")
    # chunk tint: chunk 1 is lighter than chunk 0, micro-batch numbers are the labels
    assert set(forward.marker.color) == {style.BLUE, style.tint(style.BLUE, 1, 2)}
    assert set(forward.text) == {str(i) for i in range(8)}
    ghost = next(t for t in fig.data if t.name == "F (theory)")
    assert ghost.opacity == style.GHOST_OPACITY


def test_zero_bubble_colours_and_side_by_side():
    runs = [dict(name=n, pp=2, m=4, events=synthetic_trace(n, 2, 4)) for n in ("1f1b", "zb-h1")]
    fig = compare_figure(runs)
    names = [t.name for t in fig.data]
    assert "I" in names and "W" in names
    assert next(t for t in fig.data if t.name == "I").marker.color[0] == style.TEAL
    assert next(t for t in fig.data if t.name == "W").marker.color[0] == style.GREEN
    # one shared time axis for both schedules
    assert {fig.layout[f"xaxis{k}"].matches for k in ("", 2, 3)} == {"x4"}
    assert len([a for a in fig.layout.annotations if "bubble measured" in a.text]) == 2


def test_eight_ranks_32_microbatches_draw_one_trace_per_kind_of_box():
    """What keeps the chart fast, counted (its seconds: ``edu3d bench goals``): plotly's cost
    grows with traces and shapes, so every box of one kind is one trace, and the number of
    traces does not grow with the micro-batches (one memory strip per rank besides)."""
    fig = pipeline_figure(synthetic_trace("1f1b", 8, 32), "1f1b", 8, 32)
    assert sum(len(t.x) for t in fig.data if t.name == "F") == 8 * 32
    fewer = pipeline_figure(synthetic_trace("1f1b", 8, 8), "1f1b", 8, 8)
    assert len(fig.data) == len(fewer.data) and not fig.layout.shapes
    assert len({t.name for t in fig.data}) == len(fig.data)
