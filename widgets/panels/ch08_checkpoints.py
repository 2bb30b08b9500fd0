"""Chapter 08's panel: which rank wrote which number, and what a reshard reads.

After reading this file you should know what the knobs change: the saved layout, the layout
to load into, the tensor and its kind (parameter or an AdamW moment) redraw the piece map and
the reshard map at once from the manifests the panel holds
(:func:`edu3d.widgets.checkpoint.piece_map`, :func:`edu3d.widgets.checkpoint.reshard_map`);
the button, "kill a rank, recover", runs the chapter's fault demo (a callable returning
:func:`edu3d.widgets.checkpoint.recovery_curve`'s figure) and shows its curve.

Section 7's :class:`IncrementalControls`: the dropdown picks which parameters ``--freeze``
takes (none, the embeddings, the embeddings and the first two blocks, or globs typed in the
text box) and redraws the bars of the runs already measured; "run it" trains that choice for
real (a serial ``edu3d train --incremental --save-every 1`` in this process, about a second)
and adds its bars (:func:`edu3d.course.ch08_checkpoints_incremental.incremental_saves`,
:func:`edu3d.widgets.ckpt_reuse.saved_bytes`).
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course.ch08_checkpoints_incremental import CASES, incremental_saves, summary
from edu3d.widgets.checkpoint import piece_map, reshard_map, tensors
from edu3d.widgets.ckpt_reuse import saved_bytes
from edu3d.widgets.panels.panel import Panel


class Controls(Panel):
    """Pick the saved layout, the layout to load into, the tensor and its kind; the piece map
    and the reshard map redraw from the manifests at once. ``fault_demo`` backs the button."""

    button = "kill a rank, recover"
    button_style = "warning"
    tooltip = "kill a rank of a real run and restart it from its last checkpoint"
    knob_rows = (("source", "target", "run"), ("kind", "name"))
    FIGURES = ("piece_fig", "reshard_fig", "fault_fig")

    def __init__(self, manifests: dict[str, dict], fault_demo=None):
        labels = list(manifests)
        super().__init__({"source": labels[0], "target": labels[-1], "kind": "param",
                          "name": tensors(manifests[labels[0]])[0]})
        self.manifests = manifests
        self.fault_demo, self.fault_fig = fault_demo, None
        self.redraw()

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        src, dst = self.manifests[s["source"]], self.manifests[s["target"]]
        names = self.names()
        if s["name"] not in names:
            s["name"] = names[0]
        if self._knobs and list(self._knobs["name"].options) != names:
            self._syncing = True  # new options reset the value: not a turn of the knob
            try:
                self._knobs["name"].options = names
            finally:
                self._syncing = False
        self.sync_knobs()
        self.piece_fig = piece_map(src, s["name"], s["kind"])
        self.reshard_fig = reshard_map(src, dst, s["name"], s["kind"])
        self.show()

    def names(self) -> list[str]:
        """The tensors of the chosen kind that both the saved and the loading layout hold."""
        s = self.state
        src, dst = self.manifests[s["source"]], self.manifests[s["target"]]
        return [n for n in tensors(src, s["kind"]) if n in tensors(dst, s["kind"])]

    def run(self):
        """The fault demo: a rank killed, the run recovered from its checkpoint."""
        if self.fault_demo is not None:
            self.fault_fig = self.result = self.fault_demo()
            self.show()
        return self.result

    def knobs(self) -> dict:
        s, labels = self.state, list(self.manifests)
        return {
            "source": w.Dropdown(options=labels, value=s["source"], description="saved by"),
            "target": w.Dropdown(options=labels, value=s["target"], description="load into"),
            "kind": w.Dropdown(options=["param", "exp_avg", "exp_avg_sq"], value=s["kind"],
                               description="kind"),
            "name": w.Dropdown(options=self.names(), value=s["name"], description="tensor",
                               layout={"width": "360px"}),
        }


def controls(manifests: dict[str, dict], fault_demo=None) -> Controls:
    """The chapter's controls; display ``controls(...).widget`` in JupyterLab, or show the
    static ``piece_fig`` / ``reshard_fig`` without a frontend."""
    return Controls(manifests, fault_demo)


# ---- section 7: incremental checkpoints ---------------------------------------------------
class IncrementalControls(Panel):
    """Section 7 (incremental checkpoints): pick what to freeze; the button measures it
    and adds its bars to the chart."""

    tooltip = "train with these parameters frozen, saving incrementally every step"
    knob_rows = (("choice", "globs", "run"),)
    FIGURES = ("bytes_fig",)

    def __init__(self, results: dict[str, dict], steps: int = 3):
        super().__init__({"choice": list(CASES)[1], "globs": CASES[list(CASES)[1]] or ""})
        self.results, self.steps = dict(results), steps
        self.redraw()

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        if "choice" in changes and changes["choice"] in CASES:
            self.state["globs"] = CASES[changes["choice"]] or ""
            self.sync_knobs()  # the text box shows the chosen globs
        label = self.label()
        self.bytes_fig = saved_bytes(self.results, reuse_takeaway(self.results), label)
        if label in self.results:
            saves = self.results[label]["saves"][1:] or self.results[label]["saves"]
            wrote = sum(x["written"] for x in saves) / len(saves) / 2**10
            total = sum(x["written"] + x["reused"] for x in saves) / len(saves) / 2**10
            self.message = (f"{label}: each save after the first wrote {wrote:,.0f} of its "
                            f"{total:,.0f} KiB (measured)")
        else:
            self.message = f"{label}: not measured yet; press '{self.button}' to train and save"
        self.show()

    def label(self) -> str:
        """The chart's name for the current globs: a preset's, or ``--freeze GLOBS``."""
        globs = self.state["globs"].strip() or None
        return next((k for k, v in CASES.items() if v == globs), f"--freeze {globs}")

    def run(self):
        globs = self.state["globs"].strip() or None
        label = next((k for k, v in CASES.items() if v == globs), f"--freeze {globs}")
        try:
            self.results[label] = self.result = incremental_saves(globs, self.steps)
        except ValueError as err:  # a glob that matches no parameter: one line
            self.message = str(err)
            self.show()
            return None
        self.message = ""
        self.redraw()
        return self.result

    def knobs(self) -> dict:
        return {"choice": w.Dropdown(options=list(CASES), value=self.state["choice"],
                                     description="freeze"),
                "globs": w.Text(value=self.state["globs"], description="globs",
                                placeholder="tok_emb.*,blocks.0.*")}


def reuse_takeaway(results: dict[str, dict]) -> str:
    """The chart's one line, from the runs' numbers: what each save after the first wrote,
    as a share of the first run's (every parameter training, when it is first)."""
    mean = summary(results)
    first = next(iter(mean))
    parts = [f"{label}: {100 * m['share']:.0f}%" for label, m in list(mean.items())[1:]]
    return (f"bytes written per save after the first, vs '{first}': " + "; ".join(parts)
            if parts else f"{first}: every save writes everything")


def incremental_controls(results: dict[str, dict], steps: int = 3) -> IncrementalControls:
    """The section's controls; display ``controls(...).widget`` in JupyterLab, or show the
    static ``bytes_fig`` without a frontend."""
    return IncrementalControls(results, steps)
