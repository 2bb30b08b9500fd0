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
  gradient and moments in CPU memory); only the shard itself stays on the device.
"""

from __future__ import annotations

import torch


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


def build(units: list, groups: list[dict], optimizer_class, defaults: dict, offload: bool):
    """``optimizer_class`` over the shard's pieces of ``units``, each in its parameter's
    group; sets each unit's ``opt_params`` / ``opt_grads`` (per piece: the optimizer's
    parameter, or None outside every group, and its gradient view) and ``host_param`` /
    ``host_grad`` (the offloaded copies, or None)."""
    group_of = {p: i for i, g in enumerate(groups) for p in g["params"]}
    pieces: list[list] = [[] for _ in groups]
    for u in units:
        u.host_param = u.shard_param.detach().to("cpu", copy=True) if offload else None
        u.host_grad = torch.zeros(u.shard_numel, dtype=u.shard_grad.dtype) if offload else None
        param = u.host_param if offload else u.shard_param
        grad = u.host_grad if offload else u.shard_grad
        u.opt_params, u.opt_grads = [], []
        for p, a, b, s in u.pieces():
            piece = torch.nn.Parameter(param[s:s + b - a], requires_grad=False)
            piece.grad = grad[s:s + b - a]
            i = group_of.get(p)
            u.opt_params.append(None if i is None else piece)
            u.opt_grads.append(piece.grad)
            if i is not None:
                pieces[i].append(piece)
    return optimizer_class([{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
                            for g, ps in zip(groups, pieces)], **defaults)
