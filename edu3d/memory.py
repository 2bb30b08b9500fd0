"""Memory per rank: measured from the tensors a rank holds, and predicted by the formulas.

After reading this file you should understand the four categories every chart uses:

``params``     the weights (full, or this rank's shard under ZeRO-3);
``grads``      the gradients (full, or a shard under ZeRO-2 and 3);
``optimizer``  the optimizer's state: Adam keeps two moments per parameter (8 bytes in fp32),
               plus an fp32 master copy of the weights in mixed precision (K = 12);
``activations`` what the forward pass saves for backward.

The **measurement** counts storages, not tensors: views into one flat buffer (ZeRO's shards,
DDP's gradient buckets) share a storage and are counted once, and a buffer freed by resizing
its storage to zero (ZeRO-3 between uses) counts nothing. The **estimator** is the ZeRO
paper's (Rajbhandari et al. 2019) with Ψ parameters, N data-parallel ranks and the bytes per
element as parameters; with 2-byte weights and gradients and K = 12 it is DESIGN.md's
``16Ψ``, ``4Ψ + KΨ/N``, ``2Ψ + (2+K)Ψ/N`` and ``(4+K)Ψ/N``. Any difference between the two
comes from padding: each flat buffer is rounded up to a multiple of N.
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


def zero_bytes(psi: int, n: int, stage: int, param_bytes: int = 4, grad_bytes: int = 4,
               optimizer_bytes: int = 8) -> dict[str, float]:
    """Predicted bytes per rank for ZeRO ``stage`` (0 = plain data parallelism).

    fp32 Adam: ``param_bytes=4, grad_bytes=4, optimizer_bytes=8``; mixed-precision Adam:
    ``2, 2, 12`` (the paper's K = 12: fp32 master weights, momentum and variance).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} must be 0, 1, 2 or 3")
    if n < 1:
        raise ValueError(f"data-parallel degree {n} must be at least 1")
    out = {"params": param_bytes * psi / (n if stage >= 3 else 1),
           "grads": grad_bytes * psi / (n if stage >= 2 else 1),
           "optimizer": optimizer_bytes * psi / (n if stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                               recompute: str | None = None) -> float:
    """Activation bytes of one transformer layer in 16-bit (Korthikanti et al. 2022).

    ``sbh(34 + 5as/h)``; with TP ``sbh(10 + 24/t + 5as/(ht))``; with TP+SP
    ``sbh/t (34 + 5as/h)``; ``recompute="selective"`` drops the ``5as/h`` term,
    ``"full"`` keeps only the layer input ``2sbh``.
    """
    if recompute == "full":
        return 2 * s * b * h
    attn = 0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h / t * (34 + attn)
    return s * b * h * (10 + 24 / t + attn / t)


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
