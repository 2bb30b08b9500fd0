"""ZeRO-3 with FP8 all-gathers: the weights travel in FP8, with their scales.

After reading this file you should understand why ZeRO-3's traffic shrinks under FP8 and
what the gather must agree on first (torchtitan's ``enable_fsdp_float8_all_gather`` with
``precompute_float8_dynamic_scale_for_fsdp``):

* ZeRO-3 all-gathers every unit's weights before each use. The FP8 layers cast their
  weights to FP8 right after anyway, so each rank can **cast its shard first** and gather
  1 byte per element instead of 4 (fp32) or 2 (bf16): the weights' share of ZeRO-3's 3Ψ
  traffic halves against bf16. Gradients are still reduce-scattered in fp32;
* the cast needs **the whole weight's scale** while each rank holds a slice: each rank
  takes its slice's amax of every weight of the unit, and one all-reduce of those few
  numbers (a max, over the ZeRO group, then over tp where the weight is a TP shard) gives
  every rank the serial weight's amax, so every slice is cast exactly as the serial model
  casts that weight. Delayed scaling has its scale already (the history) and sends nothing;
* after the gather, the FP8 bytes are widened back into the unit's fp32 buffer (``q / s``)
  so that autograd sees an ordinary parameter, and the layer is handed the scale
  (:attr:`~edu3d.parallel.fp8.scales.Fp8Scales.gathered`): its own cast of ``q / s`` by
  ``s`` gives back exactly the ``q`` that travelled (``tests/test_fp8.py``), as a GPU's
  FP8 product would use the gathered bytes directly;
* only **tensorwise** weights travel in FP8 (as in torchao): a rowwise layer casts its
  weight per output row for fprop and per input column for dgrad, two FP8 copies that no
  single gathered one can give. Rowwise weights, biases, LayerNorms and the embeddings
  are gathered in fp32; so are the weights a checkpoint or ``state_dict`` gathers, which
  must be the fp32 master copy.

:func:`split_units` gives the FP8 weights units of their own (one flat buffer holds one
kind of bytes); :func:`install` marks those units so that ZeRO-3's gathering
(:mod:`edu3d.parallel.zero.gathering`) calls :meth:`Fp8Gather.start` for them.
"""

from __future__ import annotations

import torch

from edu3d.distributed import comm
from edu3d.parallel.fp8.scales import Fp8Scales
from edu3d.parallel.fp8.scaling import E4M3, amax_to_scale, cast
from edu3d.parallel.tp import ops
from edu3d.parallel.zero.flat_unit import FlatUnit

SUFFIX = ".fp8"  # a unit of FP8 weights: its piece's name, then this


def split_units(units: list, weights: set) -> list:
    """``(name, modules, params)`` units with the FP8-gathered ``weights`` moved into units
    of their own, right after the rest of their piece (same modules: gathered, freed and
    reduced with it)."""
    out = []
    for name, modules, params in units:
        rest = [p for p in params if p not in weights]
        mine = [p for p in params if p in weights]
        if rest:
            out.append((name, modules, rest))
        if mine:
            out.append((name + SUFFIX, modules, mine))
    return out


class Widening:
    """An asynchronous FP8 gather (ZeRO-3's prefetch): ``wait()`` waits for the bytes, then
    widens them into the fp32 buffer."""

    def __init__(self, handle, widen):
        self.handle, self.widen = handle, widen

    def wait(self):
        self.handle.wait()
        self.widen()
        return True


class Fp8Gather:
    """How one unit of FP8 weights is all-gathered; ``scales``: each weight's layer's."""

    def __init__(self, scales: dict):
        self.scales = scales  # parameter -> Fp8Scales

    @staticmethod
    def pieces(u: FlatUnit):
        """:meth:`FlatUnit.pieces` with each parameter's position in the unit."""
        where = {id(p): i for i, p in enumerate(u.params)}
        for p, a, b, at in u.pieces():
            yield where[id(p)], a, b, at

    def weight_scales(self, u: FlatUnit, group) -> list[torch.Tensor]:
        """Each weight's scale, the same on every rank: from the amaxes of this rank's
        slices, maximised over ``group`` and tp (one all-reduce each, all weights at once),
        or from delayed scaling's history. Delayed scaling records the slices' amaxes."""
        local = [torch.zeros((), device=u.shard_param.device) for _ in u.params]
        for i, a, b, at in self.pieces(u):
            local[i] = u.shard_param[at:at + b - a].detach().abs().amax().float()
        every = [self.scales[p] for p in u.params]
        for s, a in zip(every, local):
            if s.delayed:
                s.record("w", a)
        amaxes = torch.stack(local)
        if any(not s.delayed or not len(s.history["w"]) for s in every):
            for g in (group, every[0].group):
                if g is not None and ops.group_size(g) > 1:
                    amaxes = ops.all_reduce_max(amaxes, g)
        return [s.settle("w", E4M3, lambda i=i: amaxes[i]) for i, s in enumerate(every)]

    def start(self, u: FlatUnit, group, async_op: bool):
        """Cast this rank's shard with the weights' scales, all-gather the bytes, widen them
        into ``u.flat_param``; returns a :class:`Widening` when ``async_op``."""
        scales = self.weight_scales(u, group)
        per_element = torch.ones(u.shard_numel, device=u.shard_param.device)
        for i, a, b, at in self.pieces(u):
            per_element[at:at + b - a] = scales[i]
        shard = cast(u.shard_param.detach(), per_element, E4M3).view(torch.uint8)
        gathered = torch.empty(u.padded, dtype=torch.uint8, device=shard.device)
        handle = comm.all_gather(gathered, shard, group, async_op=async_op)

        def widen():
            values = gathered.view(E4M3).float()
            with torch.no_grad():
                for p, o, size, s in zip(u.params, u.offsets, u.sizes, scales):
                    u.flat_param[o:o + size].copy_(values[o:o + size] / s)
                    self.scales[p].gathered = s
                u.flat_param[u.numel:].zero_()

        if async_op:
            return Widening(handle, widen)
        widen()
        return None


def gathered_weights(module: torch.nn.Module) -> dict:
    """``{weight: its layer's Fp8Scales}`` for every tensorwise FP8 layer of ``module``:
    the weights ZeRO-3 gathers in FP8."""
    return {m.weight: m.fp8 for m in module.modules()
            if isinstance(getattr(m, "fp8", None), Fp8Scales) and not m.fp8.recipe.rowwise}


def install(zero, scales: dict) -> int:
    """Let ``zero`` (stage 3) gather the units holding only FP8 weights (``scales``:
    :func:`gathered_weights`) in FP8; returns how many units it marked."""
    marked = 0
    for u in zero.units:
        if all(p in scales for p in u.params):
            u.gather_as = Fp8Gather({p: scales[p] for p in u.params})
            marked += 1
    return marked
