"""edu3d.widgets.panels: each chapter's control panel, on one base.

* :mod:`edu3d.widgets.panels.panel` — :class:`~edu3d.widgets.panels.panel.Panel`: knobs that
  redraw at once, a button that launches the real run, a static figure without a frontend;
* ``chNN_topic`` — chapter NN's panel (the same stem as its notebook and as
  :mod:`edu3d.course`'s module that computes its numbers), drawn with the charts of
  :mod:`edu3d.widgets`.
"""
