"""Context parallelism: each sequence split over ``cp`` ranks, attention exchanging K and V.

Read in this order: :mod:`~edu3d.parallel.cp.zigzag` (which tokens each rank holds, and why
the zigzag split balances causal work), :mod:`~edu3d.parallel.cp.attention` (one block, the
log-sum-exp merge, then ring, all-gather and Ulysses attention) and
:mod:`~edu3d.parallel.cp.sequence` (``apply_cp``: the GPT's attention core and position
embedding swapped, nothing else).
"""

from edu3d.parallel.cp.zigzag import (check, positions, split_tokens, unsplit, valid_seq_lens,
                                      work)
from edu3d.parallel.cp.attention import (IMPLS, allgather_attention, block_attention, cp_core,
                                         last_work, merge, ring_attention, ulysses_attention,
                                         visible)
from edu3d.parallel.cp.sequence import apply_cp, split_batch

__all__ = ["IMPLS", "allgather_attention", "apply_cp", "block_attention", "check", "cp_core",
           "last_work", "merge", "positions", "ring_attention", "split_batch", "split_tokens",
           "ulysses_attention", "unsplit", "valid_seq_lens", "visible", "work"]
