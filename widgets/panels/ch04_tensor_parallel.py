"""Chapter 04's panel: one tensor-parallel layer, its shards, collectives and activations.

After reading this file you should know what the knobs change: tp, the split to look at and
SP redraw each rank's shards of one ``X·W`` (cut here as the ranks will cut them), one
layer's collectives (count and bytes per rank on a ring) and its activation memory per rank,
all predicted by :mod:`edu3d.course.ch04_tensor_parallel`; "run it" runs the real layer on tp
ranks (:func:`edu3d.course.ch04_tensor_parallel.tp_panel_run`) and draws the measurement over
the prediction.
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch04_tensor_parallel as ch04
from edu3d.config.layout import Layout
from edu3d.widgets.panels.panel import Panel, choices
from edu3d.widgets.tensor_split import split_figure
from edu3d.widgets.tp_layer import tp_collectives_figure, tp_memory_figure

MEMORY_TPS = (1, 2, 4, 8)


class TPControls(Panel):
    """Chapter 04: tensor-parallel degree, which split to look at, and SP on or off."""

    title = "Tensor parallelism: choose tp, the split and SP; 'run it' runs the layer on tp ranks"
    FIGURES = ("split_fig", "comm_fig", "memory_fig")
    TP_CHOICES = (2, 4)
    BATCH = 2

    def __init__(self, tp: int = 2, kind: str = "column", sp: bool = False, config=None):
        super().__init__({"tp": tp, "kind": kind, "sp": sp})
        self.config = config or ch04.tp_layer_config()
        self.activations = {(k, on): ch04.tp_activation_prediction(self.config, self.BATCH, k, on)
                            for k in MEMORY_TPS for on in (False, True)}
        self.redraw()

    def _draw(self, measured: dict | None = None) -> None:
        s = self.state
        t, kind, sp = s["tp"], s["kind"], s["sp"]
        if measured:
            split = split_figure(measured["split"], kind)
            diff = ch04.split_difference(measured["split"], self.split, kind)
            split.layout.title.text += (f"<br><span style='font-size:0.85em'>measured on {t} "
                                        f"ranks; largest |measured - predicted| = "
                                        f"{diff:.1e}</span>")
            split.update_layout(margin={"t": 150}, height=split.layout.height + 30)
        else:
            split = split_figure(self.split, kind)
            split.layout.title.text = split.layout.title.text.replace(
                "<b>", "<b>Predicted: ", 1)
        self.split_fig = split
        self.comm_fig = tp_collectives_figure(self.collectives, t, sp,
                                              measured and measured["collectives"])
        self.memory_fig = tp_memory_figure(self.activations, self.config, self.BATCH, t, sp,
                                           measured and measured["memory"])

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        self.split = ch04.tp_split_prediction(s["tp"], **ch04.SPLIT)
        self.collectives = ch04.tp_collectives_prediction(self.config, self.BATCH, s["tp"],
                                                          s["sp"])
        self._draw()
        self.say("")

    def run(self, timeout: float = 240):
        """Run the split, one layer forward and backward, and its activation count on tp
        ranks; draw the measured shards, collectives and bytes over the prediction."""
        s = self.state
        self.say(f"running {s['tp']} tensor-parallel ranks ...")
        run = self.launch(ch04.tp_panel_run, s["tp"], args=(self.config, self.BATCH, s["sp"]),
                          layout=Layout(tp=s["tp"]), progress=False, timeout=timeout)
        if run is None:
            return None
        self.result = {"split": [r["split"] for r in run.results],
                       "collectives": run.results[0]["collectives"],
                       "memory": run.results[0]["memory"]}
        self._draw(self.result)
        self.say(f"ran {s['tp']} ranks in {run.elapsed_s:.0f} s")
        return self.result

    def knobs(self) -> dict:
        s = self.state
        return {"tp": w.Dropdown(options=choices(self.TP_CHOICES, s["tp"]), value=s["tp"],
                                 description="tp"),
                "kind": w.Dropdown(options=[("column split (all-gather)", "column"),
                                            ("row split (all-reduce)", "row")],
                                   value=s["kind"], description="split"),
                "sp": w.Checkbox(value=s["sp"], description="sequence parallelism (SP)")}


def tp_controls(**default) -> TPControls:
    """Chapter 04's panel; display ``.widget`` in JupyterLab (``.figures`` without one)."""
    return TPControls(**default)
