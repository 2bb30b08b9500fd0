"""edu3d.widgets: the course's visualizers, every one drawn from what a real run recorded.

* :mod:`edu3d.widgets.style` — the shared visual grammar: colour per operation (forward blue,
  backward orange, input-grad teal, weight-grad green, communication yellow, idle hatched
  grey; Okabe-Ito, colour-blind safe), chunk tints, ghost opacity for theory, and
  :func:`~edu3d.widgets.style.frame` (title + axis units + one-line takeaway).
* :mod:`edu3d.widgets.mesh3d` — :func:`~edu3d.widgets.mesh3d.mesh_figure`, the dp x tp x pp
  cube of ranks with their TP / DP / PP / model-parallel groups as reported by the ranks.
* :mod:`edu3d.widgets.timeline` — :func:`~edu3d.widgets.timeline.timeline_figure`, lanes per
  rank (compute + communication sub-lane), x in ms, theory as ghosts under measurement.

Every visualizer returns a plain plotly ``go.Figure`` (animations use frames and sliders), so
it works in JupyterLab and in exported HTML. Import the submodule you need
(``from edu3d.widgets.timeline import timeline_figure``); this package itself imports
nothing heavy.
"""
