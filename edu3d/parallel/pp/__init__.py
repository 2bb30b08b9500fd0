"""Pipeline parallelism: partitioning, schedules as data, a checker, a simulator, an engine.

Read in this order: :mod:`~edu3d.parallel.pp.partition` (which layers go to which stage),
:mod:`~edu3d.parallel.pp.schedules` (GPipe, 1F1B, interleaved 1F1B, ZB-H1 as per-rank action
lists), :mod:`~edu3d.parallel.pp.check` (is a list valid?), :mod:`~edu3d.parallel.pp.simulate`
(the theory timeline and bubble), :mod:`~edu3d.parallel.pp.engine` (the interpreter that runs
the same lists over send/recv) and :mod:`~edu3d.parallel.pp.trainer` (a training step).
"""

from edu3d.parallel.pp.check import Report, ScheduleError, check
from edu3d.parallel.pp.schedules import (SCHEDULES, Action, build, compute_order, format_torch,
                                         gpipe, interleaved, one_f_one_b, parse_torch,
                                         with_comms, zb_h1)
from edu3d.parallel.pp.simulate import Costs, bubble_formula, bubble_of, simulate

__all__ = ["SCHEDULES", "Action", "Costs", "Report", "ScheduleError", "bubble_formula",
           "bubble_of", "build", "check", "compute_order", "format_torch", "gpipe",
           "interleaved", "one_f_one_b", "parse_torch", "simulate", "with_comms", "zb_h1"]
