"""Memory a rank holds, measured from its tensors, and what a forward pass saves for backward.

After reading this file you should understand how edu3d measures memory without asking the
allocator (which a CPU run does not have): it counts **storages, not tensors**. Views into
one flat buffer (ZeRO's shards, DDP's gradient buckets) share a storage and are counted
once, and a buffer freed by resizing its storage to zero (ZeRO-3 between uses) counts
nothing. The categories are the formulas' (:mod:`edu3d.plan.formulas`): ``params``,
``grads``, ``optimizer``; the activations are whatever autograd's ``saved_tensors_hooks``
see a forward pass save. Every rank measures at run time, which is why this lives beside
the other things every rank uses, not in the planner.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

CATEGORIES = ("params", "grads", "optimizer")


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``seen`` is shared across calls so a
    storage is counted in the first category that holds it)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        key = s.data_ptr()
        if s.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def measure(tensors_by_category: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Measured bytes per category, plus ``total`` (device memory); an optional ``"host"``
    list (state offloaded to CPU memory) is reported separately, outside the total."""
    seen: set = set()
    out = {cat: storage_bytes(tensors_by_category.get(cat, []), seen) for cat in CATEGORIES}
    out["total"] = sum(out.values())
    if "host" in tensors_by_category:  # offloaded to CPU memory: reported, not in the total
        out["host"] = storage_bytes(tensors_by_category["host"], seen)
    return out


def measure_activations(forward: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages ``forward()`` saves for backward (parameters, and
    whatever is in ``exclude``, left out): the activation memory held at the end of forward."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved.values())
