"""This rank's training state placed in the serial model: what a checkpoint writes and loads.

After reading this file you should understand how a checkpoint stays independent of the
layout that wrote it. Every number a rank holds (a parameter, AdamW's two moments; under ZeRO
its shard's pieces) is a **slot**: where it sits in the full serial tensor (a placement,
:mod:`edu3d.ckpt.reshard`), a flat view of the numbers here, and whether this rank is the
one that writes it (:func:`checkpoint_slots`). One owner per number:

* a TP-sharded tensor's piece is written by the rank holding it; a TP-replicated tensor by
  tp index 0;
* a dp (or cp) replica by the first ``dp x cp`` rank, an expert by the first rank holding it
  (its expert-data-parallel group's first);
* a parameter by the pipeline rank whose stages hold it (:func:`owner_pp`); the tied
  embedding's copy on the last stage never: the first stage writes it.

Loading fills every slot, owned or not, from the pieces that overlap it, whatever layout
wrote them. AdamW's bias correction counts updates: :func:`optimizer_step` reads it from the
optimizer's state, :func:`set_optimizer_step` puts a checkpoint's back.
"""

from __future__ import annotations

import torch

from edu3d.ckpt import reshard
from edu3d.parallel.optim_state import adam_state
from edu3d.schedules.actions import placement, stage_rank


def owner_pp(par, mesh, schedule: str, name: str) -> int:
    """The pipeline rank holding serial parameter ``name`` (tied matrix: the first stage's),
    under ``schedule``'s placement of stages on ranks."""
    if name.startswith("blocks."):
        layer = int(name.split(".")[1])
        stage = next(s for s, (a, b) in enumerate(par.parts) if a <= layer < b)
    else:
        stage = par.n_stages - 1 if name.startswith(("ln_f", "lm_head")) else 0
    return stage_rank(stage, mesh.layout.pp, placement(schedule))


def checkpoint_slots(par, mesh, optimizer, schedule: str) -> list[tuple[dict, torch.Tensor, bool]]:
    """Every piece of training state this rank holds, as ``(placement, view, owned)``: the
    placement in the full serial tensor (:mod:`edu3d.ckpt.reshard`), a 1-D view of the
    numbers here (write into it to load), and whether this rank is the piece's one writer
    (see the module docstring). ``par``: the parallelized model
    (:func:`edu3d.parallel.parallelize.parallelize`), ``optimizer``: its optimizer when no
    ZeRO unit holds one."""
    tp_i, tp_n, pp_i = mesh.index("tp"), mesh.size("tp"), mesh.index("pp")
    first = {False: mesh.index("dpcp") == 0, True: mesh.index("edp") == 0}
    slots = []

    def add(p, kind, view, window, owned):
        name = par.names[p]
        owned = owned and (par.specs.get(name) is not None or tp_i == 0) \
            and owner_pp(par, mesh, schedule, name) == pp_i
        start = window[0] if window else 0
        for place, s, e in reshard.pieces(name, kind, par.shapes[name], par.specs.get(name),
                                          tp_i, tp_n, window):
            slots.append((place, view[s - start:e - start], owned))

    if not par.zeros:
        adam = isinstance(optimizer, torch.optim.AdamW)
        for p in par.module.parameters():
            mine = first[par.names[p] in par.experts]
            add(p, "param", p.data.view(-1), None, mine)
            if adam and p.requires_grad:  # a frozen parameter has no optimizer state
                state = adam_state(optimizer, p)
                for kind in ("exp_avg", "exp_avg_sq"):
                    add(p, kind, state[kind].view(-1), None, mine)
        return slots
    for z in par.zeros:
        for p, a, b, views in z.state_pieces():
            for kind, view, owned in views:
                add(p, kind, view, (a, b), owned)
    for p in par.module.parameters():
        if not p.requires_grad:  # frozen: in no ZeRO unit, whole on every rank, written once
            add(p, "param", p.data.view(-1), None, first[par.names[p] in par.experts])
        elif par.zero.stage < 3:  # the full parameters every rank keeps: loaded, not written
            add(p, "param", p.data.view(-1), None, False)
    return slots


def optimizers(par, optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers that hold this rank's state: ZeRO's units', else ``optimizer``."""
    if par.zeros:
        return [z.optimizer for z in par.zeros]
    return [] if optimizer is None else [optimizer]


def optimizer_step(opts: list[torch.optim.Optimizer]) -> int:
    """How many updates the optimizers' state has seen (AdamW's bias correction)."""
    for opt in opts:
        for state in opt.state.values():
            if "step" in state:
                return int(state["step"])
    return 0


def set_optimizer_step(opts: list[torch.optim.Optimizer], n: int) -> None:
    """Set the update count every optimizer state keeps to ``n`` (a checkpoint's)."""
    for opt in opts:
        for state in opt.state.values():
            if "step" in state:
                state["step"].fill_(float(n))
