"""What the course adds on top of the library: lesson options and the deliberate bugs.

The library (everything else under :mod:`edu3d`) is the mechanics and never imports this
package; chapters, exercises and their graders import the library and this.

* :func:`lesson_args` gives a chapter the defaults of ``edu3d train`` with a few changed, so
  a cell can build a :class:`~edu3d.train.trainer.Trainer` the way the command does;
* the deliberate bugs the exercises hunt are plain functions handed to the library's hooks
  (for example ``Trainer(..., microbatch_loss=unscaled_loss)``), never flags of its classes.
"""

from __future__ import annotations

from edu3d.train.options import TrainOptions, defaults


def lesson_args(**overrides) -> TrainOptions:
    """``edu3d train``'s default options (tiny model) with ``overrides`` applied (an unknown
    name is a ``TypeError`` that lists the valid ones)."""
    return defaults(**overrides)


def unscaled_loss(loss, m: int):
    """The classic pipeline / accumulation bug: back-propagate each micro-batch's mean loss
    without dividing by the number of micro-batches, so gradients come out m times too
    large (plain SGD shows it; Adam, scale-invariant, hides it)."""
    return loss
