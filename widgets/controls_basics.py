"""Control panels for the first three chapters: the mesh, the ring, the buckets.

After reading this file you should know what each knob changes and where the picture comes
from:

* :class:`MeshControls` (chapter 00) — dp, tp, pp and the group axis redraw the cube of
  ranks with the groups the layout predicts (:func:`edu3d.widgets.mesh3d.mesh_figure`);
  "run it" launches the ranks (at most 8), each all-gathers its groups
  (:func:`edu3d.course.ch00_launching_ranks.mesh_report`), and the cube shows what they reported over the
  prediction, with how many groups agree.
* :class:`RingControls` (chapter 01) — N and the message size redraw the ring all-reduce
  replayed from edu3d's own plan (:func:`edu3d.distributed.algorithms.ring_plan`), its steps priced by the
  alpha-beta model, and the model's curve; "run it" runs edu3d's ring over gloo at that N
  and size and draws the measured bytes and time of every step over the prediction.
* :class:`BucketControls` (chapter 02) — bucket size and overlap (buckets in reverse or
  forward order) redraw one data-parallel step simulated from the model's parameter sizes;
  "run it" runs edu3d's bucketed DP and draws the measured step over the simulation.

Every panel keeps its figures as plain plotly figures (``ctl.mesh_fig`` ...): :meth:`redraw`
rebuilds them at once, :meth:`run` launches processes only when asked, and ``ctl.widget``
builds the ipywidgets box lazily, so a notebook without a frontend shows the static figures.
"""

from __future__ import annotations

import abc

from edu3d.course import controls_basics as cb
from edu3d.widgets import style

MAX_RUN_RANKS = 8  # what 2 CPU cores can launch in a few seconds


class Panel(abc.ABC):
    """What the three panels share: a state dict, figures redrawn from it, a run button, and
    the ipywidgets box built on first use (first knob a dropdown, per the course's panels)."""

    DEFAULT: dict = {}
    FIGURES: tuple = ()

    def __init__(self, default: dict | None = None):
        self.state = {**self.DEFAULT, **(default or {})}
        self.message = ""
        self.result = None
        self._box = self._out = None

    @property
    def figures(self) -> list:
        return [getattr(self, name) for name in self.FIGURES]

    @abc.abstractmethod
    def knobs(self, w) -> dict:
        """``{state key: ipywidget}`` in display order."""

    @property
    def widget(self):
        if self._box is None:
            import ipywidgets as w

            knobs = self.knobs(w)
            for key, knob in knobs.items():
                knob.observe(lambda ch, key=key: self.redraw(**{key: ch["new"]}), "value")
            button = w.Button(description="run it", button_style="primary",
                              tooltip="launch the real ranks and draw them over the theory")
            button.on_click(lambda _: self.run())
            self._out = w.Output()
            self._box = w.VBox([w.HBox([*knobs.values(), button]), self._out])
            self._box.add_class("edu3d-controls")
            self._show()
        return self._box

    def _show(self) -> None:
        style.show_in(self._out, self.message, *self.figures)


def _run_refused(panel: Panel, reason: str | None) -> bool:
    if reason:
        panel.message = reason
        panel._show()
    return bool(reason)


# ---- chapter 00: the mesh --------------------------------------------------------------------
class MeshControls(Panel):
    """dp, tp, pp and the group axis -> the cube with its groups; run -> the groups the live
    ranks formed over the prediction."""

    DEFAULT = {"dp": 2, "tp": 2, "pp": 2, "dim": "tp"}
    FIGURES = ("mesh_fig",)

    def __init__(self, default: dict | None = None):
        super().__init__(default)
        self.reports: dict[tuple, list] = {}  # (dp, tp, pp) -> what its live ranks reported
        self.redraw()

    @property
    def layout(self):
        from edu3d.distributed.mesh import Layout

        s = self.state
        return Layout(dp=s["dp"], tp=s["tp"], pp=s["pp"])

    def _key(self) -> tuple:
        return self.state["dp"], self.state["tp"], self.state["pp"]

    def redraw(self, **changes) -> None:
        from edu3d.widgets.mesh3d import mesh_figure

        self.state.update(changes)
        layout = self.layout
        self.mesh_fig = mesh_figure(layout, self.reports.get(self._key()), dim=self.state["dim"])
        self.message = ("" if layout.world_size <= MAX_RUN_RANKS else
                        f"{layout.world_size} ranks: drawn from the formula; the real run is "
                        f"limited to {MAX_RUN_RANKS}")
        self._show()

    def run(self, timeout: float = 120):
        """Launch the layout's ranks; each reports the groups it all-gathered."""
        from edu3d.course import ch00_launching_ranks as demos
        from edu3d.launch import launch
        from edu3d.widgets.mesh3d import agreement, mesh_figure

        layout = self.layout
        if _run_refused(self, None if layout.world_size <= MAX_RUN_RANKS else
                        f"the real run is limited to {MAX_RUN_RANKS} ranks; "
                        f"{layout} has {layout.world_size}"):
            return None
        self.message = f"launching {layout.world_size} ranks as {layout} ..."
        self._show()
        run = launch(demos.mesh_report, layout.world_size, layout=layout, echo=False,
                     timeout=timeout)
        self.result = run
        self.reports[self._key()] = run.results
        same, total = agreement(layout, run.results)
        self.mesh_fig = mesh_figure(layout, run.results, dim=self.state["dim"])
        self.message = (f"{layout.world_size} ranks reported their groups: {same} of {total} "
                        "agree with the prediction")
        self._show()
        return run

    def knobs(self, w) -> dict:
        from edu3d.widgets.mesh3d import DIM_NAMES

        s = self.state
        sizes = [1, 2, 4]
        return {
            "dp": w.Dropdown(options=sorted({*sizes, s["dp"]}), value=s["dp"], description="dp",
                             layout={"width": "130px"}),
            "tp": w.Dropdown(options=sorted({*sizes, s["tp"]}), value=s["tp"], description="tp",
                             layout={"width": "130px"}),
            "pp": w.Dropdown(options=sorted({*sizes, s["pp"]}), value=s["pp"], description="pp",
                             layout={"width": "130px"}),
            "dim": w.Dropdown(options=[(v, k) for k, v in DIM_NAMES.items()], value=s["dim"],
                              description="show"),
        }


def mesh_controls(default: dict | None = None) -> MeshControls:
    """Chapter 00's panel; display ``.widget`` in JupyterLab, or ``.mesh_fig`` without one."""
    return MeshControls(default)


# ---- chapter 01: the ring --------------------------------------------------------------------
SIZES = {"4 KiB": 4 << 10, "64 KiB": 64 << 10, "256 KiB": 256 << 10, "1 MiB": 1 << 20,
         "4 MiB": 4 << 20}
RUN_REPEATS = 3


class RingControls(Panel):
    """N and the message size -> the ring replayed from its plan and priced by alpha-beta;
    run -> edu3d's ring measured step by step over the prediction."""

    DEFAULT = {"n": 4, "size": 1 << 20}
    FIGURES = ("replay_fig", "steps_fig", "cost_fig")

    def __init__(self, default: dict | None = None, alpha: float = cb.ALPHA_S,
                 beta: float = cb.BETA_S_PER_BYTE):
        super().__init__(default)
        self.alpha, self.beta = alpha, beta
        self.measured: dict[tuple, dict] = {}  # (n, size) -> steps and trace of a run
        self.redraw()

    @classmethod
    def from_report(cls, rep: dict, default: dict | None = None) -> "RingControls":
        """Priced with the α and β that ``edu3d bench comm`` fitted for edu3d's ring."""
        row = next(r for r in rep["results"] if "edu3d_alpha_s" in r)
        # a least-squares fit on a noisy machine can come out negative: keep the model causal
        return cls(default, alpha=max(row["edu3d_alpha_s"], 1e-6),
                   beta=max(row["edu3d_beta_s_per_byte"], 1e-12))

    @property
    def numel(self) -> int:
        return max(self.state["size"] // 4, self.state["n"])

    def redraw(self, **changes) -> None:
        from edu3d.widgets.collectives import (alpha_beta_figure, ring_replay_figure,
                                               ring_steps_figure)

        self.state.update(changes)
        n, size = self.state["n"], self.numel * 4
        got = self.measured.get((n, size))
        if got:
            self.replay_fig = ring_replay_figure(got["events"], n, size, case="rep0",
                                                 title=f"Ring all-reduce on {n} ranks, "
                                                       "replayed from the run's trace")
        else:
            self.replay_fig = ring_replay_figure(cb.ring_sends(n, self.numel), n, size,
                                                 title=f"Ring all-reduce on {n} ranks, "
                                                       "replayed from edu3d's ring plan")
        self.steps_fig = ring_steps_figure(
            cb.ring_step_costs(n, self.numel, self.alpha, self.beta), n, size,
            got and got["steps"], alpha=self.alpha, beta=self.beta)
        self.cost_fig = alpha_beta_figure(n, size, alpha=self.alpha, beta=self.beta,
                                          measured_s=got and sum(r["s"] for r in got["steps"]))
        self.message = ""
        self._show()

    def run(self, timeout: float = 120):
        """Run edu3d's ring all-reduce at this N and size and draw it over the prediction."""
        from edu3d.launch import launch

        n, size = self.state["n"], self.numel * 4
        if _run_refused(self, None if n <= MAX_RUN_RANKS else
                        f"the real run is limited to {MAX_RUN_RANKS} ranks"):
            return None
        self.message = f"launching {n} ranks: {RUN_REPEATS} ring all-reduces of {size:,} B ..."
        self._show()
        run = launch(cb.ring_timed, n, kwargs={"numel": self.numel, "repeats": RUN_REPEATS},
                     echo=False, timeout=timeout)
        self.result = run
        events = run.events()
        steps = cb.measured_ring_steps(events, n, RUN_REPEATS)
        self.measured[(n, size)] = {"events": events, "steps": steps}
        self.redraw()
        ok = all(r["equal"] for r in run.results)
        self.message = (f"{n} ranks ran edu3d's ring: result equals dist.all_reduce: {ok}; "
                        f"{sum(r['bytes'] for r in steps):,} B sent in {len(steps)} steps")
        self._show()
        return run

    def knobs(self, w) -> dict:
        s = self.state
        sizes = {**SIZES, **({} if s["size"] in SIZES.values() else {f"{s['size']:,} B":
                                                                        s["size"]})}
        return {
            "n": w.Dropdown(options=sorted({*range(2, MAX_RUN_RANKS + 1), s["n"]}),
                            value=s["n"], description="N ranks", layout={"width": "160px"}),
            "size": w.Dropdown(options=list(sizes.items()), value=s["size"],
                               description="message S"),
        }


def ring_controls(default: dict | None = None, rep: dict | None = None) -> RingControls:
    """Chapter 01's panel, priced with ``rep``'s fitted α-β when given (else
    :data:`edu3d.course.controls_basics.ALPHA_S` and ``BETA_S_PER_BYTE``)."""
    return RingControls.from_report(rep, default) if rep else RingControls(default)


# ---- chapter 02: buckets ---------------------------------------------------------------------
BUCKET_MB = (0.02, 0.05, 0.1, 0.25, 1.0)


class BucketControls(Panel):
    """Bucket size and overlap -> one DP step simulated from the model's parameter sizes;
    run -> the real bucketed step over the simulation."""

    DEFAULT = {"bucket_mb": 0.1, "overlap": True}
    FIGURES = ("timeline_fig",)
    RANKS = 2  # a CPU core each on this machine: the run shows overlap, not contention

    def __init__(self, default: dict | None = None, config=None,
                 costs: cb.StepCosts = cb.StepCosts()):
        from edu3d.course import lesson_args
        from edu3d.train.options import config_from_args

        super().__init__(default)
        self.config = config or config_from_args(lesson_args())
        self.params = cb.backward_sizes(self.config)
        self.costs = costs
        self.measured: dict[tuple, list] = {}  # (bucket_mb, overlap) -> one measured step
        self.redraw()

    def _key(self) -> tuple:
        return self.state["bucket_mb"], self.state["overlap"]

    def redraw(self, **changes) -> None:
        from edu3d.widgets.overlap import bucket_timeline_figure

        self.state.update(changes)
        got = self.measured.get(self._key())
        costs = cb.measured_costs(got, self.costs) if got else self.costs
        self.sim = cb.simulate_dp_step(self.params, self.state["bucket_mb"],
                                       self.state["overlap"], self.RANKS, costs)
        self.timeline_fig = bucket_timeline_figure(self.sim, got,
                                                   bucket_mb=self.state["bucket_mb"],
                                                   reverse=self.state["overlap"])
        self.message = ""
        self._show()

    def run(self, timeout: float = 180):
        """Two real steps of bucketed DP on 2 ranks; the second is drawn over the simulation
        (whose forward and backward take the measured times)."""
        from edu3d.launch import launch

        s = self.state
        self.message = (f"launching {self.RANKS} ranks: bucketed DP, {s['bucket_mb']:g} MB "
                        f"buckets, {'reverse' if s['overlap'] else 'forward'} order ...")
        self._show()
        run = launch(cb.dp_step, self.RANKS, kwargs={"bucket_mb": s["bucket_mb"],
                                                     "reverse": s["overlap"], "steps": 2},
                     echo=False, timeout=timeout)
        self.result = run
        self.measured[self._key()] = cb.step_events(run.events(), 2)
        self.redraw()
        real = run.results[0]["buckets"]
        self.message = (f"ran {self.RANKS} ranks: {len(real)} buckets "
                        f"({'same' if real == self.sim['buckets'] else 'NOT the same'} sizes "
                        "as simulated)")
        self._show()
        return run

    def knobs(self, w) -> dict:
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
