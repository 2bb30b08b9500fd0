"""Chapter 00's demos on real ranks (2, 4 and 8): groups proven by collectives, the first sum,
and their trace drawn by the shared visualizers. One launch per world size runs both demos."""

from __future__ import annotations

import pytest

from edu3d.course import ch00_launching_ranks as demos
from edu3d.launch import launch
from edu3d.config.layout import Layout
from edu3d.widgets.mesh3d import mesh_figure
from edu3d.widgets.timeline import timeline_figure

NUMEL = 1000


def report_and_sum(mesh):
    """Both demos in one run (each launch costs seconds of process start-up)."""
    return demos.mesh_report(mesh), demos.first_all_reduce(mesh, numel=NUMEL, repeats=2)


CASES = [
    pytest.param(Layout(tp=2), id="2-ranks-tp2"),
    pytest.param(Layout(dp=2, pp=2), id="4-ranks-dp2-pp2"),
    pytest.param(Layout(dp=2, tp=2, pp=2), id="8-ranks-2x2x2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("layout", CASES)
def test_demos_on_live_ranks(layout):
    n = layout.world_size
    run = launch(report_and_sum, n, layout=layout, echo=False, timeout=240)
    reports = [r for r, _ in run.results]
    sums = [s for _, s in run.results]

    for rep in reports:
        rank = rep["rank"]
        assert rep["world_size"] == n and rep["coords"] == layout.coords(rank)._asdict()
        for dim in demos.DIMS:
            assert rep["groups"][dim] == layout.group_of(rank, dim), (rank, dim)
    for s in sums:
        assert s["result"] == n * (n + 1) / 2 and s["all_equal"]
        assert s["contributed"] == s["rank"] + 1 and s["bytes"] == NUMEL * 4

    events = run.events()
    gathers = [e for e in events if e["op"] == "all_gather"]
    assert sorted((e["rank"], e["group"]) for e in gathers) == sorted(
        (r, d) for r in range(n) for d in demos.DIMS)  # every group proven by a collective
    assert all(e["n"] == len(layout.group_of(e["rank"], e["group"])) for e in gathers)
    reduces = [e for e in events if e["op"] == "all_reduce"]
    assert len(reduces) == 2 * n and all(e["bytes"] == NUMEL * 4 for e in reduces)
    assert {e["step"] for e in reduces} == {0, 1}

    fig = timeline_figure(events, title="demo", takeaway="real events")
    assert len(fig.layout.yaxis.tickvals) == 2 * n  # compute lane + comm sub-lane per rank
    assert {"fill", "all_gather", "all_reduce", "barrier"} <= {t.name for t in fig.data}

    cube = mesh_figure(layout, reports)
    assert "live ranks" in cube.layout.title.text
    if n == 8:  # DESIGN.md's example, as the ranks reported it
        assert demos.groups_table(reports).splitlines()[:3] == [
            "TP groups [0,1][2,3][4,5][6,7]", "DP groups [0,2][1,3][4,6][5,7]",
            "PP groups [0,4][1,5][2,6][3,7]"]


def test_tables_are_sorted_and_stable():
    from edu3d.widgets.mesh3d import predicted_report

    layout = Layout(dp=2, pp=2)
    reports = list(reversed(predicted_report(layout)))
    assert demos.groups_table(reports) == ("TP groups [0][1][2][3]\nDP groups [0,1][2,3]\n"
                                           "PP groups [0,2][1,3]\nMP groups [0,2][1,3]")
    assert demos.coords_table(reports).splitlines()[1:3] == ["   0   0  0  0", "   1   0  1  0"]
