"""Chapter 10's panel: a layout's step budget, predicted at once, then measured.

After reading this file you should know what the knobs change: the layout, DP overlap and
the micro-batches redraw the performance model's predicted step budget on this machine's
calibrated profile (:func:`edu3d.course.ch10_performance_predict.predict`, on
:func:`edu3d.plan.step.predict`: compute, exposed communication, bubble) and
every layout's predicted step, at once, for every position of every knob; choosing a layout
sets the micro-batches to the number the chapter gives it. "run it" measures the layout live
(:func:`edu3d.course.ch10_performance.run_layout`) and draws the measurement over the
prediction; it refuses only a micro-batch count the trainer cannot split the batch into,
and says which counts it can
(:func:`edu3d.course.ch10_performance.runnable_microbatches`).
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch10_performance_live as watched
from edu3d.course import lesson_args
from edu3d.course.ch10_performance import (LAYOUTS, default_microbatches, run_layout,
                                            runnable_microbatches)
from edu3d.course.ch10_performance_predict import predict
from edu3d.launch.runs import new_run_dir
from edu3d.widgets import style
from edu3d.widgets.panels.panel import Panel
from edu3d.widgets.perf import bar_length, budget_figure, prediction_figure


class Controls(Panel):
    """Layout, overlap and micro-batches -> the cost model's predicted step budget at once;
    "run it" measures the layout live and draws it over the prediction.

    ``costs`` calibrates the model to this machine (:func:`edu3d.course.ch10_performance.
    calibrate`, :func:`edu3d.course.ch10_performance_predict.profile_for`);
    ``measured`` maps a layout name to its measured step (ms) from the chapter's sweep."""

    KNOB_LAYOUTS = ("dp1", "dp2", "tp2", "pp2", "dp4", "dp2-tp2", "dp2-pp2", "tp2-pp2")
    knob_rows = (("layout", "overlap"), ("microbatches",))
    FIGURES = ("budget_fig", "layouts_fig")

    def __init__(self, costs: dict | None = None, measured: dict | None = None,
                 default: dict | None = None):
        state = {"layout": "dp2", "overlap": "on", **(default or {})}
        state.setdefault("microbatches", default_microbatches(state["layout"]))
        super().__init__(state)
        self.costs, self.measured = costs, dict(measured or {})
        self.live: dict | None = None
        self.redraw()

    def prediction(self, name: str | None = None) -> dict:
        s = self.state
        p = predict(name or s["layout"], s["overlap"],
                    s["microbatches"] if name in (None, s["layout"]) else None, self.costs)
        return {**p, "idle": p["bubble"]}

    def redraw(self, **changes) -> None:
        if changes.get("layout", self.state["layout"]) != self.state["layout"]:
            changes.setdefault("microbatches", default_microbatches(changes["layout"]))
        self.state.update(changes)
        s = self.state
        self.sync_knobs()
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
            takeaway=f"predicted {bar_length(self.predicted):.1f} ms per step on "
                     f"{style.plural(self.predicted['cores'], 'core')}"
                     + (f"; measured {bar_length(self.live['budget']):.1f} ms" if live else
                        f"; {self.run_problem() or 'press run it to measure'}"))
        self.layouts_fig = prediction_figure(preds, s["layout"], self.measured)
        self.show()

    def run_problem(self) -> str | None:
        """Why a live run of the current knobs cannot go (None if it can): only the
        micro-batches can be wrong, and the message names that knob."""
        s = self.state
        ok = runnable_microbatches(s["layout"])
        if s["microbatches"] in ok:
            return None
        dp, batch = LAYOUTS[s["layout"]][0], lesson_args().batch.global_batch
        share = f"{batch // dp} of the {batch} sequences" if dp > 1 else f"{batch} sequences"
        return (f"a live {s['layout']} run splits its {share} per data-parallel rank into "
                f"{', '.join(map(str, ok))} micro-batches, not {s['microbatches']}: set "
                "micro-batches to one of those to run it")

    def run(self, steps: int = 3, timeout: float = 300):
        """Measure the chosen layout live and draw it over the prediction."""
        s = self.state
        if self.refuse(self.run_problem()):
            return None
        self.say(f"running {s['layout']} ...")
        row, budget = run_layout(s["layout"], s["overlap"], s["microbatches"], steps, timeout)
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
            "microbatches": w.IntSlider(min=1, max=8, value=s["microbatches"],
                                        description="micro-batches",
                                        style={"description_width": "initial"}),
        }


def controls(costs: dict | None = None, measured: dict | None = None,
             default: dict | None = None) -> Controls:
    """The chapter's control panel; display ``controls(...).widget`` in JupyterLab, or the
    static ``budget_fig`` / ``layouts_fig`` without a frontend."""
    return Controls(costs, measured, default)


class Straggler(Panel):
    """Which rank is slow and by how much -> every rank's step predicted at once from the
    chapter's recorded run (:func:`edu3d.course.ch10_performance_live.predict`); "run it"
    trains dp2 with that straggler and draws the measurement over the prediction."""

    # -1 is "no straggler": ipywidgets reads a None value as "nothing selected" and shows an
    # empty box (``key()`` turns it back into None for the prediction and the run)
    RANKS = (("no straggler", -1), ("rank 0", 0), ("rank 1", 1))
    SECONDS = (0.05, 0.1, 0.2, 0.4)
    FIGURES = ("straggler_fig",)

    def __init__(self, records: list[dict], slow_rank: int | None = 1, seconds: float = 0.2):
        super().__init__({"slow_rank": -1 if slow_rank is None else slow_rank,
                          "seconds": seconds})
        self.records, self.recorded = records, (slow_rank, seconds)
        self.live: dict | None = None
        self.redraw()

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        key = self.key()
        pred = watched.predict(self.records, *self.recorded, *key)
        rows = {f"rank {r} (predicted)": b for r, b in pred.items()}
        live = bool(self.live) and self.live["key"] == key
        if live:
            rows.update({f"rank {r} (measured)": b for r, b in self.live["budget"].items()})
        who = "no straggler" if key[0] is None else f"rank {key[0]} sleeping {key[1]:g} s"
        step = max(bar_length(b) for b in pred.values())
        waits = [r for r, b in pred.items() if b["comm"] > 0.5 * b["step"]]
        self.straggler_fig = budget_figure(
            rows, ghosts=tuple(n for n in rows if n.endswith("(predicted)")) if live else (),
            title=f"dp2 with {who}: each rank's step, its own work and its time in the "
                  "all-reduce",
            takeaway=f"predicted step {step:.0f} ms for every rank; "
                     + (f"rank {', '.join(map(str, waits))} waits most of it"
                        if waits else "nobody waits long")
                     + (f"; measured {max(map(bar_length, self.live['budget'].values())):.0f}"
                        " ms" if live else "; press 'run it' to measure"))
        self.show()

    def key(self) -> tuple:
        """``(slow rank or None, seconds)``: the state, with the dropdown's -1 as None."""
        rank = self.state["slow_rank"]
        return (None if rank == -1 else rank, self.state["seconds"])

    def run(self, steps: int = 6, timeout: float = 120):
        """Train dp2 with the chosen straggler and draw the measurement over the prediction."""
        key = self.key()
        self.say("training dp2 for a few steps ...")
        records = watched.slow_rank_run(new_run_dir("ch10-straggler"), key[0], key[1], steps,
                                        timeout)
        if len(records) < 2:
            return self.refuse("the run left no status records: run it again")
        self.live = self.result = {"key": key, "budget": watched.budget(records)}
        slowest = watched.verdict(records, key[1])["slowest"]
        self.message = f"measured: the monitor's slowest rank is {slowest}"
        self.redraw()
        return self.live

    def knobs(self) -> dict:
        s = self.state
        return {
            "slow_rank": w.Dropdown(options=list(self.RANKS), value=s["slow_rank"],
                                    description="straggler"),
            "seconds": w.Dropdown(options=[(f"{x:g} s", x) for x in self.SECONDS],
                                  value=s["seconds"], description="its sleep"),
        }


def straggler_controls(records: list[dict], slow_rank: int | None = 1,
                       seconds: float = 0.2) -> Straggler:
    """Section 7's panel, predicted from ``records`` (a run with ``slow_rank`` sleeping
    ``seconds``); display ``.widget`` in JupyterLab, or the static ``straggler_fig``."""
    return Straggler(records, slow_rank, seconds)
