"""edu3d.widgets: the course's visualizers, every one drawn from what a real run recorded.

Two kinds of module live here:

* **charts**, one concept each (``edu3d.widgets.<concept>``): data in, a plain plotly
  ``go.Figure`` out (animations use frames and sliders), so they work in JupyterLab and in
  exported HTML. They import :mod:`edu3d.widgets.style`, plotly and the library's lower
  layers, never :mod:`edu3d.course`. :mod:`~edu3d.widgets.style` is the shared visual grammar:
  colour per operation (forward blue, backward orange, input-grad teal, weight-grad green,
  communication yellow, idle hatched grey; Okabe-Ito, colour-blind safe), chunk tints, ghost
  opacity for theory, and :func:`~edu3d.widgets.style.frame` (title + axis units + one-line
  takeaway);
* **panels** (:mod:`edu3d.widgets.panels`), one per chapter: ipywidgets knobs that call the
  chapter's course module for numbers and a chart for pictures, on one
  :class:`~edu3d.widgets.panels.panel.Panel` base.

Import the submodule you need (``from edu3d.widgets.timeline import timeline_figure``); this
package itself imports nothing.
"""
