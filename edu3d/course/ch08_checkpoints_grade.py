"""The grader of exercise 08 (``exercises/reshard.py``): checkpoint pieces of real layouts.

Every case starts from a full serial tensor and cuts it the way a layout's ranks own it, with
the library's placement arithmetic (:func:`edu3d.ckpt.reshard.pieces`): TP boxes (the fused qkv
weight's three row blocks, a row-parallel weight's columns, the vocabulary-parallel
embedding padded to a multiple of tp), then ZeRO's flat windows, which start and end in the
middle of rows. The learner's ``full_tensor`` must rebuild the serial tensor from those
pieces, refuse pieces with a hole, and ``piece_for`` must cut what a rank of *another*
layout loads. Pure index arithmetic: no process is launched, each check takes milliseconds.
"""

from __future__ import annotations

import torch

from edu3d.ckpt import reshard

# (name, full shape, TP spec (dim, parts, true size)) of tensors of the course's GPT
QKV = ("blocks.0.attn.qkv.weight", [96, 32], (0, 3, None))  # column-parallel, fused q|k|v
PROJ = ("blocks.0.attn.proj.weight", [32, 32], (1, 1, None))  # row-parallel: columns
EMB = ("tok_emb.weight", [101, 16], (0, 1, 101))  # vocabulary-parallel, 101 rows padded


def serial(name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def saved_pieces(tensor, tp: int, dp: int = 1, zero: bool = False) -> list:
    """``(placement, data)`` of every rank of a ``tp`` x ``dp`` layout: each tp rank's shard,
    cut into ``dp`` uneven ZeRO windows of its flattening when ``zero``."""
    name, shape, spec = tensor
    full = serial(name, shape)
    out = []
    for t in range(tp):
        boxes = reshard.tp_boxes(shape, spec, t, tp)
        local = max(hi for _, _, hi in boxes)
        cuts = [0] + [round(local * (k + 0.4) / dp) for k in range(1, dp)] + [local]
        windows = [(cuts[k], cuts[k + 1]) for k in range(dp)] if zero else [None]
        for window in windows:
            for place, _, _ in reshard.pieces(name, "param", shape, spec, t, tp, window):
                out.append((place, reshard.read(full, place)))
    return out


def rebuilds(mod, tensor, tp: int, dp: int = 1, zero: bool = False) -> bool:
    got = mod.full_tensor(saved_pieces(tensor, tp, dp, zero))
    want = serial(tensor[0], tensor[1])
    assert tuple(got.shape) == tuple(want.shape), \
        f"full_tensor returned shape {tuple(got.shape)}, the tensor is {tuple(want.shape)}"
    wrong = int((got != want).sum())
    assert not wrong, f"{wrong} of {want.numel()} elements of {tensor[0]} differ from the serial tensor"
    return True


def refuses_a_hole(mod) -> bool:
    pieces = saved_pieces(PROJ, tp=2, dp=2, zero=True)
    try:
        mod.full_tensor(pieces[:1] + pieces[2:])  # one ZeRO shard lost
    except ValueError:
        return True
    raise AssertionError("full_tensor returned a tensor although a shard was missing; raise "
                         "ValueError when an element is covered by no piece")


def loads_into(mod, tensor, tp_from: int, dp_from: int, tp_to: int, dp_to: int = 1) -> bool:
    """Pieces of a tp_from x dp_from ZeRO layout, loaded into every rank of tp_to (x dp_to
    ZeRO: then each rank's piece is a run of its box that may start mid-row)."""
    name, shape, spec = tensor
    full = mod.full_tensor(saved_pieces(tensor, tp_from, dp_from, zero=True))
    want = serial(name, shape)
    targets = [place for place, _ in saved_pieces(tensor, tp_to, dp_to, zero=dp_to > 1)]
    for place in targets:
        got = mod.piece_for(full, place)
        assert torch.equal(got, reshard.read(want, place)), \
            f"piece_for gave the wrong numbers for box {place['box']}, flat {place['flat']} " \
            f"of tp{tp_to} x dp{dp_to}"
    return True
