"""The one base of every chapter's control panel: knobs that redraw, a button that runs.

After reading this file you should know what every panel of the course does, whatever its
chapter:

* it holds its choice in ``state`` (a dict) and rebuilds plain plotly figures from it in
  :meth:`Panel.redraw`, at once, from a simulation or a formula computed by the chapter's
  course module (:mod:`edu3d.course`);
* its button (``"run it"`` unless the panel names it otherwise) calls :meth:`Panel.run`,
  which launches real ranks (:meth:`Panel.launch`: a failed run becomes the panel's message)
  and draws the measurement over the prediction;
* :attr:`Panel.widget` builds the ipywidgets box on first use: a bold title if any, the
  knobs in ``knob_rows`` (the name ``"run"`` places the button; otherwise it ends the last
  row), and one output area that shows the message and :attr:`Panel.figures`;
* a notebook cell shows a panel by ending with it (``ctl``), and the learner sees each figure
  once (:meth:`Panel._ipython_display_`): the panel's figures are displayed statically, then
  the widget; where a frontend draws the widget (JupyterLab), its first view tells the kernel
  (ipywidgets' ``_view_count``), and the static figures are replaced by nothing. Where none
  does (nbval, ``nbconvert --execute --to html``), the static figures stay, so checked cells
  and exported pages show the default figures. A later cell that changed the panel (``run``)
  shows its figures with :meth:`Panel.display_static`: nothing where the widget shows them.
"""

from __future__ import annotations

import abc
import traceback
import uuid

import ipywidgets as w
from IPython.display import display, update_display

from edu3d.launch.api import LaunchError, launch

MAX_RUN_RANKS = 8  # what 2 CPU cores can launch in a few seconds


class Panel(abc.ABC):
    """Knobs -> :meth:`redraw`; the button -> :meth:`run`; one output area for both."""

    title = ""  # a bold line above the knobs; empty: none
    knob_rows: tuple | None = None  # rows of knob keys ("run": the button); None: one row
    button = "run it"
    button_style = "primary"
    tooltip = "launch the real ranks and draw them over the theory"
    FIGURES: tuple = ()  # the names of the figure attributes :attr:`figures` shows

    def __init__(self, state: dict):
        self.state = dict(state)
        self.message = ""
        self.result = None
        self._box = self._out = None
        self._knobs: dict = {}
        self._syncing = False
        self._static: list[str] = []  # display ids of static figures, until a view exists

    @property
    def figures(self) -> tuple:
        """The figures the panel shows now (its ``FIGURES`` attributes that are drawn)."""
        figs = (getattr(self, name, None) for name in self.FIGURES)
        return tuple(f for f in figs if f is not None)

    @abc.abstractmethod
    def knobs(self) -> dict:
        """``{state key: ipywidget}`` showing the current state."""

    @abc.abstractmethod
    def redraw(self, **changes) -> None:
        """Apply ``changes`` to the state and redraw the figures at once (no launch)."""

    @abc.abstractmethod
    def run(self):
        """Launch the real ranks for the current state and draw the measurement."""

    # ---- what runs share --------------------------------------------------------------------
    def launch(self, target, nprocs: int, **kw):
        """Launch ``target`` on ``nprocs`` ranks quietly; a failed run becomes the panel's
        message and None is returned."""
        try:
            return launch(target, nprocs, echo=False, **kw)
        except LaunchError as err:
            self.message = f"the run failed: {str(err)[:500]}"
            self.show()
            return None

    def refuse(self, reason: str | None) -> bool:
        """Show ``reason`` (why this setting cannot run) and say whether there was one."""
        if reason:
            self.message = reason
            self.show()
        return bool(reason)

    def say(self, message: str) -> None:
        """Show ``message`` over the figures (a run starting, a run's result)."""
        self.message = message
        self.show()

    # ---- the ipywidgets box -----------------------------------------------------------------
    @property
    def widget(self):
        if self._box is None:
            knobs = self._knobs = self.knobs()
            for knob in knobs.values():
                # ipywidgets cuts a description to 80 px ("micro-bat..."): give it its width
                if getattr(knob, "description", "") and hasattr(knob, "style") and \
                        hasattr(knob.style, "description_width") and \
                        not knob.style.description_width:
                    knob.style.description_width = "initial"
            for key, knob in knobs.items():
                knob.observe(lambda ch, key=key: self._turned(key, ch["new"]), "value")
            button = w.Button(description=self.button, button_style=self.button_style,
                              tooltip=self.tooltip)
            button.on_click(lambda _: self.run())
            rows = self.knob_rows or (tuple(knobs),)
            boxes = [w.HBox([button if key == "run" else knobs[key] for key in row])
                     for row in rows]
            if not any("run" in row for row in rows):
                boxes[-1].children = (*boxes[-1].children, button)
            self._out = w.Output()
            head = [w.HTML(f"<b>{self.title}</b>")] if self.title else []
            self._box = w.VBox([*head, *boxes, self._out])
            self._box.add_class("edu3d-controls")  # what the browser test turns
            self.show()
        return self._box

    def _ipython_display_(self) -> None:
        """The panel as a cell's output: its message and figures statically, then the widget,
        which clears them once a frontend has drawn it, so each figure is seen once."""
        self.display_static()
        box = self.widget
        if box._view_count is None:
            box._view_count = 0  # ask the frontend to count the views it draws
            box.observe(self._viewed, "_view_count")
        display(box)

    def display_static(self) -> None:
        """Display the message and figures here, for a page without a frontend (nbval, an
        exported page): after a cell ran the panel (``ctl.run()``), say. Where the panel's
        widget is drawn (JupyterLab) it already shows them: they are skipped, or cleared as
        soon as the widget is drawn."""
        if self._box is not None and self._box._view_count:
            return
        static = uuid.uuid4().hex
        if self.message:
            display({"text/plain": self.message}, raw=True, display_id=static)
        for fig in self.figures:
            # plotly's own display hook ignores display_id: publish its bundle ourselves
            # (empty outside a kernel, where plotly renders to a browser tab instead)
            bundle = fig._repr_mimebundle_() if hasattr(fig, "_repr_mimebundle_") else None
            if bundle:
                display(bundle, raw=True, display_id=static)
            else:
                display(fig, display_id=static)
        self._static.append(static)

    def _viewed(self, change) -> None:
        if change["new"]:
            for static in self._static:
                update_display({"text/plain": ""}, raw=True, display_id=static)
            self._static = []

    def _turned(self, key: str, value) -> None:
        if self._syncing:
            return
        try:
            self.redraw(**{key: value})
        except Exception as err:  # noqa: BLE001 - shown to the learner, not lost in a log
            # a knob's callback runs outside any cell: its traceback would go to the server's
            # log only, and the figure would silently not change
            self.say(f"this setting failed ({key} = {value!r}): {type(err).__name__}: {err}")
            if self._out is not None:
                self._out.append_stderr(traceback.format_exc())

    def sync_knobs(self) -> None:
        """Show ``state`` on the knobs (after a redraw adjusted a dependent knob, or a choice
        set several) without one redraw per knob: :meth:`_turned` skips while syncing."""
        self._syncing = True
        try:
            for key, knob in self._knobs.items():
                if knob.value != self.state[key]:
                    knob.value = self.state[key]
        finally:
            self._syncing = False

    def show(self) -> None:
        """Redraw the output area: the message (a refused setting, a run's result), then the
        figures. Without a frontend there is no output area: nothing to draw."""
        if self._out is None:
            return
        self._out.clear_output(wait=True)
        with self._out:
            if self.message:
                print(self.message)
            if self.figures:
                display(*self.figures)


def choices(values, current) -> list:
    """A knob's options: ``values`` and the current value, sorted."""
    return sorted({*values, current})
