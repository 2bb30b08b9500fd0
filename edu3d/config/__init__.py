"""What a run is, written down: its layout and rank order, and every section of one run.

Reading order: :mod:`~edu3d.config.layout` (the degrees and which rank sits where), then
:mod:`~edu3d.config.sections` (the run in sections, one field per ``edu3d train`` flag). Nothing
here imports torch or another part of edu3d: every other floor builds on it.
"""
