"""Chapter 07's activation-offload panel: micro-batches and the modes compared.

After reading this file you should know what the offload section's controls do: the knobs
``microbatches`` (1 or 2) and ``compare`` (offload against none, against full
recomputation, or every mode) redraw at once the activations through one recorded step of
the sweep (:func:`edu3d.course.ch07_memory_offload.sweep`, drawn by
:func:`edu3d.widgets.offload_curve.offload_figure`: a line per mode on the device, a dotted
one for the host pool); the button records that micro-batch count's modes again on 2 real
ranks (:func:`edu3d.course.ch07_memory_offload.record`) and redraws.
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch07_memory_offload as offload
from edu3d.launch.api import LaunchError
from edu3d.widgets.offload_curve import offload_figure
from edu3d.widgets.panels.panel import Panel


class OffloadControls(Panel):
    """Knobs over :mod:`edu3d.course.ch07_memory_offload`'s sweep; the button records again."""

    title, button, FIGURES = "Activations through one step (tiny, dp=2)", "record it", ("figure",)
    COMPARE = {"offload vs none": ("none", "offload"),
               "offload vs recompute": ("offload", "full recompute"), "all": tuple(offload.MODES)}

    def __init__(self, res: dict, default: dict | None = None):
        super().__init__({"microbatches": 1, "compare": "all", **(default or {})})
        self.res, self.figure = {**res, "docs": dict(res["docs"])}, None
        self.redraw()

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        m, shown = self.state["microbatches"], self.COMPARE[self.state["compare"]]
        self.figure = offload_figure(
            {k: v for k, v in offload.curves(self.res, m).items() if k in shown},
            title=f"Activations through one step, {m} micro-batch(es), fullest rank",
            takeaway=offload.takeaway(offload.table(self.res), m))
        self.show()  # the widget's output area: without it a turned knob changes nothing seen

    def run(self):
        self.say(f"recording every mode at {self.state['microbatches']} micro-batch(es) ...")
        try:
            self.res["docs"].update(offload.record(self.state["microbatches"]))
        except LaunchError as err:
            return self.say(f"the run failed: {str(err)[:500]}")
        self.redraw()
        return self.res

    def knobs(self) -> dict:
        return {k: w.ToggleButtons(options=list(o), value=self.state[k], description=d)
                for k, o, d in (("microbatches", offload.MICROBATCHES, "micro-batches"),
                                ("compare", self.COMPARE, "compare"))}
