"""What the course adds on top of the library: lesson options and the deliberate bugs.

The library (everything else under :mod:`edu3d`) is the mechanics and never imports this
package; chapters, exercises and their graders import the library and this.

* :func:`lesson_args` gives a chapter the defaults of ``edu3d train`` with a few changed, so
  a cell can build a :class:`~edu3d.train.trainer.Trainer` the way the command does;
* :func:`yes` is how a checked cell states a check ("loss equals serial: yes"), as a
  sentence of the lesson rather than a bare ``True``;
* the deliberate bugs the exercises hunt are plain functions handed to the library's hooks
  (for example ``Trainer(..., microbatch_loss=unscaled_loss)``), never flags of its classes.
"""

from __future__ import annotations

from edu3d.config.sections import Run


def lesson_args(**overrides) -> Run:
    """``edu3d train``'s default options (tiny model) with ``overrides`` applied (an unknown
    name is a ``TypeError`` that lists the valid ones)."""
    return Run.of(**overrides)


def yes(ok) -> str:
    """A check's outcome as the lesson says it: ``"yes"`` or ``"no"``."""
    return "yes" if ok else "no"


def unscaled_loss(loss, m: int):
    """The classic pipeline / accumulation bug: back-propagate each micro-batch's mean loss
    without dividing by the number of micro-batches, so gradients come out m times too
    large (plain SGD shows it; Adam, scale-invariant, hides it)."""
    return loss
