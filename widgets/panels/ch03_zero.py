"""Chapter 03's panel: ZeRO's stage and N, predicted for all four stages, then measured.

After reading this file you should know what the knobs change: the stage and the number of
data-parallel ranks N redraw the sharding map, the memory per rank (the paper's formula as a
ghost, the planner's exact count solid) and the traffic per step (2Ψ, 3Ψ) for all four
stages, the chosen one marked (:func:`edu3d.course.ch03_zero.zero_prediction`); "run it"
trains at that stage on N ranks (:func:`edu3d.course.ch02_data_parallel.compare_versions`)
and adds the measured bars (:func:`edu3d.course.ch03_zero.zero_measured`).
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch03_zero as ch03
from edu3d.course.ch02_data_parallel import compare_versions
from edu3d.widgets.panels.panel import MAX_RUN_RANKS, Panel, choices
from edu3d.widgets.zero import sharding_map_figure, zero_memory_figure, zero_traffic_figure


class ZeroControls(Panel):
    """Chapter 03: ZeRO stage and the number of data-parallel ranks N."""

    title = "ZeRO: choose a stage and N; 'run it' trains 2 steps on N ranks"
    FIGURES = ("sharding_fig", "memory_fig", "traffic_fig")
    N_CHOICES = (2, 4, 8)

    def __init__(self, stage: int = 1, n: int = 4, config=None, steps: int = 2):
        super().__init__({"stage": stage, "n": n})
        self.config = config or ch03.course_config()
        self.steps = steps
        self.redraw()

    def _draw(self, measured: dict | None = None) -> None:
        pred = self.prediction
        self.sharding_fig = sharding_map_figure(measured and measured["units"] or pred["units"],
                                                pred["n"], pred["stage"], menu=False)
        self.memory_fig = zero_memory_figure(pred, measured)
        self.traffic_fig = zero_traffic_figure(pred, measured)

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        self.prediction = ch03.zero_prediction(self.config, s["n"], s["stage"])
        self._draw()
        self.say("")

    def run(self, timeout: float = 300):
        """Train ``steps`` steps at the chosen stage on N ranks (and the serial model on rank
        0) and draw the measured memory and traffic over the prediction."""
        s = self.state
        if self.refuse(None if s["n"] <= MAX_RUN_RANKS else
                       f"the real run is limited to {MAX_RUN_RANKS} ranks on this machine"):
            return None
        self.say(f"running ZeRO-{s['stage']} on {s['n']} ranks, {self.steps} steps "
                 "(and the serial model on rank 0) ...")
        run = self.launch(compare_versions, s["n"], args=(ch03.zero_versions(s["stage"]),),
                          kwargs={"steps": self.steps, "global_batch": 16}, progress=False,
                          timeout=timeout)
        if run is None:
            return None
        m = self.result = ch03.zero_measured(run, s["stage"], self.steps)
        self._draw(m)
        self.say(f"ran ZeRO-{s['stage']} on {s['n']} ranks in {run.elapsed_s:.0f} s; "
                 f"loss equals the serial model's within 1e-5: {m['loss_rel_err'] < 1e-5}")
        return m

    def knobs(self) -> dict:
        s = self.state
        return {"stage": w.Dropdown(options=[("0 (plain DP)", 0), ("1 (optimizer)", 1),
                                             ("2 (+ gradients)", 2), ("3 (+ parameters)", 3)],
                                    value=s["stage"], description="ZeRO stage",
                                    style={"description_width": "initial"}),
                "n": w.Dropdown(options=choices(self.N_CHOICES, s["n"]), value=s["n"],
                                description="N (dp ranks)",
                                style={"description_width": "initial"})}


def zero_controls(**default) -> ZeroControls:
    """Chapter 03's panel; display ``.widget`` in JupyterLab (``.figures`` without one)."""
    return ZeroControls(**default)
