"""Chapter 07's panels: the planner's bytes per pipeline rank, and the auto-tuner's grade.

After reading this file you should know what the knobs change: a model (the course's
presets or a real one), the sequence length, micro-batch size and count, dp/tp/pp, ZeRO
stage, recomputation, precision, schedule and the GPU's memory redraw the estimate at once
(:func:`edu3d.plan.estimate.estimate`, drawn by :func:`edu3d.widgets.memory_plan.stage_bars`);
"measure it" launches the tiny model in the chosen layout
(:func:`edu3d.course.ch07_memory_plan.run`, 8 ranks at most, fp32) and puts the measured bars
beside the estimate. Without a frontend (nbval, exported HTML) the default figure is drawn
statically (:attr:`Controls.figure`).

:class:`TuneControls` redraws a recorded ``edu3d tune`` report
(:mod:`edu3d.course.ch07_memory_tune`, drawn by :func:`edu3d.widgets.tuning.tune_figure`):
the metric (step time or peak memory), the view (values or ranks) and one candidate to
single out, whose prediction by part and measurement the message spells out; "tune again"
runs the tuning live and redraws from the new report.

:class:`TimelineControls` picks one recorded training step from the chapter's sweep
(:func:`edu3d.course.ch07_memory_timeline.sweep`): ZeRO stage, micro-batches, recomputation
and ZeRO-2/3's gradient reduction redraw it at once
(:func:`edu3d.widgets.memory_timeline.step_memory_figure`; **x** time or event index, **rank**
the fullest or either one); a setting the sweep did not record says so, and "record it"
runs it live on 2 ranks and keeps it.
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch07_memory_timeline as timeline
from edu3d.course import ch07_memory_tune as tuning
from edu3d.course.ch07_memory_plan import options, run
from edu3d.model.shapes import PRESETS, spec_from
from edu3d.plan.estimate import setup, estimate, spec_of, validate
from edu3d.launch.api import LaunchError
from edu3d.widgets.memory_plan import stage_bars
from edu3d.widgets.memory_timeline import step_memory_figure
from edu3d.widgets.tuning import VIEWS, tune_figure
from edu3d.widgets.panels.panel import MAX_RUN_RANKS, Panel

DEFAULT = dict(model="tiny", seq=0, micro_batch=2, microbatches=2, dp=2, tp=1, pp=2,
               zero=1, recompute="none", precision="fp32", schedule="1f1b", sp=False,
               gpu_mem_gb=0.01)


class Controls(Panel):
    """Knobs for a model and a layout that redraw the planner's estimate; "measure it"
    runs the tiny model in that layout and draws what every rank held beside it."""

    button = "measure it"
    knob_rows = (("model", "seq", "micro_batch", "microbatches"), ("dp", "tp", "pp", "zero"),
                 ("recompute", "precision", "schedule", "sp", "gpu_mem_gb"))
    FIGURES = ("figure",)

    def __init__(self, default: dict | None = None):
        super().__init__({**DEFAULT, **(default or {})})
        self.measured = None
        self.figure = None
        self.redraw()

    #: the knobs whose values depend on the model (heads, layers): offered only where valid
    BOUNDED = {"tp": (1, 2, 4, 8), "pp": (1, 2, 4, 8, 16)}
    SEQS = (32, 64, 128, 1024, 2048, 4096, 8192)

    def setup(self, state: dict | None = None):
        """``(spec, setup)`` of the current choice, or of ``state`` (``ValueError`` when it
        cannot work)."""
        s = state or self.state
        spec = spec_from(s["model"], seq_len=s["seq"] or None)
        st = setup(dp=s["dp"], tp=s["tp"], pp=s["pp"], zero=s["zero"] if s["dp"] > 1 else 0,
                   microbatches=s["microbatches"], micro_batch=s["micro_batch"],
                   schedule=s["schedule"], sp=s["sp"] and s["tp"] > 1,
                   recompute=s["recompute"], precision=s["precision"])
        validate(spec, st)
        return spec, st

    def allowed(self, key: str) -> list:
        """The values of ``key`` that work with the other knobs as they are (the model's
        heads bound tp, its layers pp)."""
        out = []
        for v in self.BOUNDED[key]:
            try:
                self.setup({**self.state, key: v})
                out.append(v)
            except ValueError:
                pass
        return out

    def bound(self) -> None:
        """Keep tp and pp to the values the model allows: a value that can never work is not
        offered, and one the new model refuses becomes the largest allowed below it."""
        for key in self.BOUNDED:
            ok = self.allowed(key) or [1]
            if self.state[key] not in ok:
                self.state[key] = max([v for v in ok if v <= self.state[key]] or ok[:1])
            knob = self._knobs.get(key)
            if knob is not None and list(knob.options) != ok:
                self._syncing = True
                try:
                    knob.options = ok
                    knob.value = self.state[key]
                finally:
                    self._syncing = False

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        self.measured = None
        self.bound()
        s, notes = self.state, []
        try:
            spec, st = self.setup()
            self.estimate = estimate(spec, st)
        except ValueError as err:
            # ZB-H1 sends micro-batches in groups of pp: snap to the next group, else say why
            m = -(-s["microbatches"] // s["pp"]) * s["pp"]
            try:
                spec, st = self.setup({**s, "microbatches": m})
                self.estimate = estimate(spec, st)
            except ValueError:
                self.figure = None
                self.say(str(err))
                return
            notes.append(f"{s['schedule']} runs micro-batches in groups of pp: "
                         f"{s['microbatches']} -> {m}")
            s["microbatches"] = m
            if self._knobs:
                self._knobs["microbatches"].max = max(self._knobs["microbatches"].max, m)
            self.sync_knobs()
        notes += [n for n, on in (("dp=1: ZeRO has nothing to shard", s["zero"] and st.layout.dp == 1),
                                  ("SP needs tp > 1", s["sp"] and st.layout.tp == 1)) if on]
        self.figure = stage_bars(
            self.estimate, gpu_mem_gb=s["gpu_mem_gb"],
            title=f"{spec.name}: dp={st.layout.dp} tp={st.layout.tp} pp={st.layout.pp} ZeRO-{s['zero']}"
                  f"{' SP' if s['sp'] else ''}, {st.microbatches}x{st.micro_batch} seq "
                  f"{spec.seq_len}, {st.memory.recompute} recompute, {st.precision.dtype}",
            takeaway="; ".join(notes) or None)
        self.say("")

    @property
    def valid(self) -> bool:
        """Whether the current choice can work (else :attr:`message` says why)."""
        return self.figure is not None

    def argv(self) -> list[str]:
        """``edu3d train``'s options for the current layout on the tiny model (fp32)."""
        s, (_, st) = self.state, self.setup()
        out = ["--model", "tiny", "--dp", str(st.layout.dp), "--tp", str(st.layout.tp), "--pp", str(st.layout.pp),
               "--zero", str(st.parallel.zero), "--microbatches", str(st.microbatches),
               "--global-batch", str(st.batch.global_batch), "--schedule", st.parallel.schedule,
               "--recompute", st.memory.recompute]
        if s["seq"]:
            out += ["--seq", str(s["seq"])]
        return out + (["--sp"] if st.parallel.sp else [])

    def problem(self) -> str | None:
        """Why "measure it" cannot run the current choice (None if it can)."""
        s = self.state
        if s["model"] != "tiny" or s["precision"] != "fp32":
            return "measure it runs the tiny model in fp32: choose model tiny, precision fp32"
        if s["dp"] * s["tp"] * s["pp"] > MAX_RUN_RANKS:
            return f"the real run is limited to {MAX_RUN_RANKS} ranks"
        try:
            options(self.argv())
        except (ValueError, SystemExit) as err:
            return f"this layout cannot run: {err}"
        return None

    def run(self, timeout: float = 300):
        """Launch the tiny model in the current layout; draw the measured bytes (the fullest
        rank of each pipeline stage, after one step) beside the planner's, at rest."""
        s = self.state
        if self.refuse(self.problem()):
            return None
        argv = self.argv()
        self.say(f"running {s['dp'] * s['tp'] * s['pp']} ranks ...")
        ranks = run(argv, timeout)
        planned = options(argv)
        rest = estimate(spec_of(planned), planned, at="rest")
        measured: dict[int, dict] = {}
        for r in ranks:
            pp = r["coord"][0]
            if pp not in measured or sum(r["bytes"].values()) > sum(measured[pp].values()):
                measured[pp] = r["bytes"]
        self.measured = self.result = measured
        self.figure = stage_bars(
            rest, measured, gpu_mem_gb=s["gpu_mem_gb"],
            title="Measured (solid) beside the planner (hatched), after one step",
            takeaway="Weights, gradients and optimizer state to the byte; activations are "
                     "the step's peak, within a few bytes.")
        self.say(f"measured {len(ranks)} ranks")
        return measured

    def knobs(self) -> dict:
        s = self.state
        return {
            "model": w.Dropdown(options=list(PRESETS), value=s["model"], description="model"),
            # 0 is the preset's length (None would read as "no selection" and show empty)
            "seq": w.Dropdown(options=[("preset", 0), *((str(n), n) for n in self.SEQS)],
                              value=s["seq"] or 0, description="sequence"),
            "micro_batch": w.Dropdown(options=[1, 2, 4, 8], value=s["micro_batch"],
                                      description="micro-batch"),
            "microbatches": w.IntSlider(min=1, max=16, value=s["microbatches"],
                                        description="micro-batches"),
            "dp": w.Dropdown(options=[1, 2, 4, 8, 16, 32, 64], value=s["dp"], description="dp"),
            "tp": w.Dropdown(options=self.allowed("tp"), value=s["tp"], description="tp"),
            "pp": w.Dropdown(options=self.allowed("pp"), value=s["pp"], description="pp"),
            "zero": w.IntSlider(min=0, max=3, value=s["zero"], description="ZeRO"),
            "recompute": w.Dropdown(options=["none", "selective", "full"],
                                    value=s["recompute"], description="recompute"),
            "precision": w.Dropdown(options=["fp32", "bf16", "fp16"], value=s["precision"],
                                    description="precision"),
            "schedule": w.Dropdown(options=["gpipe", "1f1b", "zb-h1"], value=s["schedule"],
                                   description="schedule"),
            "sp": w.Checkbox(value=s["sp"], description="sequence parallel"),
            "gpu_mem_gb": w.FloatLogSlider(value=s["gpu_mem_gb"], base=10, min=-3, max=2.3,
                                           description="GPU GB"),
        }


def controls(default: dict | None = None) -> Controls:
    """The chapter's planner controls; display ``controls().widget`` in JupyterLab, or the
    static ``figure`` without a frontend."""
    return Controls(default)


class TuneControls(Panel):
    """A recorded tuning, redrawn: the metric, the view, one candidate singled out; the
    button tunes again (live) and redraws from the new report."""

    title = "The auto-tuner: the planner's prediction against the clock"
    button = "tune again"
    tooltip = "run every candidate again on 2 ranks (about 20 s) and redraw"
    # the view's two buttons side by side: in one row with both dropdowns and the button
    # the row ran out of width and the toggle, the only item that shrinks, stacked them
    knob_rows = (("metric", "view"), ("candidate", "run"))
    FIGURES = ("figure",)

    def __init__(self, report: dict, default: dict | None = None):
        # "" is no candidate (ipywidgets reads a None value as no selection: an empty box)
        super().__init__({"metric": "step time", "view": "values", "candidate": "",
                          **(default or {})})
        self.report = report
        self.figure = None
        self.redraw()

    def labels(self) -> list[str]:
        return [c["label"] for c in self.report["candidates"] if "measured" in c]

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        if s["candidate"] not in self.labels():
            s["candidate"] = ""
        pts = tuning.points(self.report, s["metric"])
        self.figure = tune_figure(pts, s["view"], s["candidate"] or None)
        self.say(tuning.describe(self.report, s["candidate"]) if s["candidate"] else
                 f"winner: {pts['winner']}; misranked most on {s['metric']}: "
                 f"{pts['misranked']}")

    def run(self):
        """Tune again, live, at the chapter's size; redraw from the new report."""
        self.say("tuning: every candidate on 2 ranks, one after another ...")
        try:
            self.report = self.result = tuning.run()
        except ValueError as err:
            self.say(f"the tuning could not run: {err}")
            return None
        if self._knobs:
            self._knobs["candidate"].options = [("none", ""), *((c, c) for c in self.labels())]
        self.redraw()
        return self.report

    def knobs(self) -> dict:
        s = self.state
        return {
            "metric": w.Dropdown(options=list(tuning.METRICS), value=s["metric"],
                                 description="metric"),
            "view": w.ToggleButtons(options=list(VIEWS), value=s["view"], description="view",
                                    style={"button_width": "70px"},
                                    layout={"flex": "0 0 auto"}),
            "candidate": w.Dropdown(options=[("none", ""), *((c, c) for c in self.labels())],
                                    value=s["candidate"], description="candidate",
                                    layout={"width": "420px"}),
        }


def tune_controls(report: dict, default: dict | None = None) -> TuneControls:
    """The chapter's tuning controls over ``report``; ``tune_controls(r).widget`` in
    JupyterLab, the static ``figure`` without a frontend."""
    return TuneControls(report, default)


# ---- one step's memory as a timeline (section 9) -------------------------------------------
TIMELINE_DEFAULT = dict(zero=0, microbatches=1, recompute="none", grad_reduce="per-microbatch",
               x="time", rank="fullest")


class TimelineControls(Panel):
    """Knobs over a sweep of recorded steps; the button records the current setting live."""

    title = "One training step's memory, recorded live (tiny model, dp=2)"
    button = "record it"
    tooltip = "record this setting's step on 2 ranks (a few seconds) and draw it"
    FIGURES = ("figure",)

    def __init__(self, docs: dict, default: dict | None = None):
        super().__init__({**TIMELINE_DEFAULT, **(default or {})})
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
        rank = self.state["rank"]  # "fullest": a Dropdown shows a None value as a blank
        self.figure = step_memory_figure(doc, None if rank == "fullest" else rank,
                                         self.state["x"])
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
            "rank": w.Dropdown(options=[("fullest", "fullest"), ("rank 0", 0), ("rank 1", 1)],
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
