"""Chapter 05's panel: pipeline schedules, simulated at once, then run live.

After reading this file you should know what the knobs change: schedule, pp, m and vpp redraw
the simulated Gantt (:func:`edu3d.widgets.pipeline.simulated_pipeline`) and the bubble against
m (:func:`edu3d.course.ch05_pipeline_parallel.pp_bubble_curve`), the formula beside the
simulation; a setting that cannot run shows why instead of a figure; "run it" runs the live
pipeline (:func:`edu3d.course.ch05_pipeline_parallel.run_schedules`) and draws it over the
simulation.
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch05_pipeline_parallel as ch05
from edu3d.config.layout import Layout
from edu3d.widgets.panels.panel import Panel, choices
from edu3d.widgets.pipeline import (SIM_COSTS_US, bubble_figure, pipeline_figure,
                                    simulated_pipeline)

CURVE_MS = tuple(range(1, 17))
# the Gantt's costs (a message 0.05 ms, a forward 1 ms), so both print the same bubble
P2P = SIM_COSTS_US["p2p"] / SIM_COSTS_US["F"]


class PipelineControls(Panel):
    """Chapter 05: schedule, pipeline ranks, micro-batches and chunks per rank."""

    title = "Pipeline schedules: choose one; 'run it' runs it live on pp ranks"
    knob_rows = (("schedule", "pp"), ("m", "vpp"))
    FIGURES = ("gantt_fig", "bubble_fig")
    PP_CHOICES = (2, 4, 8)
    VPP_CHOICES = (1, 2, 3, 4)

    def __init__(self, schedule: str = "1f1b", pp: int = 4, m: int = 8, vpp: int = 1,
                 steps: int = 2):
        super().__init__({"schedule": schedule, "pp": pp, "m": m, "vpp": vpp})
        self.steps = steps
        self.redraw()

    def _bubble_fig(self, measured: float | None = None):
        s = self.state
        curve = ch05.pp_bubble_curve(s["schedule"], s["pp"], s["vpp"], CURVE_MS, P2P)
        return bubble_figure(curve, s["schedule"], s["pp"], s["m"], s["vpp"], measured)

    def redraw(self, **changes) -> None:
        s = self.state
        if "schedule" in changes and "vpp" not in changes:
            # a schedule brings its own chunk count: interleaved needs v >= 2, the others 1
            interleaved = changes["schedule"] == "interleaved"
            if interleaved and s["vpp"] == 1:
                changes["vpp"] = 2
            elif not interleaved and s["vpp"] > 1:
                changes["vpp"] = 1
        elif "vpp" in changes and "schedule" not in changes:
            # ... and chunks bring their schedule: v >= 2 is interleaving, v = 1 is not
            if changes["vpp"] > 1 and s["schedule"] != "interleaved":
                changes["schedule"] = "interleaved"
            elif changes["vpp"] == 1 and s["schedule"] == "interleaved":
                changes["schedule"] = "1f1b"
        s.update(changes)
        note = ""
        if s["schedule"] == "dualpipev" and s["m"] < 2 * s["pp"]:
            # DualPipeV feeds both ends of the V at once: one micro-batch per stage at least
            note = (f"dualpipev needs m >= 2 x pp = {2 * s['pp']} micro-batches: "
                    f"micro-batches {s['m']} -> {2 * s['pp']}")
            s["m"] = 2 * s["pp"]
        if ch05.pp_problem(s["schedule"], s["pp"], s["m"], s["vpp"]) and s["m"] % s["pp"]:
            # interleaving (and ZB-H1) send micro-batches in groups of pp: snap to a group
            m = -(-s["m"] // s["pp"]) * s["pp"]
            if not ch05.pp_problem(s["schedule"], s["pp"], m, s["vpp"]):
                note = (f"{s['schedule']} sends micro-batches in groups of pp = {s['pp']}: "
                        f"micro-batches {s['m']} -> {m}")
                s["m"] = m
        self.sync_knobs()
        bad = ch05.pp_problem(s["schedule"], s["pp"], s["m"], s["vpp"])
        if bad:
            self.gantt_fig = self.bubble_fig = None
            self.say(f"cannot draw this pipeline: {bad}")
            return
        self.gantt_fig = simulated_pipeline(s["pp"], s["m"], s["schedule"], s["vpp"])
        self.bubble_fig = self._bubble_fig()
        self.say(note)

    def run(self, timeout: float = 300):
        """Run the chosen schedule for ``steps`` steps on pp ranks; draw the last step over
        the simulation (with the measured costs) and its bubble on the curve."""
        s = self.state
        bad = ch05.pp_run_problem(s["schedule"], s["pp"], s["m"], s["vpp"])
        if self.refuse(bad and f"cannot run this pipeline: {bad}"):
            return None
        self.say(f"running {s['schedule']} on {s['pp']} pipeline ranks, "
                 f"{s['m']} micro-batches, {self.steps} steps ...")
        kw = ch05.pp_run_kwargs(s["schedule"], s["pp"], s["m"], s["vpp"], self.steps)
        run = self.launch(ch05.run_schedules, s["pp"], args=(
            [{"name": s["schedule"], "m": s["m"], "vpp": s["vpp"]}],), kwargs=kw,
            layout=Layout(pp=s["pp"]), progress=False, timeout=timeout)
        if run is None:
            return None
        events, res = run.events(), run.results[0][0]
        bubble = ch05.measured_bubble(events, res["steps"])
        self.result = {"events": events, "steps": res["steps"], "bubble": bubble}
        self.gantt_fig = pipeline_figure(
            events, s["schedule"], s["pp"], s["m"], s["vpp"], step=res["steps"][-1],
            title=f"{s['schedule']} on {s['pp']} ranks, measured over the simulation")
        self.bubble_fig = self._bubble_fig(bubble)
        self.say(f"ran {s['pp']} ranks in {run.elapsed_s:.0f} s")
        return self.result

    def knobs(self) -> dict:
        s = self.state
        return {"schedule": w.Dropdown(options=list(ch05.SCHEDULES), value=s["schedule"],
                                       description="schedule"),
                "pp": w.Dropdown(options=choices(self.PP_CHOICES, s["pp"]), value=s["pp"],
                                 description="pp"),
                "m": w.IntSlider(min=1, max=16, value=s["m"], description="micro-batches",
                                 style={"description_width": "initial"}),
                "vpp": w.Dropdown(options=choices(self.VPP_CHOICES, s["vpp"]),
                                  value=s["vpp"], description="vpp (chunks)",
                                  style={"description_width": "initial"})}


def pipeline_controls(**default) -> PipelineControls:
    """Chapter 05's panel; display ``.widget`` in JupyterLab (``.figures`` without one)."""
    return PipelineControls(**default)
