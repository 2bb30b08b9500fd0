"""Chapter 00's panel: the cube of ranks, its groups predicted and then reported by real ranks.

After reading this file you should know what the knobs change: dp, tp, pp and the group axis
redraw the cube of ranks with the groups the layout predicts
(:func:`edu3d.widgets.mesh3d.mesh_figure`); "run it" launches the ranks (at most 8), each
all-gathers its groups (:func:`edu3d.course.ch00_launching_ranks.mesh_report`), and the cube
shows what they reported over the prediction, with how many groups agree.
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course.ch00_launching_ranks import mesh_report
from edu3d.config.layout import Layout
from edu3d.widgets.mesh3d import DIM_NAMES, agreement, mesh_figure
from edu3d.widgets.panels.panel import MAX_RUN_RANKS, Panel, choices


class MeshControls(Panel):
    """dp, tp, pp and the group axis -> the cube with its groups; run -> the groups the live
    ranks formed over the prediction."""

    DEFAULT = {"dp": 2, "tp": 2, "pp": 2, "dim": "tp"}
    FIGURES = ("mesh_fig",)

    def __init__(self, default: dict | None = None):
        super().__init__({**self.DEFAULT, **(default or {})})
        self.reports: dict[tuple, list] = {}  # (dp, tp, pp) -> what its live ranks reported
        self.redraw()

    @property
    def layout(self) -> Layout:
        s = self.state
        return Layout(dp=s["dp"], tp=s["tp"], pp=s["pp"])

    def _key(self) -> tuple:
        return self.state["dp"], self.state["tp"], self.state["pp"]

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        layout = self.layout
        self.mesh_fig = mesh_figure(layout, self.reports.get(self._key()), dim=self.state["dim"])
        self.say("" if layout.world_size <= MAX_RUN_RANKS else
                 f"{layout.world_size} ranks: drawn from the formula; the real run is "
                 f"limited to {MAX_RUN_RANKS}")

    def run(self, timeout: float = 120):
        """Launch the layout's ranks; each reports the groups it all-gathered."""
        layout = self.layout
        if self.refuse(None if layout.world_size <= MAX_RUN_RANKS else
                       f"the real run is limited to {MAX_RUN_RANKS} ranks; "
                       f"{layout} has {layout.world_size}"):
            return None
        self.say(f"launching {layout.world_size} ranks as {layout} ...")
        run = self.launch(mesh_report, layout.world_size, layout=layout, timeout=timeout)
        if run is None:
            return None
        self.result = run
        self.reports[self._key()] = run.results
        same, total = agreement(layout, run.results)
        self.mesh_fig = mesh_figure(layout, run.results, dim=self.state["dim"])
        self.say(f"{layout.world_size} ranks reported their groups: {same} of {total} "
                 "agree with the prediction")
        return run

    def knobs(self) -> dict:
        s = self.state
        sizes = [1, 2, 4]
        return {
            **{k: w.Dropdown(options=choices(sizes, s[k]), value=s[k], description=k,
                             layout={"width": "130px"}) for k in ("dp", "tp", "pp")},
            "dim": w.Dropdown(options=[(v, k) for k, v in DIM_NAMES.items()], value=s["dim"],
                              description="show"),
        }


def mesh_controls(default: dict | None = None) -> MeshControls:
    """Chapter 00's panel; display ``.widget`` in JupyterLab, or ``.mesh_fig`` without one."""
    return MeshControls(default)
