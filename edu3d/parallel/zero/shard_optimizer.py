"""ZeRO's optimizer: any ``torch.optim`` class over *views of this rank's shard*.

After reading this file you should understand how :class:`~edu3d.parallel.zero.sharding.Zero`
lets an unmodified torch optimizer update only the numbers this rank owns:

* the parameters (or param groups) are given as torch optimizers take them, and each must
  belong to a ZeRO unit, once (:func:`checked_groups`);
* every stretch of a parameter that lies in the shard (:meth:`FlatUnit.pieces`) becomes an
  ``nn.Parameter`` that *is a view* of the shard, with a ``.grad`` that is a view of the
  sharded gradient, in its parameter's group (:func:`build`): the optimizer's arithmetic is
  element by element, so updating the views is updating the shard exactly as one process
  would update those elements;
* ``offload=True`` puts the views over a host copy of the shard instead (master weights,
  gradient and moments in CPU memory); only the shard itself stays on the device. A
  mixed-precision unit (:class:`~edu3d.parallel.zero.flat_unit.FlatUnit`'s ``param_dtype``)
  puts them over a copy in the parameters' own dtype: the fp32 master shard the optimizer
  steps, cast into the low-precision shard after each step;
* :func:`step`: the gradient views point at the averaged shard (a parameter no rank gave a
  gradient gets ``None``: torch skips it), the optimizer steps, the master copy goes back
  into the shard, and stages 1-2 all-gather the full parameters;
* a **0-dim parameter** (a learnable temperature) gives a 0-dim piece, so its optimizer state
  has the shape torch's has on one process, and a full state dict loads into it.
"""

from __future__ import annotations

import torch

from edu3d.distributed import comm, trace


def checked_groups(params, where: dict, names: dict) -> list[dict]:
    """``params`` (``None``: every unit parameter, ``where``'s keys) as torch optimizers
    take it, a list of groups, checked to be unit parameters in one group each."""
    params = list(where) if params is None else list(params)
    groups = [dict(g) for g in params] if params and isinstance(params[0], dict) \
        else [{"params": params}]
    seen = set()
    for g in groups:
        ps = g["params"]
        g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        for p in g["params"]:
            if p not in where or p in seen:
                raise ValueError(f"parameter {names.get(p, tuple(p.shape))} is "
                                 f"{'in two groups' if p in seen else 'in no ZeRO unit'}")
            seen.add(p)
    return groups


def make_master(u, offload: bool) -> None:
    """Set ``u.master_param`` / ``u.master_grad``: the copy the optimizer steps when it is not
    the shard itself (offload: on the CPU; mixed precision: in the parameters' own dtype),
    and its gradient when the shard's gradient cannot serve (another device or dtype)."""
    start = u.master_init if u.master_init is not None else u.shard_param
    if offload:
        u.master_param = start.detach().to("cpu", copy=True)
    elif u.master_init is not None:
        u.master_param = u.master_init
    param = u.master_param if u.master_param is not None else u.shard_param
    same = (param.dtype, param.device) == (u.shard_grad.dtype, u.shard_grad.device)
    u.master_grad = None if same and not offload else torch.zeros(
        u.shard_numel, dtype=param.dtype, device=param.device)  # offload: host memory, always


def build(units: list, groups: list[dict], optimizer_class, defaults: dict, offload: bool):
    """``optimizer_class`` over the shard's pieces of ``units``, each in its parameter's
    group; sets each unit's ``opt_params`` / ``opt_grads`` (per piece: the optimizer's
    parameter, or None outside every group, and its gradient view) and its master copy
    (:func:`make_master`)."""
    group_of = {p: i for i, g in enumerate(groups) for p in g["params"]}
    pieces: list[list] = [[] for _ in groups]
    for u in units:
        make_master(u, offload)
        param = u.master_param if u.master_param is not None else u.shard_param
        grad = u.master_grad if u.master_grad is not None else u.shard_grad
        u.opt_params, u.opt_grads = [], []
        scalars = {id(q) for q, v in zip(u.params, u.views) if v.dim() == 0}
        for p, a, b, s in u.pieces():
            shape = () if id(p) in scalars else (b - a,)
            piece = torch.nn.Parameter(param[s:s + b - a].view(shape), requires_grad=False)
            piece.grad = grad[s:s + b - a].view(shape)
            i = group_of.get(p)
            u.opt_params.append(None if i is None else piece)
            u.opt_grads.append(piece.grad)
            if i is not None:
                pieces[i].append(piece)
    return optimizer_class([{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
                            for g, ps in zip(groups, pieces)], **defaults)


def step(zero) -> None:
    """One optimizer step of ``zero``'s element-wise sharding (module docstring)."""
    for u in zero.units:
        if u.master_grad is not None:
            u.master_grad.copy_(u.shard_grad)
        for (p, *_), piece, grad in zip(u.pieces(), u.opt_params, u.opt_grads):
            if piece is not None:
                piece.grad = grad if p in zero.stepped else None
    zero.optimizer.step()
    for i, u in enumerate(zero.units):
        if u.master_param is not None:
            u.shard_param.copy_(u.master_param)
        if zero.stage < 3:
            with trace.current().context(chunk=i):
                comm.all_gather(u.flat_param, u.shard_param.clone(), zero.group)
