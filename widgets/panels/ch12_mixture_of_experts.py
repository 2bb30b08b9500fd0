"""Chapter 12's panels: the capacity factor against dropped tokens and the loss, and the
expert-parallel degree against the all-to-all's token matrix and timeline.

After reading this file you should know what the knobs change:

* :class:`CapacityControls`: the capacity-factor dropdown picks one of the recorded runs
  (:func:`edu3d.course.ch12_mixture_of_experts.capacity_runs`) and redraws its dropped
  share and loss over the dropless run at once, with the capacity ``ceil(T·k/E · C)``
  printed; "run it" retrains the chosen factor now (in this process, a few seconds);
* :class:`TokenMatrixControls` (section 4): ``ep`` picks one of the recorded
  expert-parallel runs and redraws its rank-to-rank token matrix; "run it" launches that
  degree again (``ep`` ranks);
* :class:`DispatchTimelineControls` (section 5): the same runs, one step's timeline with
  each MoE layer's counts, dispatch and combine on the communication lane.

Every takeaway that states a number is computed from the data the figure draws.
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch12_mixture_of_experts as moe
from edu3d.widgets.experts import capacity_chart, token_matrix
from edu3d.widgets.panels.panel import Panel
from edu3d.widgets.timeline import step_events, timeline_figure

EP_OPS = ("F", "B", "optimizer", "counts", "dispatch", "combine", "all_reduce", "broadcast")
BACKWARD = {"dispatch (bwd)": "dispatch", "combine (bwd)": "combine"}  # drawn as their op
LEGEND_HEIGHT = 440  # px: idle and every op above stand in one column beside the lanes


def capacity_series(runs: dict[float, list[dict]], tokens: int, k: int) -> dict:
    """``{factor: {"dropped_pct", "loss"}}`` per step from the runs' records."""
    return {c: {"dropped_pct": [100 * r["dropped"] / (tokens * k) for r in recs],
                "loss": [r["loss"] for r in recs]} for c, recs in runs.items()}


class CapacityControls(Panel):
    """A capacity-factor dropdown over recorded runs; "run it" retrains the chosen factor."""

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
    """``ep`` picks one of the recorded expert-parallel runs (``{ep: run}``) and its record
    of ``step``; "run it" launches that degree again. Subclasses draw it."""

    def __init__(self, runs: dict[int, object], step: int = 2, ep: int = 2):
        super().__init__({"ep": ep})
        self.runs, self.step = dict(runs), step
        self.redraw()

    def record(self) -> dict:
        run = self.runs[self.state["ep"]]
        return next(r for r in run.results if r["rank"] == 0)["records"][self.step - 1]

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


class TokenMatrixControls(ExpertParallelControls):
    """Section 4: the all-to-all's rank-to-rank token matrix of the chosen run."""

    FIGURES = ("matrix_fig",)

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        ep, rec = self.state["ep"], self.record()
        share = moe.leaving_share(rec["ep_tokens"])
        self.matrix_fig = token_matrix(
            rec["ep_tokens"], title=f"Tokens sent rank to rank, ep={ep}, step {self.step}",
            takeaway=f"{100 * share:.0f}% of the tokens leave their rank (formula for balanced "
                     f"routing: (EP-1)/EP = {100 * (ep - 1) / ep:.0f}%)")
        self.say("")


class DispatchTimelineControls(ExpertParallelControls):
    """Section 5: one step of the chosen run, every rank's compute and communication."""

    FIGURES = ("timeline_fig",)

    def events(self) -> list[dict]:
        """The step's trace, each all-to-all named (backward's exchanges under their
        forward name: the compute lane above says which pass they are in)."""
        run = self.runs[self.state["ep"]]
        labelled = moe.label_a2a(run.events(), len(self.record()["tokens_per_expert"]))
        return [{**e, "op": BACKWARD.get(e["op"], e["op"])}
                for e in step_events(labelled, self.step)]

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        ep, events = self.state["ep"], self.events()
        shown = [o for o in EP_OPS if any(e["op"] == o for e in events)]
        per_rank = sum(1 for e in events if e["op"] == "dispatch" and e["rank"] == 0)
        self.timeline_fig = timeline_figure(
            events, ops=shown, height=max(LEGEND_HEIGHT, 120 + 34 * 2 * ep),
            title=f"One step on {ep} ranks with expert parallelism (step {self.step})",
            takeaway=f"rank 0 dispatched {per_rank} times and combined "
                     f"{sum(1 for e in events if e['op'] == 'combine' and e['rank'] == 0)} "
                     "times: each MoE layer's pair in forward, again in backward")
        self.say("")
