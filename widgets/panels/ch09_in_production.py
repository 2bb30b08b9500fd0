"""Chapter 09's panel: one strategy, edu3d's code beside PyTorch's, measured on both.

After reading this file you should know what the dropdown changes: the strategy redraws its
mapping table (edu3d's code, PyTorch's API, the libraries' knobs:
:func:`edu3d.course.ch09_in_production.strategy_rows`) and highlights it in the comparison
of every measured strategy, at once; "run it" measures that strategy live on edu3d and on
``--impl torch`` (:func:`edu3d.course.ch09_in_production.measure`).
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course.ch09_in_production import STRATEGIES, measure, strategy_rows
from edu3d.widgets.panels.panel import Panel
from edu3d.widgets.production import comparison_figure, loss_figure, mapping_table


class Controls(Panel):
    """Strategy dropdown: the mapping table and the comparison redraw at once (the
    comparison highlights it); "run it" measures that strategy on edu3d and torch."""

    FIGURES = ("mapping_fig", "comparison_fig", "loss_fig")

    def __init__(self, results: dict | None = None, strategy: str = "ZeRO-3",
                 psi: int | None = None):
        super().__init__({"strategy": strategy})
        self.results = dict(results or {})
        self.psi = psi
        self.redraw()

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state["strategy"]
        self.mapping_fig = mapping_table(s, strategy_rows(s), STRATEGIES[s]["argv"])
        names = [n for n in STRATEGIES if n in self.results] or list(STRATEGIES)
        self.comparison_fig = comparison_figure(self.results, highlight=s, psi=self.psi,
                                                names=names)
        self.loss_fig = loss_figure(self.results[s]) if s in self.results else None
        self.show()

    def run(self, steps: int = 4):
        """Measure the chosen strategy on edu3d and on torch; draw it into the comparison."""
        s = self.state["strategy"]
        self.say(f"running {s} on edu3d and on torch ...")
        self.results.update(measure([s], steps))
        row = self.result = self.results[s]
        self.message = (f"{s}: worst relative loss difference {row['worst_rel']:.1e}; step "
                        f"{row['edu3d_step_s'] * 1e3:.0f} ms (edu3d) vs "
                        f"{row['torch_step_s'] * 1e3:.0f} ms (torch)")
        self.redraw()
        return row

    def knobs(self) -> dict:
        return {"strategy": w.Dropdown(options=list(STRATEGIES), value=self.state["strategy"],
                                       description="strategy")}


def controls(results: dict | None = None, strategy: str = "ZeRO-3",
             psi: int | None = None) -> Controls:
    """The chapter's panel; display ``controls(...).widget`` in JupyterLab, or show the
    static ``mapping_fig`` / ``comparison_fig`` without a frontend."""
    return Controls(results, strategy, psi)
