"""Pipeline schedules as data: who runs which micro-batch's forward or backward, when.

A schedule is, per rank, an ordered list of actions in PyTorch's notation (``0F3`` = stage 0
forward of micro-batch 3; ``B``, ``I``, ``W``, ``SEND_F``, ``RECV_B``, ...). The same lists are
checked (dependencies met, no deadlock), simulated (the theory timeline, the bubble, the
activations in flight), drawn by the course, costed by the planner (:mod:`edu3d.plan`) and
executed by the engine (:mod:`edu3d.parallel.pp`). Nothing here imports torch.

Read in this order: :mod:`~edu3d.schedules.partition` (which layers go to which stage),
:mod:`~edu3d.schedules.actions` (GPipe, 1F1B, interleaved 1F1B, ZB-H1 as per-rank action
lists), :mod:`~edu3d.schedules.check` (is a list valid?) and
:mod:`~edu3d.schedules.simulate` (the theory timeline and bubble).
"""

from edu3d.schedules.actions import (SCHEDULES, Action, build, compute_order, dualpipev,
                                     format_torch, gpipe, interleaved, one_f_one_b, parse_torch,
                                     placement, stage_rank, with_comms, zb_h1, zbv)
from edu3d.schedules.check import Report, ScheduleError, check
from edu3d.schedules.simulate import Costs, bubble_formula, bubble_of, simulate

__all__ = ["SCHEDULES", "Action", "Costs", "Report", "ScheduleError", "bubble_formula",
           "bubble_of", "build", "check", "compute_order", "dualpipev", "format_torch", "gpipe",
           "interleaved", "one_f_one_b", "parse_torch", "placement", "simulate", "stage_rank",
           "with_comms", "zb_h1", "zbv"]
