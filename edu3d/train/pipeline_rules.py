"""The rules of the V-shaped and split-backward pipeline schedules, checked before a process
starts.

After reading this file you can say which ``--schedule`` / ``--pp`` / ``--microbatches`` /
``--zero`` combinations edu3d runs for ZB-H1, ZBV and DualPipeV, and what each refusal tells
you to change instead:

* ZBV and DualPipeV cut the model into ``2 * pp`` stages (two chunks per rank, placed as a
  V), so the model needs at least that many layers;
* DualPipeV needs at least one micro-batch per stage, ``m >= 2 * pp`` (PyTorch's
  ``ScheduleDualPipeV`` refuses fewer too);
* ZeRO-3 gathers a unit's weights around its module's forward and backward hooks and frees
  them after; a split backward's ``W`` runs later, outside any hook, on weights that another
  micro-batch's forward has freed meanwhile. ZeRO-1 and 2 keep the weights and compose.

:func:`edu3d.train.preflight.check_args` calls :func:`check_pipeline` with the run
(:class:`~edu3d.config.sections.Run`); no torch here.
"""

from __future__ import annotations

from edu3d.config.layout import LayoutError
from edu3d.config.sections import Run
from edu3d.schedules.actions import V_SHAPED, chunks

SPLIT_BACKWARD = ("zb-h1",) + V_SHAPED  # schedules whose backward runs as I, then W


def check_pipeline(run: Run, n_layers: int, microbatches: int) -> None:
    """The schedule's own rules for ``run``'s schedule on its ``pp`` ranks (see the module
    text)."""
    name, pp = run.parallel.schedule, run.layout.pp
    if name in V_SHAPED and chunks(name, 1) * pp > n_layers:
        raise LayoutError(
            f"--schedule {name} puts 2 stages on each of --pp {pp} ranks: {2 * pp} stages, "
            f"but the model has {n_layers} layers; use --layers {2 * pp} (or more) or "
            f"--pp {max(1, n_layers // 2)} (or fewer)")
    if name == "dualpipev" and microbatches < 2 * pp:
        raise LayoutError(
            f"--schedule dualpipev needs a micro-batch per stage of its V: --microbatches "
            f"{2 * pp} (2 * --pp) or more, got {microbatches}")
    if name in SPLIT_BACKWARD and run.parallel.zero == 3:
        raise LayoutError(
            f"--zero 3 with --schedule {name}: ZeRO-3 frees a stage's weights after each "
            f"forward, and the split backward's W runs later, outside the hooks that gather "
            f"them; use --zero 1 or 2, or --schedule 1f1b")
