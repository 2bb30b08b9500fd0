"""What the CUDA caching allocator saw during a step: its history, its pool, its fragmentation.

After reading this file you should understand the memory a GPU run really uses, beyond the
tensors (:mod:`edu3d.train.memory_recorder` counts those):

* **the caching allocator**: ``cudaMalloc`` is slow and synchronises the device, so PyTorch
  asks CUDA for large **segments** and cuts them into **blocks** for tensors. A freed tensor's
  block goes back to the allocator's pool, not to CUDA: ``memory_reserved`` (the segments)
  stays above ``memory_allocated`` (the live blocks). Blocks of a segment are split to fit a
  request and merged again when neighbours are free;
* **fragmentation**: free blocks stuck between live ones in a segment (``inactive_split``
  bytes in ``torch.cuda.memory_stats``) are reserved but unusable for any request larger
  than the hole. A training step that frees and allocates tensors of changing sizes in a
  changing order (gradients allocated by autograd, freed by ``zero_grad(set_to_none=True)``,
  between activations) leaves such holes; when no hole is big enough the allocator asks
  CUDA for more, and at the limit frees its cache and retries (``num_alloc_retries``), or
  fails with memory free on paper;
* **flat buffers are a pool of their own**: DP's gradient buckets and ZeRO's flat units are
  allocated once, at their full size, and reused every step (gradients written in place,
  ZeRO-3's unit regrown to the same size), so nothing in them is split or moved;
* **the history**: ``torch.cuda.memory._record_memory_history`` records every ``alloc``,
  ``free_requested``/``free_completed`` and ``segment_alloc``/``segment_free`` with its
  address and size; ``torch.cuda.memory._snapshot()`` returns it with the segments and their
  blocks (the format is documented in ``torch.cuda.memory._snapshot``).
  :func:`allocator_timeline` replays the history into allocated and reserved bytes over
  time, :func:`fragmentation` reads a snapshot's segments. Both are pure functions of the
  snapshot dict, tested on a recorded fixture where no GPU is present.

torch's CUDA calls are only made by :func:`history` and :func:`pool_stats`; everything
else runs anywhere.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

MAX_ENTRIES = 200_000  # allocator events kept (a tiny step makes a few thousand)


@contextlib.contextmanager
def history(device=None, max_entries: int = MAX_ENTRIES) -> Iterator[dict]:
    """Record the allocator's every action inside the block; the dict yielded receives the
    snapshot (``"snapshot"``) when the block ends. CUDA only."""
    if not torch.cuda.is_available():
        raise RuntimeError("the allocator's history is a CUDA feature: no GPU here")
    out: dict = {}
    torch.cuda.memory._record_memory_history(max_entries=max_entries, device=device)
    try:
        yield out
    finally:
        out["snapshot"] = torch.cuda.memory._snapshot(device)
        torch.cuda.memory._record_memory_history(enabled=None, device=device)


def _device_trace(snapshot: dict, device: int | None) -> list[dict]:
    traces = snapshot.get("device_traces", [])
    if device is not None:
        return traces[device] if device < len(traces) else []
    return max(traces, key=len) if traces else []


def allocator_timeline(snapshot: dict, device: int | None = None) -> list[dict]:
    """Replay the recorded history: one row per allocator action, ``{"i", "t", "action",
    "size", "allocated", "reserved"}``, bytes *relative to the start of the recording*
    (what existed before it is not in the history). ``t`` is the entry's ``time_us`` when
    the snapshot has it, else its index. A free counts when completed (``free_completed``):
    until then another stream may still use the block."""
    rows, allocated, reserved = [], 0, 0
    for i, e in enumerate(_device_trace(snapshot, device)):
        action, size = e.get("action"), int(e.get("size", 0))
        if action == "alloc":
            allocated += size
        elif action == "free_completed":
            allocated -= size
        elif action == "segment_alloc":
            reserved += size
        elif action == "segment_free":
            reserved -= size
        else:
            continue
        rows.append({"i": i, "t": e.get("time_us", i), "action": action, "size": size,
                     "allocated": allocated, "reserved": reserved})
    return rows


def fragmentation(snapshot: dict, device: int | None = None) -> dict:
    """The pool at the snapshot: ``reserved`` (segments), ``allocated`` (live blocks),
    ``cached`` (reserved - allocated), ``inactive_split`` (free blocks inside segments that
    also hold live ones: the holes), ``largest_free`` (the biggest block a request could
    get without asking CUDA), ``segments`` and ``blocks``."""
    reserved = allocated = split = largest = blocks = segments = 0
    for seg in snapshot.get("segments", []):
        if device is not None and seg.get("device", device) != device:
            continue
        segments += 1
        reserved += int(seg["total_size"])
        live = [b for b in seg.get("blocks", []) if b["state"] != "inactive"]
        free = [b for b in seg.get("blocks", []) if b["state"] == "inactive"]
        blocks += len(seg.get("blocks", []))
        allocated += sum(int(b["size"]) for b in live if b["state"] == "active_allocated")
        if live:
            split += sum(int(b["size"]) for b in free)
        largest = max([largest, *(int(b["size"]) for b in free)])
    return {"reserved": reserved, "allocated": allocated, "cached": reserved - allocated,
            "inactive_split": split, "largest_free": largest, "segments": segments,
            "blocks": blocks}


def pool_stats(device=None) -> dict:
    """The allocator's counters now (``torch.cuda.memory_stats``): current and peak
    allocated, reserved and inactive-split bytes, cudaMalloc retries. CUDA only."""
    s = torch.cuda.memory_stats(device)
    out = {}
    for key in ("allocated_bytes", "reserved_bytes", "inactive_split_bytes"):
        for when in ("current", "peak"):
            out[f"{key[:-6]}_{when}"] = int(s.get(f"{key}.all.{when}", 0))
    out["alloc_retries"] = int(s.get("num_alloc_retries", 0))
    out["segments"] = int(s.get("segment.all.current", 0))
    return out
