"""A deterministic synthetic corpus, generated in code.

After reading this file you should understand:

* the language: every sequence is a walk of ``period`` tokens on a sparse Markov chain (each
  token has ``SUCCESSORS`` possible next tokens with fixed, unequal probabilities), followed by
  a verbatim repeat of that walk. A bigram model can learn the walk; only attention can learn
  the repeat, so the loss keeps falling once attention finds it;
* the best achievable loss is known exactly (:meth:`SyntheticCorpus.entropy_floor`);
* batch ``step`` depends only on ``(vocab_size, seq_len, seed, step, global_batch)``, never on
  the parallel layout: every layout trains on the same tokens, each rank its cut of them
  (:func:`edu3d.train.cut.cut`).
"""

from __future__ import annotations

import hashlib

import torch

SUCCESSORS = 4
# Probability of each token's 1st, 2nd, ... successor: skewed, so a learned bigram table pays.
SUCCESSOR_PROBS = torch.tensor([8.0, 4.0, 2.0, 1.0]) / 15.0
STEP_ENTROPY = float(-(SUCCESSOR_PROBS * SUCCESSOR_PROBS.log()).sum())  # 1.14 nats per Markov step


def stream_seed(*parts: int | str) -> int:
    """A 64-bit seed from integers (and names): distinct ``(seed, step)`` pairs get unrelated
    streams."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed wants < 2**63


class SyntheticCorpus:
    """Sequences ``seq_len + 1`` tokens long: a Markov walk of ``period`` tokens, then a repeat.

    ``period = ceil((seq_len + 1) / 2)``, so token ``t`` equals token ``t - period`` for
    ``t >= period``. The chain (who may follow whom) is drawn once from ``seed``.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0):
        if vocab_size < SUCCESSORS:
            raise ValueError(f"vocab_size={vocab_size} is too small: each token needs "
                             f"{SUCCESSORS} distinct successors; use vocab_size >= {SUCCESSORS}")
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be a positive integer")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.period = (seq_len + 2) // 2
        g = torch.Generator().manual_seed(stream_seed(seed))
        # k sorted draws from [0, V-k], plus 0..k-1, are k distinct tokens; then shuffle which
        # of them gets which probability.
        starts = torch.randint(0, vocab_size - SUCCESSORS + 1, (vocab_size, SUCCESSORS),
                               generator=g).sort(dim=1).values
        distinct = starts + torch.arange(SUCCESSORS)
        order = torch.rand(vocab_size, SUCCESSORS, generator=g).argsort(dim=1)
        self.successors = distinct.gather(1, order)  # [V, k]: successors[i, j] has prob p[j]
        self._cum_probs = SUCCESSOR_PROBS.cumsum(0)

    def entropy_floor(self) -> float:
        """The exact best achievable mean loss, in nats per predicted token.

        Of the ``seq_len`` targets, the first ``period - 1`` are Markov steps, each with
        entropy ``STEP_ENTROPY`` whatever the previous token; the rest repeat a token already in
        the context and cost nothing to a model that has learned to copy. A model that cannot
        copy (a bigram table) stays near ``STEP_ENTROPY`` instead.
        """
        return (self.period - 1) * STEP_ENTROPY / self.seq_len

    def batch(self, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` int64 ``[global_batch, seq_len]``, ``y`` is ``x`` shifted left by one."""
        g = torch.Generator().manual_seed(stream_seed(self.seed, step, global_batch))
        walk = self.walks(global_batch, self.period, g)
        tokens = torch.cat([walk, walk], dim=1)[:, : self.seq_len + 1]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def walks(self, count: int, length: int, g: torch.Generator) -> torch.Tensor:
        """``[count, length]`` Markov walks on the chain, drawn from generator ``g``."""
        walk = torch.empty(count, length, dtype=torch.long)
        walk[:, 0] = torch.randint(0, self.vocab_size, (count,), generator=g)
        # Inverse-CDF sampling: which successor (0..k-1) does each uniform draw fall on?
        u = torch.rand(count, length, generator=g)
        choice = torch.searchsorted(self._cum_probs, u).clamp_(max=SUCCESSORS - 1)
        for t in range(1, length):
            walk[:, t] = self.successors[walk[:, t - 1], choice[:, t]]
        return walk
