"""Chapter 01's panel: the ring all-reduce, replayed from its plan, priced, then measured.

After reading this file you should know what the knobs change: N and the message size redraw
the ring all-reduce replayed from edu3d's own plan
(:func:`edu3d.course.ch01_collectives.ring_sends`), its steps priced by the alpha-beta model,
and the model's curve; "run it" runs edu3d's ring over gloo at that N and size and draws the
measured bytes and time of every step over the prediction.
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch01_collectives as ch01
from edu3d.widgets.collectives import alpha_beta_figure, ring_replay_figure, ring_steps_figure
from edu3d.widgets.panels.panel import MAX_RUN_RANKS, Panel, choices

SIZES = {"4 KiB": 4 << 10, "64 KiB": 64 << 10, "256 KiB": 256 << 10, "1 MiB": 1 << 20,
         "4 MiB": 4 << 20}
RUN_REPEATS = 3


class RingControls(Panel):
    """N and the message size -> the ring replayed from its plan and priced by alpha-beta;
    run -> edu3d's ring measured step by step over the prediction."""

    DEFAULT = {"n": 4, "size": 1 << 20}
    FIGURES = ("replay_fig", "steps_fig", "cost_fig")

    def __init__(self, default: dict | None = None, alpha: float = ch01.ALPHA_S,
                 beta: float = ch01.BETA_S_PER_BYTE):
        super().__init__({**self.DEFAULT, **(default or {})})
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
        self.state.update(changes)
        n, size = self.state["n"], self.numel * 4
        got = self.measured.get((n, size))
        if got:
            self.replay_fig = ring_replay_figure(got["events"], n, size, case="rep0",
                                                 title=f"Ring all-reduce on {n} ranks, "
                                                       "replayed from the run's trace")
        else:
            self.replay_fig = ring_replay_figure(ch01.ring_sends(n, self.numel), n, size,
                                                 title=f"Ring all-reduce on {n} ranks, "
                                                       "replayed from edu3d's ring plan")
        self.steps_fig = ring_steps_figure(
            ch01.ring_step_costs(n, self.numel, self.alpha, self.beta), n, size,
            got and got["steps"], alpha=self.alpha, beta=self.beta)
        self.cost_fig = alpha_beta_figure(n, size, alpha=self.alpha, beta=self.beta,
                                          time_s=ch01.ring_all_reduce_s,
                                          measured_s=got and sum(r["s"] for r in got["steps"]))
        self.say("")

    def run(self, timeout: float = 120):
        """Run edu3d's ring all-reduce at this N and size and draw it over the prediction."""
        n, size = self.state["n"], self.numel * 4
        if self.refuse(None if n <= MAX_RUN_RANKS else
                       f"the real run is limited to {MAX_RUN_RANKS} ranks"):
            return None
        self.say(f"launching {n} ranks: {RUN_REPEATS} ring all-reduces of {size:,} B ...")
        run = self.launch(ch01.ring_timed, n, kwargs={"numel": self.numel,
                                                      "repeats": RUN_REPEATS}, timeout=timeout)
        if run is None:
            return None
        self.result = run
        events = run.events()
        steps = ch01.measured_ring_steps(events, n, RUN_REPEATS)
        self.measured[(n, size)] = {"events": events, "steps": steps}
        self.redraw()
        ok = all(r["equal"] for r in run.results)
        self.say(f"{n} ranks ran edu3d's ring: result equals dist.all_reduce: {ok}; "
                 f"{sum(r['bytes'] for r in steps):,} B sent in {len(steps)} steps")
        return run

    def knobs(self) -> dict:
        s = self.state
        sizes = {**SIZES, **({} if s["size"] in SIZES.values() else {f"{s['size']:,} B":
                                                                        s["size"]})}
        return {
            "n": w.Dropdown(options=choices(range(2, MAX_RUN_RANKS + 1), s["n"]),
                            value=s["n"], description="N ranks", layout={"width": "160px"}),
            "size": w.Dropdown(options=list(sizes.items()), value=s["size"],
                               description="message S"),
        }


def ring_controls(default: dict | None = None, rep: dict | None = None) -> RingControls:
    """Chapter 01's panel, priced with ``rep``'s fitted α-β when given (else
    :data:`edu3d.course.ch01_collectives.ALPHA_S` and ``BETA_S_PER_BYTE``)."""
    return RingControls.from_report(rep, default) if rep else RingControls(default)
