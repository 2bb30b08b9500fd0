"""Chapter 11's quiz panel: pick a review question, see its picture, turn its knobs.

After reading this file you should know how the quiz panel works: the first knob picks a
question of :data:`edu3d.course.ch11_review.BANK` and sets the other knobs to that question's
case; :func:`picture` draws the picture of the current knobs (the charts of
:mod:`edu3d.widgets.review`, the planner's ranking from :func:`edu3d.course.ch11_review.plan`,
the bubble curve from :func:`edu3d.course.ch05_pipeline_parallel.pp_bubble_curve`, DDP's step
simulated as chapter 02 does, :func:`edu3d.course.ch02_data_parallel.simulate_dp_step`); "measure
it" launches the tiny GPT on the CPU for the pipeline and ZeRO pictures
(:func:`edu3d.course.ch06_3d_parallelism.capstone`) and draws the measurement over the theory.
:func:`question_picture` is the picture the chapter shows under a question (each question's
``subject`` is what its picture's title says). Every position of every knob draws a picture: a number
of micro-batches the chosen schedule cannot build on p stages (interleaved and ZB-H1 group
them by p, :func:`edu3d.course.ch05_pipeline_parallel.pp_problem`) moves the slider to the
nearest one it can (:func:`buildable_m`), and the panel says why.
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import lesson_args
from edu3d.course.ch02_data_parallel import backward_sizes, simulate_dp_step
from edu3d.course.ch05_pipeline_parallel import pp_bubble_curve, pp_problem
from edu3d.course.ch06_3d_parallelism import capstone, memory_estimate
from edu3d.course.ch11_review import BANK, plan, tp_all_reduces, zero_traffic_gb
from edu3d.config.layout import Layout
from edu3d.schedules.simulate import bubble_of
from edu3d.train.preflight import model_config
from edu3d.widgets.panels.panel import Panel, choices
from edu3d.widgets.overlap import bucket_timeline_figure
from edu3d.widgets import style
from edu3d.widgets.pipeline import bubble_figure
from edu3d.widgets.review import (activations_figure, in_flight_figure, layout_figure,
                                  ring_figure, tp_figure, zero_figure, zero_measured_figure,
                                  zero_traffic_figure)
from edu3d.widgets.threed import pipeline_view

PICTURES = ("ring", "ddp", "zero", "zero_traffic", "activations", "tp", "bubble", "in_flight",
            "layout")
MODELS = ("gpt2-xl", "llama2-7b", "llama2-13b", "llama2-70b", "gpt3-175b")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
STATE = ("params", "grads", "optimizer")
# the pictures each knob changes: under any other picture the knob is greyed out (a knob that
# redraws nothing would tell the learner it does not matter when it simply does not apply)
USED_BY = {"schedule": ("bubble", "in_flight"), "pp": ("bubble", "in_flight"),
           "m": ("bubble", "in_flight"), "n": ("ring", "ddp", "zero", "zero_traffic"),
           "model": ("zero", "zero_traffic", "activations", "tp", "layout"),
           "gpus": ("tp", "layout")}
#: the bucket size of DDP's picture (chapter 02's panel's default)
DDP_BUCKET_MB = 0.1
#: DDP's picture draws this many ranks' lanes: every rank's step is the same
DDP_LANES = 2
DEFAULT = {"question": "bubble_1f1b", "picture": "bubble", "schedule": "1f1b", "pp": 4, "m": 8,
           "n": 8, "model": "llama2-7b", "gpus": 16}


# ---- the pictures ------------------------------------------------------------------------------
def tp_picture(model: str = "llama2-7b", gpus: int = 16):
    """The fastest layout at each TP degree for ``model`` on ``gpus`` GPUs (the planner's)."""
    return tp_figure(plan(model, gpus), model, gpus, tp_all_reduces())


def ddp_picture(n: int = 8, bucket_mb: float = DDP_BUCKET_MB):
    """What DDP communicates, and when: one step of the tiny GPT over ``n`` data-parallel
    ranks, simulated as chapter 02 simulates edu3d's bucketed DDP
    (:func:`edu3d.course.ch02_data_parallel.simulate_dp_step`), the first ranks' lanes."""
    sim = simulate_dp_step(backward_sizes(model_config(lesson_args())), bucket_mb, True, n)
    shown = min(n, DDP_LANES)
    sim = {**sim, "events": [e for e in sim["events"] if e["rank"] < shown]}
    # the takeaway under it counts the buckets and those launched during the backward
    title = (f"What DDP communicates, and when: its gradients, over {style.plural(n, 'rank')}"
             + (f" ({shown} drawn)" if shown < n else ""))
    return bucket_timeline_figure(sim, bucket_mb=bucket_mb, reverse=True, title=title)


def zero_traffic_picture(model: str = "llama2-7b", n: int = 8):
    """What one rank sends per step under each ZeRO stage (the planner's count)."""
    return zero_traffic_figure(zero_traffic_gb(model, n), model, n)


def layout_picture(model: str = "llama2-13b", gpus: int = 16):
    """The planner's fastest fitting layouts for ``model`` on ``gpus`` GPUs."""
    return layout_figure(plan(model, gpus), model, gpus)


def bubble_picture(schedule: str = "1f1b", pp: int = 4, m: int = 8,
                   measured: float | None = None):
    """The simulated bubble against the micro-batches (1 to 32, or m), over the formula;
    interleaved with 2 chunks per rank."""
    curve = pp_bubble_curve(schedule, pp, chunks(schedule), tuple(range(1, max(32, m) + 1)))
    return bubble_figure(curve, schedule, pp, m, chunks(schedule), measured)


def chunks(schedule: str) -> int:
    """Chunks per rank the quiz gives a schedule: interleaved 2, the others 1."""
    return 2 if schedule == "interleaved" else 1


def buildable_m(schedule: str, pp: int, m: int, most: int = 64) -> int:
    """The number of micro-batches nearest ``m`` (the larger on a tie) that ``schedule`` can
    build on ``pp`` stages."""
    ok = [k for k in range(1, most + 1) if pp_problem(schedule, pp, k, chunks(schedule)) is None]
    return min(ok, key=lambda k: (abs(k - m), -k))


def in_flight_picture(schedule: str = "1f1b", pp: int = 4, m: int = 8):
    """Micro-batches kept alive per pipeline rank under GPipe, 1F1B and ``schedule`` (those
    that can run ``m`` micro-batches on ``pp`` ranks)."""
    names = [s for s in dict.fromkeys(["gpipe", "1f1b", schedule])
             if pp_problem(s, pp, m, chunks(s)) is None]
    return in_flight_figure(pp, m, names)


def picture(state: dict):
    """The figure of the panel's current ``state``."""
    kind = state["picture"]
    if kind == "ring":
        return ring_figure(state["n"])
    if kind == "ddp":
        return ddp_picture(state["n"])
    if kind == "zero":
        return zero_figure(state["model"], state["n"])
    if kind == "zero_traffic":
        return zero_traffic_picture(state["model"], state["n"])
    if kind == "activations":
        return activations_figure(state["model"])
    if kind == "tp":
        return tp_picture(state["model"], state["gpus"])
    if kind == "bubble":
        return bubble_picture(state["schedule"], state["pp"], state["m"])
    if kind == "in_flight":
        return in_flight_picture(state["schedule"], state["pp"], state["m"])
    if kind == "layout":
        return layout_picture(state["model"], state["gpus"])
    raise ValueError(f"unknown picture {kind!r}; choose one of {', '.join(PICTURES)}")


def question_picture(key: str):
    """The picture of question ``key`` at its own case (what the quiz draws when it is picked)."""
    return picture({**DEFAULT, **BANK[key].picture})


# ---- the panel ---------------------------------------------------------------------------------
class Controls(Panel):
    """"Quiz me": pick a question, see its picture, turn its knobs; "measure it" runs the
    tiny GPT for the pipeline and ZeRO pictures."""

    button = "measure it"
    tooltip = "run the tiny GPT on the CPU and draw it over the theory"
    knob_rows = (("question", "run"), ("schedule", "pp", "m"), ("n", "model", "gpus"))
    FIGURES = ("figure",)

    def __init__(self, default: dict | None = None):
        question = (default or DEFAULT).get("question", "bubble_1f1b")
        super().__init__({**DEFAULT, **BANK[question].picture, **(default or {})})
        self.bank = BANK
        self.figure = None
        self.redraw()

    def applies(self, key: str) -> bool:
        """Whether knob ``key`` changes the current question's picture."""
        return key not in USED_BY or self.state["picture"] in USED_BY[key]

    def problem(self) -> str | None:
        """Why the current pipeline picture cannot be drawn (None if it can)."""
        s = self.state
        if s["picture"] in ("bubble", "in_flight"):
            return pp_problem(s["schedule"], s["pp"], s["m"], chunks(s["schedule"]))
        return None

    def redraw(self, **changes) -> None:
        if "question" in changes and changes["question"] != self.state["question"]:
            changes = {**self.bank[changes["question"]].picture, **changes}
        self.state.update(changes)
        self.result = None
        q = self.bank[self.state["question"]]
        s, moved = self.state, None
        if s["picture"] in ("bubble", "in_flight") and self.problem():
            wanted, s["m"] = s["m"], buildable_m(s["schedule"], s["pp"], s["m"])
            moved = (f"{s['schedule']} on p = {s['pp']} stages cannot build m = {wanted} "
                     f"micro-batches (it groups them by p): drawn at m = {s['m']}")
        self.figure = picture(s)
        self.sync_knobs()
        for key, knob in self._knobs.items():
            knob.disabled = not self.applies(key)
        self.say(moved or f"{q.title[:3].strip()} · {q.topic}: see notebooks/{q.chapter}")

    def run(self, timeout: float = 300):
        """Run the tiny GPT for the current picture and draw it over the theory."""
        s = self.state
        if s["picture"] == "bubble":
            return self._measure_bubble(timeout)
        if s["picture"] == "zero":
            return self._measure_zero(timeout)
        self.say(f"the {s['picture']} picture is edu3d's estimate at real sizes; pick a "
                 "pipeline-bubble or ZeRO question to measure a run")
        return None

    def _measure_bubble(self, timeout: float):
        s = self.state
        vpp = chunks(s["schedule"])
        # the tiny GPT has 4 layers and a global batch of 8: p*v <= 4 and m divides 8
        pp = 2 if s["pp"] < 4 or vpp > 1 else 4
        m = max(k for k in (1, 2, 4, 8) if k <= max(s["m"], pp) and k % (pp if vpp > 1 else 1)
                == 0)
        self.say(f"running pp={pp}, m={m} on {pp} ranks ...")
        layout = Layout(pp=pp, vpp=vpp)
        run = self.launch(capstone, pp, kwargs={"steps": 2, "zero": 0, "microbatches": m,
                                                "schedule": s["schedule"], "vpp": vpp},
                          layout=layout, timeout=timeout)
        if run is None:
            return None
        events = [e for e in pipeline_view(run.events(), layout) if e.get("step") == 2]
        self.result = bubble_of(events)
        self.state.update(pp=pp, m=m)
        self.sync_knobs()
        self.figure = bubble_picture(s["schedule"], pp, m, self.result)
        self.say(f"measured on {pp} CPU ranks: bubble {self.result:.1%} (message "
                 "latency and Python overhead add to the theory)")
        return self.result

    def _measure_zero(self, timeout: float):
        dp = min(max(self.state["n"], 2), 4)
        config = model_config(lesson_args())
        rows = []
        for zero in range(4):
            self.say(f"running dp={dp} ZeRO-{zero} ...")
            run = self.launch(capstone, dp, kwargs={"steps": 1, "zero": zero,
                                                    "microbatches": 1},
                              layout=Layout(dp=dp), timeout=timeout)
            if run is None:
                return None
            mem = next(r["memory"] for r in run.results if r["rank"] == 0)
            est = memory_estimate(config, dp, 1, 1, zero, 1)[0]
            rows.append({"zero": zero, "dp": dp, "measured": sum(mem[c] for c in STATE),
                         "estimate": sum(est[c] for c in STATE)})
        self.result = rows
        self.figure = zero_measured_figure(rows)
        self.say(f"measured on {dp} CPU ranks, the tiny GPT in fp32 (4 + 4 + 8 bytes)")
        return rows

    def knobs(self) -> dict:
        knobs = self._knobs_at(self.state, self.bank)
        for key, knob in knobs.items():
            knob.disabled = not self.applies(key)
        return knobs

    @staticmethod
    def _knobs_at(s: dict, bank: dict) -> dict:
        return {
            "question": w.Dropdown(options=[(q.title, q.key) for q in bank.values()],
                                   value=s["question"], description="question",
                                   layout={"width": "460px"}),
            "schedule": w.Dropdown(options=list(SCHEDULES), value=s["schedule"],
                                   description="schedule"),
            "pp": w.IntSlider(min=2, max=8, value=s["pp"], description="stages p"),
            "m": w.IntSlider(min=1, max=64, value=s["m"], description="micro-batches"),
            "n": w.Dropdown(options=choices([1, 2, 4, 8, 16, 32, 64], s["n"]), value=s["n"],
                            description="ranks N"),
            "model": w.Dropdown(options=choices(MODELS, s["model"]), value=s["model"],
                                description="model"),
            "gpus": w.Dropdown(options=choices([8, 16, 32, 64], s["gpus"]), value=s["gpus"],
                               description="GPUs"),
        }


def controls(default: dict | None = None) -> Controls:
    """The review's quiz panel; display ``controls().widget`` in JupyterLab, or show the
    static ``figure`` without a frontend."""
    return Controls(default)
