"""Placement arithmetic: where each piece of a sharded checkpoint sits in its full tensor.

After reading this file you should understand how a checkpoint written by one layout is
read by any other, with nothing but index arithmetic:

* every rank writes the **pieces** of training state it owns. A piece is a block of one
  serial tensor, described by its *placement*::

      {"name": "blocks.0.attn.qkv.weight",   # the serial parameter's name
       "kind": "param",                       # or "exp_avg", "exp_avg_sq" (AdamW's moments)
       "shape": [192, 64],                    # the full (serial) tensor's shape
       "box": [[0, 32], [0, 64]],             # a range [start, stop) per dimension
       "flat": [0, 2048]}                     # elements lo..hi-1 of the box, read row-major

  and its data is a 1-D tensor of ``hi - lo`` numbers;
* **tensor parallelism** cuts boxes (:func:`tp_boxes`): a column-parallel weight is a range
  of rows, a row-parallel one a range of columns, the fused ``qkv`` weight *three* row
  ranges (the same heads of q, k and v), the vocabulary-parallel embedding a row range
  clipped at the true vocabulary (the padding rows are nobody's data);
* **ZeRO** cuts a flat range out of what a rank holds: its shard is a slice of a flat buffer
  of parameters laid end to end, so it covers elements ``[a, b)`` of each parameter's
  (TP-local) flattening; intersected with the TP boxes that gives ``flat`` (:func:`pieces`);
* a box whose ``flat`` covers all of it is a plain block; a ZeRO piece is a run of elements
  that may start and end in the middle of a row.

**Loading into another layout** is then the same operation for every layout pair: for each
piece the new rank needs, take the saved pieces of the same name and kind whose
:func:`bounding_box` overlaps it, :func:`assemble` them into the full tensor, and cut the
needed piece out (:func:`read`). The files to open are those holding an overlapping piece;
the others are never read.
"""

from __future__ import annotations

import math

import torch

from edu3d.model.shapes import padded_size


def tp_boxes(shape, spec, index: int, size: int) -> list[tuple[list, int, int]]:
    """The boxes of a full tensor of ``shape`` that tp rank ``index`` of ``size`` holds, as
    ``(box, lo, hi)``: the box's elements are elements ``[lo, hi)`` of the rank's local
    shard, flattened. ``spec`` is the TP shard spec ``(dim, parts, true size)`` (see
    :func:`edu3d.parallel.tp.layers.shard`) or ``None`` for a tensor held whole."""
    shape = list(shape)
    whole = [[0, s] for s in shape]
    if spec is None or size == 1:
        return [(whole, 0, math.prod(shape))]
    dim, parts, true = spec
    full = padded_size(shape[dim], size) if true is not None else shape[dim]
    block = full // parts  # the fused qkv is [q | k | v]: three blocks, each cut tp ways
    rows = block // size  # what one rank holds of one block along dim
    inner = math.prod(shape[dim + 1:])
    if dim != 0 and (parts != 1 or full != shape[dim]):
        raise ValueError(f"cannot place a shard cut along dim {dim} into {parts} parts")
    out = []
    for j in range(parts):
        start = j * block + index * rows
        stop = min(start + rows, shape[dim])  # padding rows beyond the true size: skipped
        if stop <= start:
            continue
        box = [list(r) for r in whole]
        box[dim] = [start, stop]
        if dim == 0:  # the local shard stacks the blocks' rows: block j starts at row j*rows
            lo = j * rows * inner
            out.append((box, lo, lo + (stop - start) * inner))
        else:  # one box, the whole local shard
            out.append((box, 0, math.prod(shape[:dim]) * (stop - start) * inner))
    return out


def pieces(name: str, kind: str, shape, spec, tp_index: int, tp_size: int,
           window: tuple[int, int] | None = None) -> list[tuple[dict, int, int]]:
    """Placements of what a rank holds of ``name``: its TP boxes, cut to the ``window``
    ``[a, b)`` of its local flattening that it holds (a ZeRO shard; ``None``: all of it).
    Returns ``(placement, s, e)``: the piece is elements ``[s, e)`` of the local flattening."""
    out = []
    for box, lo, hi in tp_boxes(shape, spec, tp_index, tp_size):
        a, b = window if window is not None else (lo, hi)
        s, e = max(a, lo), min(b, hi)
        if s < e:
            out.append(({"name": name, "kind": kind, "shape": list(shape), "box": box,
                         "flat": [s - lo, e - lo]}, s, e))
    return out


def _slices(box) -> tuple:
    return tuple(slice(a, b) for a, b in box)


def write(full: torch.Tensor, place: dict, data: torch.Tensor) -> None:
    """Put a piece's ``data`` where ``place`` says in ``full``."""
    block = full[_slices(place["box"])]
    lo, hi = place["flat"]
    if (lo, hi) == (0, block.numel()):  # the whole box: a block copy
        block.copy_(data.reshape(block.shape))
        return
    flat = block.reshape(-1).clone()  # a box of a larger tensor is not contiguous in general
    flat[lo:hi] = data.reshape(-1).to(flat.dtype)
    block.copy_(flat.view(block.shape))


def read(full: torch.Tensor, place: dict) -> torch.Tensor:
    """The piece at ``place`` cut out of ``full`` (1-D, a copy)."""
    lo, hi = place["flat"]
    return full[_slices(place["box"])].reshape(-1)[lo:hi].clone()


def place_all(saved: list[tuple[dict, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Write every saved ``(placement, data)`` piece of one tensor into a full tensor;
    returns it and a boolean mask of the elements some piece covered."""
    shape = saved[0][0]["shape"]
    full = torch.zeros(shape, dtype=saved[0][1].dtype)
    seen = torch.zeros(shape, dtype=torch.bool)
    for place, data in saved:
        write(full, place, data)
        write(seen, place, torch.ones(data.numel(), dtype=torch.bool))
    return full, seen


def assemble(name: str, saved: list[tuple[dict, torch.Tensor]], kind: str = "param",
             need: dict | None = None) -> torch.Tensor:
    """The full tensor ``name`` (``kind``) from saved ``(placement, data)`` pieces, any
    layout's. Raises ``ValueError`` if the pieces leave part of it (or of the ``need``
    placement, when given) uncovered: a missing shard."""
    mine = [(p, d) for p, d in saved if p["name"] == name and p["kind"] == kind]
    if not mine:
        raise ValueError(f"no saved piece of {name} ({kind})")
    full, seen = place_all(mine)
    if not (read(seen, need).all() if need is not None else seen.all()):
        where = f"the box {need['box']}" if need is not None else "the whole tensor"
        raise ValueError(f"the saved pieces of {name} ({kind}) do not cover {where}: a "
                         "shard is missing")
    return full


def bounding_box(place: dict) -> list:
    """The smallest box holding a piece: its box with the first dimension narrowed to the
    rows its flat range touches (a ZeRO piece may start or end inside a row)."""
    box = [list(r) for r in place["box"]]
    row = math.prod(b - a for a, b in box[1:])
    lo, hi = place["flat"]
    box[0] = [box[0][0] + lo // row, box[0][0] + (hi - 1) // row + 1]
    return box


def overlaps(a: dict, b: dict) -> bool:
    """Do two placements share any element (same tensor, overlapping bounding boxes)?"""
    if a["name"] != b["name"] or a["kind"] != b["kind"]:
        return False
    return all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1)
               in zip(bounding_box(a), bounding_box(b)))
