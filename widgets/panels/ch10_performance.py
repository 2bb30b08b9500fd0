"""Chapter 10's panel: a layout's step budget, predicted at once, then measured.

After reading this file you should know what the knobs change: the layout, DP overlap and
the micro-batches redraw the cost model's predicted step budget
(:func:`edu3d.course.ch10_performance.predict`: compute, exposed communication, bubble) and
every layout's predicted step, at once; "run it" measures the layout live
(:func:`edu3d.course.ch10_performance.run_layout`) and draws the measurement over the
prediction.
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course.ch10_performance import predict, run_layout
from edu3d.widgets import style
from edu3d.widgets.panels.panel import Panel
from edu3d.widgets.perf import budget_figure, prediction_figure


class Controls(Panel):
    """Layout, overlap and micro-batches -> the cost model's predicted step budget at once;
    "run it" measures the layout live and draws it over the prediction.

    ``costs`` calibrates the model (:func:`edu3d.course.ch10_performance.calibrate`);
    ``measured`` maps a layout name to its measured step (ms) from the chapter's sweep."""

    KNOB_LAYOUTS = ("dp1", "dp2", "tp2", "pp2", "dp4", "dp2-tp2", "dp2-pp2", "tp2-pp2")
    knob_rows = (("layout", "overlap"), ("microbatches",))
    FIGURES = ("budget_fig", "layouts_fig")

    def __init__(self, costs: dict | None = None, measured: dict | None = None,
                 default: dict | None = None):
        super().__init__({"layout": "dp2", "overlap": "on", "microbatches": 0,
                          **(default or {})})
        self.costs, self.measured = costs, dict(measured or {})
        self.live: dict | None = None
        self.redraw()

    def prediction(self, name: str | None = None) -> dict:
        s = self.state
        p = predict(name or s["layout"], s["overlap"], s["microbatches"] or None, self.costs)
        return {**p, "idle": p["bubble"]}

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        self.predicted = self.prediction()
        preds = {n: self.prediction(n) for n in self.KNOB_LAYOUTS}
        rows = {"predicted": self.predicted}
        live = bool(self.live) and self.live["key"] == (s["layout"], s["overlap"],
                                                       s["microbatches"])
        if live:
            rows["measured"] = self.live["budget"]
        m = self.predicted["microbatches"]
        self.budget_fig = budget_figure(
            rows, ghosts=("predicted",) if live else (),
            title=f"{s['layout']}, overlap {s['overlap']}, "
                  f"{style.plural(m, 'micro-batch', 'micro-batches')}"
                  f": {'measured against ' if live else ''}predicted step budget",
            takeaway=f"predicted {self.predicted['step']:.1f} ms per step on "
                     f"{style.plural(self.predicted['cores'], 'core')}"
                     + (f"; measured {self.live['budget']['step']:.1f} ms" if live else
                        "; press 'run it' to measure"))
        self.layouts_fig = prediction_figure(preds, s["layout"], self.measured)
        self.show()

    def run(self, steps: int = 3, timeout: float = 300):
        """Measure the chosen layout live and draw it over the prediction."""
        s = self.state
        self.say(f"running {s['layout']} ...")
        row, brk = run_layout(s["layout"], s["overlap"], s["microbatches"] or None, steps,
                              timeout)
        med = brk["median"]
        budget = {"compute": med["compute_ms"], "exposed": med["exposed_ms"],
                  "idle": med["idle_ms"], "comm": med["comm_ms"], "step": med["step_ms"]}
        self.live = self.result = {"key": (s["layout"], s["overlap"], s["microbatches"]),
                                   "budget": budget, "row": row}
        self.measured[s["layout"]] = row["median_s"] * 1e3
        self.message = (f"measured {s['layout']}: {row['median_s'] * 1e3:.1f} ms per step "
                        f"(slowest rank), {row['tokens_per_s']:.0f} tokens/s")
        self.redraw()
        return self.live

    def knobs(self) -> dict:
        s = self.state
        return {
            "layout": w.Dropdown(options=list(self.KNOB_LAYOUTS), value=s["layout"],
                                 description="layout"),
            "overlap": w.ToggleButtons(options=["on", "off"], value=s["overlap"],
                                       description="DP overlap"),
            "microbatches": w.IntSlider(min=0, max=8, value=s["microbatches"],
                                        description="micro-batches",
                                        tooltip="0: the layout's default"),
        }


def controls(costs: dict | None = None, measured: dict | None = None,
             default: dict | None = None) -> Controls:
    """The chapter's control panel; display ``controls(...).widget`` in JupyterLab, or the
    static ``budget_fig`` / ``layouts_fig`` without a frontend."""
    return Controls(costs, measured, default)
