"""One global batch cut into this rank's micro-batches, by one function: :func:`cut`.

After reading this file you should understand the three cuts every step makes, always in
this order, and why the tokens trained on are the serial run's whatever the layout:

1. **dp rows**: data-parallel rank ``i`` of ``dp`` takes rows ``[i·n/dp, (i+1)·n/dp)`` of the
   global batch's ``n`` (:func:`shard_rows`); the replicas together hold every row once.
   With ``share_each`` (a mixture of experts balanced over the whole step, ``--aux-scope
   global``) the batch is first cut into the ``m`` micro-batches and the rank takes its share
   of each: micro-batch j of every rank is then a share of the serial run's micro-batch j;
2. **cp pieces**: each context-parallel rank of that replica keeps its pieces of every row's
   sequence, the labels cut with their tokens (:func:`edu3d.parallel.cp.split_batch`, the
   zig-zag or plain split of :mod:`edu3d.parallel.cp.zigzag`); the pieces of the ``cp`` ranks
   make the whole sequence;
3. **micro-batches**: the rows are cut into ``m`` equal micro-batches, in row order
   (:func:`microbatches`), which the pipeline schedule runs (a one-stage pipeline is
   gradient accumulation).

Under ``--batching`` the global batch is documents (a :class:`~edu3d.train.batching.StepBatch`)
and the same cuts apply to its ``dp x m`` slots: rank ``i`` takes slots ``[i·m, (i+1)·m)``,
each slot's documents are laid into one ``[rows, width]`` tensor
(:func:`~edu3d.train.batching.collate`; ``width``: its longest document, or ``seq_len``
when packing), then cut into cp pieces (packing only). A micro-batch then also carries the
packed documents' ids (``doc``, whole: the model cuts it) and a **weight**, ``n·dp·cp·m/N``
for its ``n`` targets of the step's ``N``: its share of the global mean loss, times what the
engine's ``1/m`` and the dp x cp gradient average divide back out
(:mod:`edu3d.train.batching` says why counting tokens, not micro-batches, keeps the loss
the serial one).
"""

from __future__ import annotations

import torch

from edu3d.parallel.cp.sequence import split_batch
from edu3d.train.batching import IGNORE, StepBatch, collate, width


def cut(x, y, m: int, *, dp_index: int = 0, dp_size: int = 1, cp_rank: int = 0,
        cp_size: int = 1, split: str = "zigzag", device=None,
        share_each: bool = False) -> list[tuple]:
    """This rank's ``m`` micro-batches of the global batch ``(x, y)``: ``(x, y)`` tensors
    each, or, for a :class:`~edu3d.train.batching.StepBatch` ``x`` (``y`` is None),
    ``(x, y, doc, weight)`` each (what :class:`~edu3d.parallel.pp.engine.PipelineEngine`
    runs). ``device``: where the micro-batches go (a CUDA device: the global batch is copied
    from page-locked memory, asynchronously)."""
    if isinstance(x, StepBatch):
        return documents(x, m, dp_index, dp_size, cp_rank, cp_size, split, device)
    if device is not None and device.type == "cuda" and x.device.type == "cpu":
        x, y = (t.pin_memory().to(device, non_blocking=True) for t in (x, y))
    pieces = m if share_each else 1  # its share of each micro-batch, or of the whole batch
    xs, ys = shard_rows(x, dp_index, dp_size, pieces), shard_rows(y, dp_index, dp_size, pieces)
    if cp_size > 1:  # this rank's pieces of every sequence
        xs, ys = split_batch(xs, ys, cp_size, cp_rank, split)
    return microbatches(xs, ys, m)


def shard_rows(t: torch.Tensor, index: int, count: int, pieces: int = 1) -> torch.Tensor:
    """Data-parallel rank ``index``'s share of a global batch of ``n`` rows: rows ``[index ·
    n/count, (index+1) · n/count)``. With ``pieces`` > 1 the batch is first cut into that many
    equal pieces (the step's micro-batches) and the rank takes its share of each, in order."""
    rows = t.shape[0]
    if rows % (count * pieces):
        raise ValueError(f"{rows} rows do not split evenly over {count} data-parallel ranks"
                         + (f" x {pieces} micro-batches" if pieces > 1 else "")
                         + f"; use a global batch that is a multiple of {count * pieces}")
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is outside 0..{count - 1}")
    n = rows // (count * pieces)
    shares = [p[index * n:(index + 1) * n] for p in t.chunk(pieces)]
    return shares[0] if pieces == 1 else torch.cat(shares)


def microbatches(x: torch.Tensor, y: torch.Tensor, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a (local) batch into ``m`` equal micro-batches, in row order."""
    rows = x.shape[0]
    if m < 1 or rows % m:
        raise ValueError(f"{rows} rows do not split into {m} micro-batches; choose m among "
                         f"{', '.join(str(d) for d in range(1, rows + 1) if rows % d == 0)}")
    return list(zip(x.chunk(m), y.chunk(m)))


def documents(batch: StepBatch, m: int, dp_index: int, dp_size: int, cp_rank: int = 0,
              cp_size: int = 1, split: str = "zigzag", device=None) -> list[tuple]:
    """Data-parallel rank ``dp_index``'s ``m`` micro-batches of a step of documents, each
    ``(x, y, doc, weight)``: ``doc`` is the packed documents' ids (``None`` unless packing),
    ``weight`` the micro-batch's share of the global mean (see the module docstring). With
    ``cp_size > 1`` (packing only) x and y are context-parallel rank ``cp_rank``'s pieces and
    the weight counts its targets; ``doc`` stays whole (the model cuts it,
    :func:`~edu3d.parallel.cp.apply_cp`)."""
    if cp_size > 1 and batch.mode != "pack":
        raise ValueError(f"context parallelism cuts rows of seq_len tokens: --batching "
                         f"pack, not {batch.mode}")
    total = batch.targets
    out = []
    for rows in batch.groups(dp_size * m)[dp_index * m:(dp_index + 1) * m]:
        x, y, doc = collate(rows, width(rows, batch.mode, batch.seq_len), batch.mode == "pack")
        if cp_size > 1:  # this rank's pieces of every row, labels with their tokens
            x, y = split_batch(x, y, cp_size, cp_rank, split)
        n = int((y != IGNORE).sum())
        moved = [t if t is None or device is None else t.to(device) for t in (x, y, doc)]
        out.append((*moved, n * dp_size * cp_size * m / total))
    return out
