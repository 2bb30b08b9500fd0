"""edu3d.widgets: the course's visualizers, every one drawn from what a real run recorded.

Every chart follows one visual grammar (DESIGN.md, "Visual grammar"): **lane = rank, x =
time, colour = operation** (forward blue, backward orange, input-grad teal, weight-grad
green, communication yellow on its own sub-lane, idle hatched grey; Okabe-Ito, colour-blind
safe), **tint = model chunk, label = micro-batch**. **Theory is a ghost** drawn under the
measurement, and the formula's value is printed beside the measured one. Every chart has a
title, axis units and a one-line takeaway (:func:`~edu3d.widgets.style.frame`).
:mod:`~edu3d.widgets.style` holds that grammar, so a new chart looks like the others.

Two kinds of module live here:

* **charts**, one concept each (``edu3d.widgets.<concept>``): data in, a plain plotly
  ``go.Figure`` out (animations use frames and sliders), so they work in JupyterLab and in
  exported HTML. They import :mod:`edu3d.widgets.style`, plotly and the library's lower
  layers, never :mod:`edu3d.course`;
* **panels** (:mod:`edu3d.widgets.panels`), one per chapter, on one
  :class:`~edu3d.widgets.panels.panel.Panel` base: ipywidgets knobs (layout, schedule,
  micro-batches, sizes) that ask the chapter's course module for numbers and a chart for
  pictures and redraw at once, from a simulation or the estimator; a button launches the real
  run and draws it over the theory. Where no frontend is attached (nbval, exported HTML) a
  panel is its default static figure, so checked cells stay stable.

Import the submodule you need (``from edu3d.widgets.timeline import timeline_figure``); this
package itself imports nothing.
"""
