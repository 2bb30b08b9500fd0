"""Saving and restoring a ZeRO run: the model's full tensors in, the optimizer's state out and in.

After reading this file you should understand what a checkpoint of a sharded run holds and how
it finds its way back into the shards (FSDP's state-dict machinery, in small):

* **the model.** ``model.state_dict()`` holds full tensors: under ZeRO-3 a pre-hook gathers
  every freed unit and a post-hook copies the tensors out and frees the units again (FSDP's
  ``FULL_STATE_DICT``); under mixed precision the unit parameters are replaced by their full
  precision values, gathered from the master shards. Both are collective, so a rank first
  checks in with the others (:func:`check_in`): ``if rank == 0: model.state_dict()`` (the
  DDP idiom) is an error that says so, not a hang until the process group's timeout.
  ``model.load_state_dict(full)`` works at every stage because of :func:`install_hooks`:
  under stages 1-2 every parameter *is* a view of the flat buffer whose slice is the shard,
  so torch's own copy updates the shard; under ZeRO-3 a parameter is an empty ``(0,)``
  tensor between forwards, so a pre-hook first points every parameter at a full-size buffer
  (filled with zeros and this rank's shard, no communication), torch copies the loaded
  tensors into it (its shape and ``strict`` key checks work as on a plain model), and a
  post-hook copies this rank's slice back into the shard and frees the buffer again. Each
  rank keeps its slice of a key the dict lacks (``strict=False``). The master copies
  (offload, mixed precision, whole-tensor optimizers) are refreshed from the loaded tensors
  themselves, at their full precision;
* **the optimizer**, in one of two forms (:meth:`Zero.state_dict`):

  - **sharded** (the default, no communication): this rank's torch optimizer's own
    ``state_dict()`` over its shard's pieces, plus the layout it was taken under (world size,
    rank, and ``(name, start, end)`` per piece). It is what each rank of torch's
    ``ZeroRedundancyOptimizer`` holds before ``consolidate_state_dict()`` and what FSDP calls
    a sharded optimizer state: every rank saves its own file, and it loads only into the same
    layout (same model, world size, rank), refused with a message otherwise;
  - **full** (``full=True``, collective: every rank of the group calls it and every rank
    gets it): the format of FSDP2's ``get_optimizer_state_dict(model, optim,
    options=StateDictOptions(full_state_dict=True))``: ``{"state": {name: {"step": ...,
    "exp_avg": <full-shaped tensor>, ...}}, "param_groups": [{..., "params": [names]}]}``,
    keyed by parameter name. Element-wise state (a tensor with the parameter's number of
    elements: Adam's moments, SGD's momentum) is all-gathered and reshaped like its
    parameter (in the parameters' own dtype); a scalar (Adam's ``step``) is taken from the
    rank holding the parameter's first element; under whole-tensor sharding each owner sends
    its parameters' state as it is. It loads into a ``Zero`` of *any* world size (each rank
    slices its pieces out) and, converted by :func:`to_torch`, into a plain torch optimizer.

  ``Zero.load_state_dict`` tells the two apart. ``ZeroRedundancyOptimizer.state_dict()``
  returns the consolidated form keyed by parameter *index*; names (as FSDP2) survive a model
  whose parameter order changes, and a reader can see what each tensor is.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from edu3d.distributed import comm
from edu3d.parallel.optim_state import adam_state
from edu3d.parallel.zero.holdings import master_shard

SHARDED_KEYS = ("world_size", "rank", "pieces", "optimizer")


# ---- the model -------------------------------------------------------------------------------
def check_in(zero, what: str) -> None:
    """Wait, at most ``zero.collective_wait_s`` seconds, for every rank of the group to reach
    the collective ``what``; a rank that waits longer raises an error that names the cure.
    (A one-element all-reduce, untraced: a guard, not training traffic.)"""
    device = zero.units[0].shard_grad.device if zero.units else torch.device("cpu")
    work = dist.all_reduce(torch.zeros(1, device=device), group=zero.group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=zero.collective_wait_s))
    except RuntimeError as e:
        raise RuntimeError(
            f"rank {dist.get_rank()}: {what} under ZeRO-{zero.stage} is collective (it gathers "
            f"every unit from the ranks of its group), and the other ranks did not call it "
            f"within {zero.collective_wait_s:g} s. Every rank must call it: sd = "
            "model.state_dict() on every rank, then if rank == 0: torch.save(sd, path)") from e


def _full_precision(zero, u) -> torch.Tensor:
    """Unit ``u``'s parameters end to end in their own dtype, from every rank's master shard."""
    shard = master_shard(u).contiguous()
    flat = torch.empty(u.padded, dtype=shard.dtype, device=shard.device)
    comm.all_gather(flat, shard, zero.group)
    return flat


def install_hooks(zero) -> None:
    """``zero.model.state_dict()`` and ``load_state_dict(full)`` through the shards (above)."""
    gathered: list = []  # state_dict: the units gathered for it
    loading: list = []  # load_state_dict: the units given a full buffer, and the dict loaded
    collective = zero.stage == 3 or zero.param_dtype is not None

    def before_save(module, prefix, keep_vars):
        if collective:
            check_in(zero, "model.state_dict()")
        if zero.gathering is not None:
            gathered[:] = [u for u in zero.units if not u.gathered]
            for u in gathered:
                zero.gathering.gather(u)

    def after_save(module, state_dict, prefix, local_metadata):
        for key, t in list(state_dict.items()):
            if isinstance(t, torch.Tensor) and any(u.holds_storage(t) for u in gathered):
                state_dict[key] = t.detach().clone()
        for u in gathered:
            zero.gathering.free(u)
        gathered.clear()
        if zero.param_dtype is not None:
            full = {}
            for u in zero.units:
                flat = _full_precision(zero, u)
                full.update({p: flat[o:o + size].view(v.shape) for p, o, size, v in
                             zip(u.params, u.offsets, u.sizes, u.views)})
            full.update(zero.frozen_originals)
            for name, p in zero.keys.items():
                if p in full and prefix + name in state_dict:
                    state_dict[prefix + name] = full[p].clone()

    def before_load(module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                    errors):
        loading[:] = [state_dict, prefix]
        if zero.gathering is None:
            return
        for u in zero.units:
            if u.gathered:
                continue
            loading.append(u)
            if u.pending is not None:  # a prefetch in flight: let it land first
                u.pending.wait()
                u.pending = None
            u.regrow()
            with torch.no_grad():
                u.flat_param.zero_()
                u.flat_param[u.lo:u.hi].copy_(u.shard_param)
            u.point_at_views()

    def after_load(module, incompatible_keys):
        state_dict, prefix, *held = loading
        with torch.no_grad():
            for u in zero.units:
                if zero.gathering is not None and u.flat_param.untyped_storage().nbytes():
                    u.shard_param.copy_(u.flat_param[u.lo:u.hi])
            _refresh_masters(zero, state_dict, prefix)
        for u in held:
            zero.gathering.free(u)
        loading.clear()

    zero.model.register_state_dict_pre_hook(before_save)
    zero.model.register_state_dict_post_hook(after_save)
    zero.model.register_load_state_dict_pre_hook(before_load)
    zero.model.register_load_state_dict_post_hook(after_load)


def _refresh_masters(zero, state_dict: dict, prefix: str) -> None:
    """The master copies take the loaded tensors at full precision (a key the dict lacks
    keeps its master)."""
    loaded = {p: state_dict[prefix + name] for name, p in zero.keys.items()
              if prefix + name in state_dict}
    for p, original in zero.frozen_originals.items():
        if p in loaded:
            original.copy_(loaded[p])
    loaded = {p: t for p, t in loaded.items() if p in zero.where}
    if zero.whole is not None:
        for p, m in zero.whole.masters.items():
            if p in loaded:
                m.copy_(loaded[p].reshape(m.shape))
        return
    for u in zero.units:
        if u.master_param is None:
            continue
        for p, a, b, at in u.pieces():
            if p in loaded:
                u.master_param[at:at + b - a].copy_(loaded[p].reshape(-1)[a:b])


def state_pieces(zero):
    """What a checkpoint of this rank's shard holds, piece by piece: ``(param, start, end,
    views)``, the elements ``[start, end)`` of ``param`` (flattened) that the shard holds
    and ``views``, a list of ``(kind, tensor, owned)``: the shard's parameters (``"param"``;
    a master copy too, loaded but written once: the one in the parameters' own dtype) and
    the optimizer's state for them (AdamW's ``"exp_avg"``, ``"exp_avg_sq"``, created as zeros
    when the optimizer has not stepped yet, so a checkpoint can be loaded). Under HSDP the
    first replica group owns (writes) them; the others hold equal copies, loaded only."""
    if zero.whole is not None:
        raise ValueError("a checkpoint by shard pieces needs an element-wise optimizer; with "
                         "whole-tensor sharding save zero.state_dict(full=True)")
    adam = isinstance(zero.optimizer, torch.optim.AdamW)
    own = zero.replica_index == 0
    for u in zero.units:
        for (p, a, b, at), piece in zip(u.pieces(), u.opt_params):
            shard = u.shard_param[at:at + b - a]
            views = [("param", shard, own)]
            if u.master_param is not None:  # written once: in the parameters' own dtype
                master = ("param", u.master_param[at:at + b - a], own)
                views = [master, ("param", shard, False)] if u.master_init is not None \
                    else [views[0], master[:2] + (False,)]
            if adam and piece is not None:
                state = adam_state(zero.optimizer, piece)
                views += [(kind, state[kind].reshape(-1), own)
                          for kind in ("exp_avg", "exp_avg_sq")]
            yield p, a, b, views


# ---- the optimizer ---------------------------------------------------------------------------
def _pieces(zero):
    """``(param, start, end, unit, at, opt_param)`` for every piece the optimizer steps, in the
    optimizer's own order (group by group): what its ``state_dict()`` indices refer to."""
    where = {}
    for u in zero.units:
        for (p, a, b, at), piece in zip(u.pieces(), u.opt_params):
            if piece is not None:
                where[piece] = (p, a, b, u, at, piece)
    return [where[q] for g in zero.optimizer.param_groups for q in g["params"]]


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _layout(zero) -> list[tuple]:
    """``(param, start, end)`` per tensor the optimizer steps, in its own order: pieces of the
    shard, or (whole-tensor sharding) the whole parameters this rank owns."""
    if zero.whole is not None:
        return zero.whole.pieces()
    return [(p, a, b) for p, a, b, *_ in _pieces(zero)]


def sharded_state(zero) -> dict:
    """This rank's optimizer state and the layout it belongs to (no communication)."""
    pieces = [(zero.names[p], a, b) for p, a, b in _layout(zero)]
    return {"world_size": zero.n, "rank": zero.index, "pieces": pieces,
            "optimizer": zero.optimizer.state_dict()}


def _exchange(zero, mine: dict) -> dict:
    """Every rank's ``mine`` merged (a small dict per rank, broadcast by each rank in turn)."""
    ranks = dist.get_process_group_ranks(zero.group) if zero.group else range(zero.n)
    merged: dict = {}
    for src in ranks:
        for name, entry in comm.broadcast_object(mine, src, zero.group).items():
            merged.setdefault(name, {}).update(entry)
    return merged


def full_state(zero) -> dict:
    """The optimizer state of every parameter, full-shaped and keyed by name (collective)."""
    groups = [{**_hyper(g), "params": names}
              for g, names in zip(zero.optimizer.param_groups, zero.group_names)]
    out = _exchange(zero, zero.whole.full_state()) if zero.whole is not None else _gathered(zero)
    return {"state": {n: out[n] for g in zero.group_names for n in g if n in out},
            "param_groups": groups}


def _gathered(zero) -> dict:
    """Element-wise sharding's full state: element-wise tensors all-gathered, scalars taken
    from the piece holding element 0."""
    state = zero.optimizer.state
    # per parameter: the element-wise keys, and the scalars of the piece holding element 0
    meta = {}
    for p, a, b, u, at, piece in _pieces(zero):
        entry = meta.setdefault(zero.names[p], {})
        for key, v in state.get(piece, {}).items():
            elementwise = isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == b - a
            if elementwise:
                entry[key] = "elementwise"
            elif a == 0:
                entry[key] = v.clone() if isinstance(v, torch.Tensor) else v
    meta = _exchange(zero, meta)
    shapes, out = _shapes(zero), {}
    for u in zero.units:
        keys = sorted({k for p in u.params for k, v in meta.get(zero.names[p], {}).items()
                       if isinstance(v, str) and v == "elementwise"})
        for key in keys:  # one all-gather per unit and kind of state
            shard = torch.zeros(u.shard_numel, dtype=u.dtype, device=u.shard_grad.device)
            for (p, a, b, at), piece in zip(u.pieces(), u.opt_params):
                if piece is not None and key in state.get(piece, {}):
                    shard[at:at + b - a].copy_(state[piece][key])
            flat = torch.empty(u.padded, dtype=shard.dtype, device=shard.device)
            comm.all_gather(flat, shard, zero.group)
            for p, o, size in zip(u.params, u.offsets, u.sizes):
                if meta.get(zero.names[p], {}).get(key) == "elementwise":
                    shaped = flat[o:o + size].clone().view(shapes[p][0])
                    out.setdefault(zero.names[p], {})[key] = shaped
    for name, entry in meta.items():
        for key, v in entry.items():
            if not (isinstance(v, str) and v == "elementwise"):
                out.setdefault(name, {})[key] = v
    return out


def _shapes(zero) -> dict:
    """``{param: (full shape, number of elements)}`` (a ZeRO-3 parameter itself is empty)."""
    return {p: (u.views[i].shape, u.sizes[i]) for u in zero.units for i, p in enumerate(u.params)}


def load(zero, sd: dict) -> None:
    """Load either form into ``zero``'s optimizer (no communication)."""
    if "pieces" in sd:
        here = sharded_state(zero)
        if (sd["world_size"], sd["rank"], list(map(tuple, sd["pieces"]))) != \
                (here["world_size"], here["rank"], here["pieces"]):
            raise ValueError(
                f"this sharded optimizer state was saved by rank {sd['rank']} of "
                f"{sd['world_size']} with another layout; this is rank {zero.index} of {zero.n}: "
                "load each rank's own file into the same model and world size, or save with "
                "zero.state_dict(full=True), which loads at any world size")
        zero.optimizer.load_state_dict(sd["optimizer"])
        return
    saved_group = {n: g for g in sd["param_groups"] for n in g["params"]}
    pieces, shapes = _layout(zero), _shapes(zero)
    state, groups, i = {}, [], 0
    for g, names in zip(zero.optimizer.param_groups, zero.group_names):
        missing = [n for n in names if n not in saved_group]
        if missing:
            raise ValueError(f"the optimizer state has no param group holding {missing[:4]}")
        hyper = _hyper(saved_group[names[0]]) if names else _hyper(g)
        groups.append({**hyper, "params": list(range(i, i + len(g["params"])))})
        for p, a, b in pieces[i:i + len(g["params"])]:
            saved = sd["state"].get(zero.names[p])
            if saved:
                state[i] = {k: _my_part(v, a, b, shapes[p][1], zero.whole is None)
                            for k, v in saved.items()}
            i += 1
    zero.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _my_part(v, a: int, b: int, numel: int, sliced: bool):
    """This rank's part of one saved state value: elements ``[a, b)`` of an element-wise
    tensor (``sliced``: the optimizer steps shard pieces), a copy of anything else."""
    if not isinstance(v, torch.Tensor):
        return v
    if sliced and v.dim() > 0 and v.numel() == numel:
        return v.reshape(-1)[a:b].clone()
    return v.clone()


def to_torch(full: dict, model: torch.nn.Module) -> dict:
    """The full form as a plain torch optimizer's ``state_dict()`` (state keyed by index),
    for ``optimizer.load_state_dict`` on an optimizer built over ``model``'s parameters in the
    same param groups, in the same order, as the ``Zero`` that saved it."""
    names = {n for n, _ in model.named_parameters()}
    index, groups, state = 0, [], {}
    for g in full["param_groups"]:
        ids = []
        for name in g["params"]:
            if name not in names:
                raise ValueError(f"the optimizer state names {name!r}, not a parameter of the model")
            if name in full["state"]:
                # copies: torch's load_state_dict keeps a tensor of the right dtype as is,
                # and its steps would then change ``full`` in place
                state[index] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                for k, v in full["state"][name].items()}
            ids.append(index)
            index += 1
        groups.append({**_hyper(g), "params": ids})
    return {"state": state, "param_groups": groups}
