"""Which tokens of a sequence each context-parallel rank holds: the plain and zigzag splits.

After reading this file you should understand:

* context parallelism (CP) cuts every sequence over ``cp`` ranks; each rank keeps only its
  tokens' activations, so a sequence ``cp`` times longer fits in the same memory;
* the **plain** split gives rank ``r`` the contiguous ``r``-th ``1/cp`` of the sequence. Under
  a causal mask that is unfair: the last rank's queries see every key, the first rank's see
  only its own, so the last rank does about ``2cp - 1`` times the first one's work;
* the **zigzag** split (ring-flash-attention, Megatron-LM's ``get_batch_on_this_cp_rank``)
  cuts the sequence into ``2cp`` equal chunks and gives rank ``r`` chunks ``r`` and
  ``2cp - 1 - r``: one early chunk (little work) and one late chunk (much work), so every
  rank does the same work (:func:`work` counts it);
* a rank's tokens keep their *global* positions: the position embedding and the causal mask
  use them, never the local index.

Everything here except :func:`split_tokens` and :func:`unsplit` is plain Python.
"""

from __future__ import annotations

import torch

SPLITS = ("zigzag", "plain")


def _chunks(cp: int, split: str) -> int:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r} must be a positive integer")
    return 2 * cp if split == "zigzag" else cp


def valid_seq_lens(cp: int, split: str = "zigzag", upto: int = 64) -> list[int]:
    """The sequence lengths from 1 to ``upto`` that ``cp`` ranks can split ``split``'s way."""
    n = _chunks(cp, split)
    return [s for s in range(1, upto + 1) if s % n == 0]


def check(seq_len: int, cp: int, split: str = "zigzag") -> None:
    """Raise ``ValueError`` naming the valid lengths if ``seq_len`` cannot be split: zigzag
    needs ``2*cp`` equal chunks, plain ``cp``."""
    n = _chunks(cp, split)
    if seq_len % n:
        ok = ", ".join(map(str, valid_seq_lens(cp, split, max(4 * n, seq_len + n))))
        raise ValueError(f"split={split!r} cuts seq_len={seq_len} into {n} equal chunks for "
                         f"cp={cp}, which does not divide it; choose seq_len in {ok}, ...")


def chunk_ids(cp: int, rank: int, split: str = "zigzag") -> list[int]:
    """The chunks rank ``rank`` holds, in local order: ``[r, 2cp-1-r]`` or ``[r]``."""
    _chunks(cp, split)
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} is not in 0..{cp - 1}")
    return [rank, 2 * cp - 1 - rank] if split == "zigzag" else [rank]


def positions(seq_len: int, cp: int, rank: int, split: str = "zigzag") -> list[int]:
    """The global positions rank ``rank`` holds, in its local order."""
    check(seq_len, cp, split)
    size = seq_len // _chunks(cp, split)
    return [p for c in chunk_ids(cp, rank, split) for p in range(c * size, (c + 1) * size)]


def work(seq_len: int, cp: int, split: str = "zigzag") -> list[int]:
    """Per rank, how many causal score entries (query, key) with ``key_pos <= query_pos`` its
    queries have: the attention work each rank must do, whoever holds the keys.
    Plain: rank ``r`` grows with ``r``; zigzag: all equal."""
    return [sum(p + 1 for p in positions(seq_len, cp, r, split)) for r in range(cp)]


def split_tokens(t: torch.Tensor, cp: int, rank: int, split: str = "zigzag",
                 dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``t`` (the sequence along ``dim``), in its local order."""
    check(t.shape[dim], cp, split)
    pieces = t.chunk(_chunks(cp, split), dim=dim)
    return torch.cat([pieces[c] for c in chunk_ids(cp, rank, split)], dim=dim)


def unsplit(parts: list[torch.Tensor], cp: int, split: str = "zigzag",
            dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`split_tokens`: every rank's part (in rank order) put back into
    one sequence in global order."""
    if len(parts) != cp:
        raise ValueError(f"expected {cp} parts (one per rank), got {len(parts)}")
    chunks: list = [None] * _chunks(cp, split)
    for rank, part in enumerate(parts):
        ids = chunk_ids(cp, rank, split)
        for c, piece in zip(ids, part.chunk(len(ids), dim=dim)):
            chunks[c] = piece
    return torch.cat(chunks, dim=dim)
