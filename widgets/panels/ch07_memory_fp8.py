"""Chapter 07's FP8 panel: turn the outlier and the format, then train the three precisions.

After reading this file you should know what the FP8 section's controls do: the knobs
``outlier`` (the largest value planted in one row of the tensor), ``fmt`` (E4M3 or E5M2) redraw
at once each row's cast error under a tensorwise scale, a rowwise scale and no scale
(:func:`edu3d.course.ch07_memory_fp8.tensor_report`), ``scaling`` draws the chosen way bold;
the button trains fp32, bf16 and FP8 for ``steps`` steps on 2 real ranks under ZeRO-3 with
that scaling (tensorwise or rowwise, current scaling; unscaled is refused: training scales)
(:func:`edu3d.course.ch07_memory_fp8.live`), and draws the loss curves with their gap to
fp32 and the bytes one ZeRO-3 gather moved in each precision, measured from the trace.
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch07_memory_fp8 as f8
from edu3d.launch.api import LaunchError
from edu3d.widgets.fp8_numbers import gather_bytes_figure, loss_curves_figure, scale_error_figure
from edu3d.widgets.panels.panel import Panel

DEFAULT = {"outlier": 50.0, "fmt": "e4m3", "scaling": "tensorwise", "steps": 10}


class Fp8Controls(Panel):
    """outlier, fmt -> one tensor's cast errors; the button -> fp32 / bf16 / FP8 trained."""

    title = "FP8: one tensor's scale and error; the three precisions trained"
    knob_rows = (("outlier", "fmt", "scaling", "run"),)
    button = "train the three"
    tooltip = "launch 2 ranks: fp32, bf16 and FP8 under ZeRO-3, the gathers traced"
    FIGURES = ("figure", "loss_figure", "bytes_figure")

    def __init__(self, default: dict | None = None):
        super().__init__({**DEFAULT, **(default or {})})
        self.loss_figure = self.bytes_figure = None
        self.redraw()

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        self.report = f8.tensor_report(outlier=float(s["outlier"]), fmt=s["fmt"])
        self.figure = scale_error_figure(self.report, chosen=s["scaling"])
        self.show()

    def flags(self) -> str:
        """The ``edu3d train`` flags the button adds to the three runs."""
        s = self.state
        return f"--lr 3e-3 --fp8-scaling {s['scaling']}"

    def problem(self) -> str | None:
        """Why the button cannot train the current choice (None if it can)."""
        if self.state["scaling"] == "unscaled":
            return ("scaling unscaled only draws the cast: FP8 training always scales; "
                    "choose scaling tensorwise or rowwise to train")
        return None

    def run(self):
        s = self.state
        if self.refuse(self.problem()):
            return None
        self.say(f"training fp32, bf16 and FP8 for {s['steps']} steps on 2 ranks ...")
        try:
            live = f8.live(steps=int(s["steps"]), flags=self.flags())
        except LaunchError as err:  # a failed launch is the panel's message, not a traceback
            self.say(f"the run failed: {str(err)[:500]}")
            return None
        gaps = f8.loss_gaps(live["losses"], last=max(1, int(s["steps"]) // 2))
        self.loss_figure = loss_curves_figure(live["losses"], gaps)
        self.bytes_figure = gather_bytes_figure(f8.gather_table(live))
        self.result = live
        self.say(f"FP8's worst gap to fp32: {gaps['fp8']['worst']:.2e}; bf16's: "
                 f"{gaps['bf16']['worst']:.2e} ({s['scaling']} scaling)")
        return live

    def knobs(self) -> dict:
        s = self.state
        return {
            "outlier": w.FloatSlider(min=0.0, max=400.0, step=10.0, value=s["outlier"],
                                     description="outlier"),
            "fmt": w.ToggleButtons(options=["e4m3", "e5m2"], value=s["fmt"],
                                   description="format"),
            "scaling": w.ToggleButtons(options=["tensorwise", "rowwise", "unscaled"],
                                       value=s["scaling"], description="scaling"),
        }


def controls(default: dict | None = None) -> Fp8Controls:
    """The FP8 section's panel; display it (end a cell with it) in JupyterLab."""
    return Fp8Controls(default)
