"""Chapter 12's panels: the capacity factor against dropped tokens and the loss, and the
expert-parallel degree against the all-to-all's token matrix and timeline.

After reading this file you should know what the knobs change:

* :class:`CapacityControls`: the capacity factor picks one of the recorded runs
  (:func:`edu3d.course.ch12_mixture_of_experts.capacity_runs`) and redraws its dropped
  share and loss over the dropless run at once, with the capacity ``ceil(T·k/E · C)``
  printed; "run it" retrains the chosen factor now (in this process, a few seconds);
* :class:`ExpertParallelControls`: ``ep`` picks one of the recorded expert-parallel runs
  and redraws its rank-to-rank token matrix and one step's timeline; "run it" launches that
  degree again (``ep`` ranks).
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch12_mixture_of_experts as moe
from edu3d.widgets.experts import capacity_chart, token_matrix
from edu3d.widgets.panels.panel import Panel
from edu3d.widgets.timeline import step_events, timeline_figure

EP_OPS = ("F", "B", "optimizer", "counts", "dispatch", "combine", "combine (bwd)",
          "dispatch (bwd)", "all_reduce", "broadcast")


def capacity_series(runs: dict[float, list[dict]], tokens: int, k: int) -> dict:
    """``{factor: {"dropped_pct", "loss"}}`` per step from the runs' records."""
    return {c: {"dropped_pct": [100 * r["dropped"] / (tokens * k) for r in recs],
                "loss": [r["loss"] for r in recs]} for c, recs in runs.items()}


class CapacityControls(Panel):
    """A capacity-factor slider over recorded runs; "run it" retrains the chosen factor."""

    FIGURES = ("figure",)
    tooltip = "train the chosen capacity factor again, now"

    def __init__(self, runs: dict[float, list[dict]], tokens: int, k: int, experts: int,
                 chosen: float = 1.0):
        super().__init__({"factor": chosen})
        self.runs, self.tokens, self.k, self.experts = dict(runs), tokens, k, experts
        self.figure = None
        self.redraw()

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        c = self.state["factor"]
        series = capacity_series(self.runs, self.tokens, self.k)
        run = series[c]
        cap = moe.capacity(self.tokens, self.k, self.experts, c) if c else None
        lost = sum(run["dropped_pct"]) / len(run["dropped_pct"])
        gap = run["loss"][-1] - series[0.0]["loss"][-1] if 0.0 in series else 0.0
        room = (f"each expert keeps at most ceil({self.tokens}·{self.k}/{self.experts}·{c:g}) "
                f"= {cap} of {self.tokens * self.k} assignments" if cap else "dropless")
        self.figure = capacity_chart(
            series, c, title=f"Capacity factor C = {c:g}: {room}",
            takeaway=f"{lost:.1f}% of assignments dropped on average; final loss "
                     f"{run['loss'][-1]:.3f} ({gap:+.3f} vs dropless)")
        self.say("")

    def run(self):
        c = self.state["factor"]
        steps = len(self.runs[c])
        self.say(f"training C = {c:g} for {steps} steps ...")
        self.runs[c] = self.result = moe.capacity_runs(steps, (c,))[c]
        self.redraw()
        self.say(f"retrained C = {c:g}: the same seed gives the same curve")
        return self.runs[c]

    def knobs(self) -> dict:
        return {"factor": w.Dropdown(options=sorted(self.runs), value=self.state["factor"],
                                     description="capacity C")}


class ExpertParallelControls(Panel):
    """``ep`` picks a recorded expert-parallel run: its token matrix and one step's timeline."""

    FIGURES = ("matrix_fig", "timeline_fig")

    def __init__(self, runs: dict[int, object], step: int = 2, ep: int = 2):
        super().__init__({"ep": ep})
        self.runs, self.step = dict(runs), step
        self.matrix_fig = self.timeline_fig = None
        self.redraw()

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        ep = self.state["ep"]
        run = self.runs[ep]
        rec = next(r for r in run.results if r["rank"] == 0)["records"][self.step - 1]
        share = moe.leaving_share(rec["ep_tokens"])
        self.matrix_fig = token_matrix(
            rec["ep_tokens"], title=f"Tokens sent rank to rank, ep={ep}, step {self.step}",
            takeaway=f"{100 * share:.0f}% of the tokens leave their rank (formula for balanced "
                     f"routing: (EP-1)/EP = {100 * (ep - 1) / ep:.0f}%)")
        events = moe.label_a2a(run.events(), len(rec["tokens_per_expert"]))
        self.timeline_fig = timeline_figure(
            step_events(events, self.step), ops=[o for o in EP_OPS if any(
                e["op"] == o for e in events)],
            title=f"One step on {ep} ranks with expert parallelism (step {self.step})",
            takeaway="each MoE layer: dispatch and combine in forward, the same two "
                     "exchanges in reverse in backward")
        self.say("")

    def run(self, timeout: float = 120):
        ep = self.state["ep"]
        self.say(f"running {ep} ranks ...")
        try:
            run = moe.launch_ep(ep, steps=max(self.step, 3), timeout=timeout)
        except Exception as err:  # noqa: BLE001 - a failed run becomes the panel's message
            self.say(f"the run failed: {str(err)[:500]}")
            return None
        self.runs[ep] = self.result = run
        self.redraw()
        self.say(f"ran {ep} ranks in {run.elapsed_s:.0f} s")
        return run

    def knobs(self) -> dict:
        return {"ep": w.Dropdown(options=sorted(self.runs), value=self.state["ep"],
                                 description="ep")}
