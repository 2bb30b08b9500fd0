"""Chapter 07's timeline knobs: pick a setting, see its recorded step; record a new one.

After reading this file you should know what the knobs change: ZeRO stage, micro-batches,
recomputation (and, where the trainer has it, how ZeRO-2/3 reduce gradients) pick one
recorded step of the tiny model on dp=2 from the chapter's sweep
(:func:`edu3d.course.ch07_memory_timeline.sweep`) and redraw it at once
(:func:`edu3d.widgets.memory_timeline.step_memory_figure`); **x** switches between time and
event index, **rank** between the fullest rank and either one. A setting the sweep did not
record says so; "record it" runs it live on 2 ranks (a few seconds) and keeps it. Without a
frontend the default setting's figure is drawn statically (:attr:`TimelineControls.figure`).
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch07_memory_timeline as timeline
from edu3d.launch.api import LaunchError
from edu3d.widgets.memory_timeline import step_memory_figure
from edu3d.widgets.panels.panel import Panel

DEFAULT = dict(zero=0, microbatches=1, recompute="none", grad_reduce="per-microbatch",
               x="time", rank=None)


class TimelineControls(Panel):
    """Knobs over a sweep of recorded steps; the button records the current setting live."""

    title = "One training step's memory, recorded live (tiny model, dp=2)"
    button = "record it"
    tooltip = "record this setting's step on 2 ranks (a few seconds) and draw it"
    FIGURES = ("figure",)

    def __init__(self, docs: dict, default: dict | None = None):
        super().__init__({**DEFAULT, **(default or {})})
        self.docs = dict(docs)
        self.figure = None
        self.knob_rows = (("zero", "microbatches", "recompute"),
                          (*(("grad_reduce",) if timeline.HAS_GRAD_REDUCE else ()),
                           "x", "rank", "run"))
        self.redraw()

    def setting(self) -> dict:
        return {k: self.state[k] for k in ("zero", "microbatches", "recompute", "grad_reduce")}

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        doc = self.docs.get(timeline.key_of(self.setting()))
        if doc is None:
            self.figure = None
            self.say(f"{timeline.label(timeline.key_of(self.setting()))} is not in the sweep: "
                     "press 'record it' to run it")
            return
        self.figure = step_memory_figure(doc, self.state["rank"], self.state["x"])
        self.say(timeline.caption(doc))

    def run(self):
        """Record the current setting live (2 ranks) and draw it."""
        self.say(f"recording {timeline.label(timeline.key_of(self.setting()))} on 2 ranks ...")
        try:
            doc = timeline.run(self.setting())
        except LaunchError as err:
            self.say(f"the run failed: {str(err)[:500]}")
            return None
        self.docs[timeline.key_of(self.setting())] = self.result = doc
        self.redraw()
        return doc

    def knobs(self) -> dict:
        s = self.state
        out = {
            "zero": w.ToggleButtons(options=list(timeline.GRID["zero"]), value=s["zero"],
                                    description="ZeRO", style={"button_width": "40px"}),
            "microbatches": w.ToggleButtons(options=list(timeline.GRID["microbatches"]),
                                            value=s["microbatches"], description="micro-batches",
                                            style={"button_width": "40px"}),
            "recompute": w.ToggleButtons(options=["none", "selective", "full"],
                                         value=s["recompute"], description="recompute",
                                         style={"button_width": "80px"}),
            "x": w.ToggleButtons(options=["time", "event"], value=s["x"], description="x axis",
                                 style={"button_width": "60px"}),
            "rank": w.Dropdown(options=[("fullest", None), ("rank 0", 0), ("rank 1", 1)],
                               value=s["rank"], description="rank"),
        }
        if timeline.HAS_GRAD_REDUCE:
            out["grad_reduce"] = w.ToggleButtons(options=list(timeline.GRAD_REDUCE),
                                                 value=s["grad_reduce"],
                                                 description="grad reduce (ZeRO-2/3)")
        return out


def timeline_controls(docs: dict, default: dict | None = None) -> TimelineControls:
    """The chapter's timeline controls over ``docs`` (a sweep); ``.widget`` in JupyterLab,
    the static ``figure`` without a frontend."""
    return TimelineControls(docs, default)
