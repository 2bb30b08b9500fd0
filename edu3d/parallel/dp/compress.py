"""Gradient compression as communication hooks: fewer bytes on the wire, a little error.

After reading this file you should understand four ways to shrink a gradient all-reduce and
what each costs:

``fp16`` / ``bf16``
    cast the bucket to 16 bits, all-reduce, cast back: half the bytes. fp16 keeps 10 mantissa
    bits but overflows above 65504; bf16 keeps fp32's range with 7 mantissa bits.
``int8``
    every rank scales its bucket by ``127 / max|g|`` and rounds to int8: a quarter of the
    bytes. Ranks have different scales, so int8 payloads cannot be summed on the wire: they
    are all-gathered with their scales and dequantized and summed locally.
``topk``
    send only the ``ratio`` largest-magnitude entries (values and indices). What was not sent
    is kept as an **error-feedback** residual and added to the next step's gradient, so no
    gradient is lost, only delayed (Stich et al. 2018; Lin et al. 2018, "Deep Gradient
    Compression").

A hook is ``hook(t, group) -> handle``: it leaves the **sum** over the group in ``t`` by the
time ``handle.wait()`` returns (:class:`~edu3d.parallel.dp.data_parallel.DataParallel` divides by N). Pass
one as ``DataParallel(..., comm_hook=make_hook("bf16"))`` or ``edu3d train --compress bf16``
(``run.parallel.compress``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.distributed import comm

HOOKS = ("fp16", "bf16", "int8", "topk")


class Done:
    """The handle of a hook that already finished its work."""

    def wait(self):
        return True

    def is_completed(self):
        return True


def cast_hook(dtype: torch.dtype):
    """All-reduce in ``dtype`` (16-bit): half the bytes of fp32."""
    def hook(t: torch.Tensor, group) -> Done:
        low = t.to(dtype)
        comm.all_reduce(low, group)
        t.copy_(low)
        return Done()
    return hook


def int8_hook(t: torch.Tensor, group) -> Done:
    """Quantize to int8 with a per-rank scale, all-gather payloads and scales, sum locally."""
    n = dist.get_world_size(group)
    scale = (t.abs().max() / 127).clamp_min(1e-30).reshape(1)
    q = torch.round(t / scale).to(torch.int8)
    qs = torch.empty(n * q.numel(), dtype=torch.int8, device=t.device)
    scales = torch.empty(n, dtype=scale.dtype, device=t.device)
    comm.all_gather(qs, q, group)
    comm.all_gather(scales, scale, group)
    t.copy_((qs.view(n, -1).to(t.dtype) * scales.unsqueeze(1)).sum(0))
    return Done()


class TopK:
    """Top-k sparsification with error feedback; one residual per buffer it has seen (keyed
    by the buffer's address: use it with the bucketed version, whose buffers persist)."""

    def __init__(self, ratio: float = 0.01):
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio {ratio} must be in (0, 1], e.g. 0.01 for 1%")
        self.ratio = ratio
        self.residual: dict[int, torch.Tensor] = {}

    def __call__(self, t: torch.Tensor, group) -> Done:
        n = dist.get_world_size(group)
        flat = t.view(-1)
        key = flat.data_ptr()
        corrected = flat + self.residual.get(key, 0)
        k = max(1, int(self.ratio * flat.numel()))
        idx = corrected.abs().topk(k).indices
        vals = corrected[idx]
        sent = torch.zeros_like(flat)
        sent[idx] = vals
        self.residual[key] = corrected - sent  # what was not sent waits for the next step
        all_idx = torch.empty(n * k, dtype=idx.dtype, device=t.device)
        all_vals = torch.empty(n * k, dtype=vals.dtype, device=t.device)
        comm.all_gather(all_idx, idx, group)
        comm.all_gather(all_vals, vals, group)
        flat.zero_()
        flat.index_add_(0, all_idx, all_vals)
        return Done()


def make_hook(name: str | None, topk_ratio: float = 0.01):
    """The hook called ``name`` (``None`` for plain fp32 all-reduce)."""
    if name is None or name == "none":
        return None
    if name == "fp16":
        return cast_hook(torch.float16)
    if name == "bf16":
        return cast_hook(torch.bfloat16)
    if name == "int8":
        return int8_hook
    if name == "topk":
        return TopK(topk_ratio)
    raise ValueError(f"compression {name!r} is not one of none, {', '.join(HOOKS)}")
