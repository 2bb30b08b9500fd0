"""Chapter 06's panel: a 3D layout's pipeline and memory, simulated at once, then run.

After reading this file you should know what the knobs change: dp, tp, pp, the ZeRO stage,
the schedule and the micro-batches redraw the *simulated* pipeline
(:func:`edu3d.widgets.pipeline.simulated_pipeline`) and the per-rank memory estimate
(:func:`edu3d.course.ch06_3d_parallelism.memory_estimate`, the planner's) at once; "run it"
launches the real run (world size at most 8,
:func:`edu3d.course.ch06_3d_parallelism.capstone`) and draws it over the simulation.
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import lesson_args
from edu3d.course.ch06_3d_parallelism import capstone, memory_estimate
from edu3d.config.layout import Layout, LayoutError
from edu3d.train.preflight import model_config
from edu3d.widgets.panels.panel import MAX_RUN_RANKS, Panel, choices
from edu3d.widgets.pipeline import simulated_pipeline
from edu3d.widgets.threed import memory_per_rank, pipeline_view

DEFAULT = {"dp": 2, "tp": 2, "pp": 2, "zero": 1, "schedule": "1f1b", "microbatches": 4}


class Controls(Panel):
    """Knobs for a 3D layout that redraw the simulated pipeline and the memory estimate."""

    knob_rows = (("dp", "tp", "pp"), ("zero", "schedule", "microbatches"))
    FIGURES = ("pipeline_fig", "memory_fig")

    def __init__(self, default: dict | None = None, config=None):
        super().__init__({**DEFAULT, **(default or {})})
        self.config = config or model_config(lesson_args())
        self.pipeline_fig = self.memory_fig = None
        self.redraw()

    @property
    def vpp(self) -> int:
        return 2 if self.state["schedule"] == "interleaved" else 1

    @property
    def layout(self) -> Layout:
        s = self.state
        return Layout(dp=s["dp"], tp=s["tp"], pp=s["pp"], vpp=self.vpp)

    @property
    def global_batch(self) -> int:
        """The run's batch: the chapter's 8 where dp x micro-batches divides it, else one
        sample per micro-batch per dp rank, so no dp and no micro-batch count is refused."""
        n = self.state["dp"] * self.state["microbatches"]
        return 8 if 8 % n == 0 else n

    def problem(self) -> str | None:
        """Why the current choice has no memory estimate and cannot run (None if it can),
        in the panel's own knobs."""
        s = self.state
        try:
            self.layout.validate(config=self.config, global_batch=self.global_batch,
                                 microbatches=s["microbatches"])
        except (LayoutError, ValueError) as exc:
            layers = self.config.n_layers
            if s["pp"] * self.vpp > layers:
                return (f"{s['schedule']} at pp={s['pp']} cuts the model into "
                        f"{s['pp'] * self.vpp} stages, and the tiny model has {layers} layers:"
                        " the pipeline is simulated above; for the memory and 'run it' "
                        "choose a smaller pp" + (" or another schedule" if self.vpp > 1
                                                 else ""))
            return f"{exc} (choose another dp, tp or pp)"
        return None

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        note = ""
        if s["schedule"] == "interleaved" and s["microbatches"] % s["pp"]:
            # interleaving sends micro-batches round in groups of pp: snap to the next group
            m = -(-s["microbatches"] // s["pp"]) * s["pp"]
            note = (f"interleaved sends micro-batches in groups of pp={s['pp']}: "
                    f"micro-batches {s['microbatches']} -> {m}")
            s["microbatches"] = m
            if self._knobs and m > self._knobs["microbatches"].max:
                self._knobs["microbatches"].max = m
            self.sync_knobs()
        self.pipeline_fig = simulated_pipeline(s["pp"], s["microbatches"], s["schedule"],
                                               self.vpp)
        bad = self.problem()
        self.memory_fig = None
        if bad is None:
            self.estimate = memory_estimate(self.config, s["dp"], s["tp"], s["pp"], s["zero"],
                                            s["microbatches"], s["schedule"], self.vpp,
                                            global_batch=self.global_batch)
            self.memory_fig = memory_per_rank(
                self.estimate, layout=self.layout,
                title=f"Memory per rank, estimated: dp={s['dp']} tp={s['tp']} pp={s['pp']} "
                      f"ZeRO-{s['zero']}" + ("" if s["dp"] > 1 else
                                             " (dp=1: nothing to shard)"),
                takeaway="params/tp per stage; ZeRO-1 divides the optimizer by dp, -2 also "
                         "the grads, -3 everything; activations x micro-batches in flight.")
        self.say("; ".join(x for x in (note, bad) if x))

    def run(self, timeout: float = 300):
        """Launch the real run of the current layout and draw it over the simulation."""
        s = self.state
        layout = self.layout
        if self.refuse(self.problem() or (None if layout.world_size <= MAX_RUN_RANKS else
                                          f"the real run is limited to {MAX_RUN_RANKS} ranks")):
            return None
        self.say(f"running {layout.world_size} ranks ...")
        run = self.launch(capstone, layout.world_size, kwargs={
            "steps": 2, "zero": s["zero"], "microbatches": s["microbatches"],
            "global_batch": self.global_batch,
            "schedule": s["schedule"], "vpp": self.vpp}, layout=layout, timeout=timeout)
        if run is None:
            return None
        self.result = run
        self.pipeline_fig = simulated_pipeline(s["pp"], s["microbatches"], s["schedule"],
                                               self.vpp, pipeline_view(run.events(), layout))
        self.memory_fig = memory_per_rank({r["rank"]: r["memory"] for r in run.results},
                                          self.estimate, title="Memory per rank, measured",
                                          layout=layout)
        self.say(f"ran {layout.world_size} ranks in {run.elapsed_s:.0f} s")
        return run

    def knobs(self) -> dict:
        s = self.state
        return {
            "dp": w.Dropdown(options=choices([1, 2, 4, 8], s["dp"]), value=s["dp"],
                             description="dp"),
            "tp": w.Dropdown(options=choices([1, 2, 4], s["tp"]), value=s["tp"],
                             description="tp"),
            "pp": w.Dropdown(options=choices([1, 2, 4], s["pp"]), value=s["pp"],
                             description="pp"),
            "zero": w.IntSlider(min=0, max=3, value=s["zero"], description="ZeRO"),
            "schedule": w.Dropdown(options=["gpipe", "1f1b", "interleaved", "zb-h1"],
                                   value=s["schedule"], description="schedule"),
            "microbatches": w.IntSlider(min=1, max=8, value=s["microbatches"],
                                        description="micro-batches"),
        }


def controls(default: dict | None = None) -> Controls:
    """The chapter's controls; display ``controls().widget`` in JupyterLab, or show the
    static ``pipeline_fig`` / ``memory_fig`` without a frontend."""
    return Controls(default)
