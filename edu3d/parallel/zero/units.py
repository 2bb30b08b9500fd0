"""ZeRO's units: which parameters are sharded, gathered and reduced together.

After reading this file you should understand how any ``nn.Module`` is cut into **units**
(FSDP calls them the modules it wraps), the policy :class:`~edu3d.parallel.zero.sharding.Zero`
uses by default:

* a child of the model that is a ``ModuleList``, ``ModuleDict`` or ``Sequential`` (the
  transformer's blocks) gives one unit per element: ``blocks[3]`` becomes unit ``block3``
  (the container's name, singular, then the element's key). A model that *is* such a
  container gives one unit per child;
* the other children are grouped in call order between those containers: before the first
  one ``embed``, after the last one ``head`` (between two: ``mid1``, ...); a model with no
  container is a single unit, ``model``;
* parameters of the model itself (not of a child) are one unit, ``root``, gathered for the
  whole forward;
* a parameter shared by two units (a tied embedding and LM head) is a unit of its own,
  ``tied``, whose modules are every module that holds it: so each user gathers it, and the
  first and the last pipeline stage shard it identically (when both stages sit on one rank,
  as in a V, their two ``tied`` units merge into one: :func:`merge_shared`);
* a unit's flat buffer has one dtype: a unit whose parameters mix dtypes is split, one unit
  per dtype (``head.bfloat16``), never cast.

edu3d's GPT (``tok_emb``, ``pos_emb``, ``blocks``, ``ln_f``, ``lm_head``) is one case:
``embed``, ``block0`` ... ``blockL-1``, ``head``, plus ``tied`` when its weights are tied, and
its pipeline stages (``blocks`` a dict keyed by the serial layer number) the same. Frozen
parameters (``requires_grad=False``) belong to no unit. Every trainable parameter lands in
exactly one unit: :func:`model_units` checks it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _trainable(module: nn.Module, recurse: bool = True) -> list:
    return [p for p in module.parameters(recurse=recurse) if p.requires_grad]


def child_pieces(model: nn.Module) -> list[tuple[str, list]]:
    """``(name, modules)`` per piece of ``model`` in registration order, by the policy above
    (before shared parameters are taken out and dtypes split)."""
    if isinstance(model, CONTAINERS):
        return [(f"layer{key}", [m]) for key, m in model.named_children() if _trainable(m)]
    containers = [name for name, m in model.named_children()
                  if isinstance(m, CONTAINERS) and _trainable(m)]
    pieces = [("root", [model])] if _trainable(model, recurse=False) else []
    if not containers:
        mods = [m for _, m in model.named_children() if _trainable(m)]
        return pieces + ([("model", mods)] if mods else [])
    loose, seen = [], 0

    def flush():
        if loose:
            name = "embed" if seen == 0 else "head" if seen == len(containers) else f"mid{seen}"
            pieces.append((name, list(loose)))
            loose.clear()

    for name, child in model.named_children():
        if name in containers:
            flush()
            seen += 1
            stem = name[:-1] if name.endswith("s") and len(name) > 1 else name
            pieces += [(f"{stem}{key}", [m]) for key, m in child.named_children() if _trainable(m)]
        elif _trainable(child):
            loose.append(child)
    flush()
    return pieces


def _params(name: str, modules: list) -> list:
    """A piece's parameters: the ``root`` piece's are the model's own, not its children's."""
    if name == "root":
        return list(modules[0].parameters(recurse=False))
    return [p for m in modules for p in m.parameters()]


def _holders(name: str, modules: list) -> list:
    """The modules of a piece that hold parameters directly."""
    if name == "root":
        return list(modules)
    return [m for sub in modules for m in sub.modules()]


def units_of(pieces: list[tuple[str, list]], tied=None) -> list[tuple[str, list, list]]:
    """``(name, modules, params)`` per unit from ``(name, modules)`` in call order.

    A parameter held by the modules of two pieces, or the given ``tied`` one (the embedding
    tied across pipeline stages), is a unit of its own whose modules are every module that
    holds it directly. Every other parameter belongs to its piece; a piece keeps only the
    modules holding its parameters."""
    owners: dict[int, set] = {}
    for i, (name, modules) in enumerate(pieces):
        for p in _params(name, modules):
            owners.setdefault(id(p), set()).add(i)
    shared, seen = [], set()
    for name, modules in pieces:
        for p in _params(name, modules):
            if p.requires_grad and id(p) not in seen and (len(owners[id(p)]) > 1 or p is tied):
                seen.add(id(p))
                shared.append(p)
    if tied is not None and id(tied) not in seen:
        seen.add(id(tied))
        shared.append(tied)
    units = []
    for k, s in enumerate(shared):
        users = [m for name, mods in pieces for m in _holders(name, mods)
                 if any(p is s for p in m.parameters(recurse=False))]
        units.append(("tied" if len(shared) == 1 else f"tied{k}", users, [s]))
    for name, modules in pieces:
        params = []
        for p in _params(name, modules):
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                params.append(p)
        held = {id(p) for p in params}
        kept = modules if name == "root" else \
            [m for m in modules if any(id(p) in held for p in m.parameters())]
        if params:
            units.append((name, kept, params))
    return units


def merge_shared(units: list[tuple[str, list, list]]) -> list[tuple[str, list, list]]:
    """Units of several pipeline stages on one rank that hold the same tensor become one,
    whose modules are all of theirs: a V puts the first and the last stage on rank 0, and a
    tied embedding then has a ``tied`` unit in each. A tensor shared with anything else is
    an error, as in :func:`check_cover`."""
    out: list[tuple[str, list, list]] = []
    for name, modules, params in units:
        same = next((u for u in out if len(u[2]) == len(params)
                     and all(p is q for p, q in zip(u[2], params))), None)
        if same is not None:
            same[1].extend(m for m in modules if all(m is not n for n in same[1]))
            continue
        out.append((name, list(modules), params))
    return out


def by_dtype(units: list[tuple[str, list, list]]) -> list[tuple[str, list, list]]:
    """Split every unit whose parameters mix dtypes into one unit per dtype (first-seen
    order), so that a flat buffer never casts a parameter."""
    out = []
    for name, modules, params in units:
        dtypes = list(dict.fromkeys(p.dtype for p in params))
        if len(dtypes) == 1:
            out.append((name, modules, params))
            continue
        for dt in dtypes:
            mine = [p for p in params if p.dtype == dt]
            mods = [m for m in modules if any(p is q for p in m.parameters() for q in mine)]
            out.append((f"{name}.{str(dt).removeprefix('torch.')}", mods, mine))
    return out


def check_cover(model: nn.Module, units: list[tuple[str, list, list]]) -> None:
    """Every trainable parameter of ``model`` in exactly one unit, and nothing else."""
    count: dict[int, int] = {}
    for _, _, params in units:
        for p in params:
            count[id(p)] = count.get(id(p), 0) + 1
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    twice = [names.get(i, "?") for i, c in count.items() if c > 1]
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in count]
    foreign = [i for i in count if i not in names]
    if twice or missing or foreign:
        raise ValueError(f"ZeRO units must hold every trainable parameter once: in two units "
                         f"{twice}, in none {missing}, not the model's: {len(foreign)}")


def model_units(model: nn.Module, tied: torch.Tensor | None = None) -> list[tuple[str, list, list]]:
    """``(name, modules in call order, parameters)`` per unit of ``model`` by the policy of
    this module; ``tied`` names a parameter tied across pipeline stages (one a single model
    ties, like GPT's embedding and LM head, is found here)."""
    units = by_dtype(units_of(child_pieces(model), tied))
    check_cover(model, units)
    return units
