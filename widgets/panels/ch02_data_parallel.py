"""Chapter 02's panel: gradient buckets on the backward timeline, simulated, then measured.

After reading this file you should know what the knobs change: bucket size and overlap
(buckets in reverse or forward order) redraw one data-parallel step simulated from the
model's parameter sizes (:func:`edu3d.course.ch02_data_parallel.simulate_dp_step`); "run it"
runs edu3d's bucketed DP (:func:`edu3d.course.ch02_data_parallel.dp_step`) and draws the
measured step over the simulation.
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch02_data_parallel as ch02
from edu3d.course import ch02_data_parallel_batching as ch02b
from edu3d.course import lesson_args
from edu3d.train.preflight import model_config
from edu3d.widgets.overlap import bucket_timeline_figure
from edu3d.widgets.packing import batching_figure
from edu3d.widgets.panels.panel import Panel
from edu3d.widgets.timeline import step_events

BUCKET_MB = (0.02, 0.05, 0.1, 0.25, 1.0)


class BucketControls(Panel):
    """Bucket size and overlap -> one DP step simulated from the model's parameter sizes;
    run -> the real bucketed step over the simulation."""

    DEFAULT = {"bucket_mb": 0.1, "overlap": True}
    FIGURES = ("timeline_fig",)
    RANKS = 2  # a CPU core each on this machine: the run shows overlap, not contention

    def __init__(self, default: dict | None = None, config=None,
                 costs: ch02.StepCosts = ch02.StepCosts()):
        super().__init__({**self.DEFAULT, **(default or {})})
        self.config = config or model_config(lesson_args())
        self.params = ch02.backward_sizes(self.config)
        self.costs = costs
        self.measured: dict[tuple, list] = {}  # (bucket_mb, overlap) -> one measured step
        self.redraw()

    def _key(self) -> tuple:
        return self.state["bucket_mb"], self.state["overlap"]

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        got = self.measured.get(self._key())
        costs = ch02.measured_costs(got, self.costs) if got else self.costs
        self.sim = ch02.simulate_dp_step(self.params, self.state["bucket_mb"],
                                         self.state["overlap"], self.RANKS, costs)
        self.timeline_fig = bucket_timeline_figure(self.sim, got,
                                                   bucket_mb=self.state["bucket_mb"],
                                                   reverse=self.state["overlap"])
        self.say("")

    def run(self, timeout: float = 180):
        """Two real steps of bucketed DP on 2 ranks; the second is drawn over the simulation
        (whose forward and backward take the measured times)."""
        s = self.state
        self.say(f"launching {self.RANKS} ranks: bucketed DP, {s['bucket_mb']:g} MB "
                 f"buckets, {'reverse' if s['overlap'] else 'forward'} order ...")
        run = self.launch(ch02.dp_step, self.RANKS, kwargs={
            "bucket_mb": s["bucket_mb"], "reverse": s["overlap"], "steps": 2}, timeout=timeout)
        if run is None:
            return None
        self.result = run
        self.measured[self._key()] = step_events(run.events(), 2, case="panel",
                                                 ops=("F", "B", "all_reduce"))
        self.redraw()
        real = run.results[0]["buckets"]
        self.say(f"ran {self.RANKS} ranks: {len(real)} buckets "
                 f"({'same' if real == self.sim['buckets'] else 'NOT the same'} sizes "
                 "as simulated)")
        return run

    def knobs(self) -> dict:
        s = self.state
        return {
            "bucket_mb": w.Dropdown(options=[(f"{mb:g} MB", mb) for mb in
                                             sorted({*BUCKET_MB, s["bucket_mb"]})],
                                    value=s["bucket_mb"], description="bucket size"),
            "overlap": w.ToggleButtons(options=[("overlap: reverse order", True),
                                                ("no overlap: forward order", False)],
                                       value=s["overlap"], style={"button_width": "190px"},
                                       tooltips=["buckets from the last layer back: the "
                                                 "first leaves during backward",
                                                 "buckets from the embedding on: all wait for "
                                                 "the end of backward"]),
        }


def bucket_controls(default: dict | None = None) -> BucketControls:
    """Chapter 02's panel; display ``.widget`` in JupyterLab, or ``.timeline_fig`` without
    one."""
    return BucketControls(default)


# ---- the last section: documents of different lengths (edu3d.train.batching) ----------------
MODE_CHOICES = ("all", "fixed", "pad", "bucket", "tokens", "pack")


class BatchingControls(Panel):
    """Mean, spread and mode -> the lengths and pad's formula; run -> measured modes."""

    DEFAULT = {"mean": 8.0, "sigma": 0.8, "mode": "all"}
    FIGURES = ("fig",)
    title = "documents of different lengths"

    def __init__(self, default: dict | None = None, results: list[dict] | None = None):
        super().__init__({**self.DEFAULT, **(default or {})})
        self.results = results or []
        self.redraw()

    def knobs(self) -> dict:
        s = self.state
        return {"mean": w.FloatSlider(value=s["mean"], min=2, max=24, step=1,
                                      description="mean length"),
                "sigma": w.FloatSlider(value=s["sigma"], min=0, max=1.5, step=0.1,
                                       description="spread σ"),
                "mode": w.Dropdown(options=MODE_CHOICES, value=s["mode"], description="mode")}

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        self.hist = ch02b.length_histogram(s["mean"], s["sigma"])
        self.formula = ch02b.formula_waste(s["mean"], s["sigma"])
        shown = [r for r in self.results if s["mode"] in ("all", r["mode"])]
        self.fig = batching_figure(self.hist, shown, self.formula)
        self.say("")

    def run(self):
        s = self.state
        modes = ch02b.MODES if s["mode"] == "all" else (s["mode"],)
        self.say(f"training {', '.join(modes)} for a few steps ...")
        self.results = ch02b.measure_modes(s["mean"], s["sigma"], modes)
        self.redraw()
        return self.results
