"""A synthetic corpus of documents of different lengths, generated in code.

After reading this file you should understand:

* real corpora are not made of equal sequences: documents are short and long, with a long
  tail. Here a document's length (the tokens it predicts) is drawn from a **log-normal**
  distribution with a chosen mean and spread ``sigma`` (the standard deviation of the
  length's logarithm), rounded and clipped to ``[min_len, seq_len]``
  (:func:`lognormal_mu`: the ``mu`` that gives that mean);
* a document of length ``n`` is ``n + 1`` tokens of the same language as
  :class:`~edu3d.train.data.SyntheticCorpus` (a Markov walk, then its verbatim repeat), so a
  short document is as learnable as a long one, and the model is the same;
* everything is a function of ``(seed, key)``: the documents a step draws never depend on
  the layout or on the steps before (a resumed run reads the same ones).
"""

from __future__ import annotations

import math

import torch

from edu3d.train.data import STEP_ENTROPY, SyntheticCorpus, stream_seed

MIN_LEN = 2  # the shortest document: a walk and one repeated token


def lognormal_mu(mean: float, sigma: float) -> float:
    """The ``mu`` of a log-normal with this ``mean``: ``E[e^X] = e^(mu + sigma^2/2)``."""
    return math.log(mean) - sigma * sigma / 2


class DocumentCorpus:
    """Documents with log-normal lengths (mean ``mean`` tokens, spread ``sigma``), clipped to
    ``[min_len, seq_len]``, in the language of :class:`~edu3d.train.data.SyntheticCorpus`."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, mean: float | None = None,
                 sigma: float = 0.8, min_len: int = MIN_LEN):
        if mean is None:
            mean = seq_len / 4
        if not 0 < mean <= seq_len:
            raise ValueError(f"mean document length {mean} must be in (0, seq_len={seq_len}]")
        if sigma < 0:
            raise ValueError(f"sigma={sigma} must be >= 0 (0: every document the same length)")
        if not 1 <= min_len <= seq_len:
            raise ValueError(f"min_len={min_len} must be in 1..seq_len={seq_len}")
        self.language = SyntheticCorpus(vocab_size, seq_len, seed=seed)
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.mean, self.sigma, self.min_len = float(mean), float(sigma), min_len

    def lengths(self, key: tuple, count: int) -> torch.Tensor:
        """``count`` document lengths (int64) for stream ``key``, e.g. ``("step", 3)``."""
        g = torch.Generator().manual_seed(stream_seed(self.seed, "lengths", *key))
        normal = torch.randn(count, generator=g, dtype=torch.float64)
        raw = torch.exp(lognormal_mu(self.mean, self.sigma) + self.sigma * normal)
        return raw.round().clamp(self.min_len, self.seq_len).long()

    def documents(self, key: tuple, lengths: list[int]) -> list[torch.Tensor]:
        """One token tensor per length ``n``: ``n + 1`` tokens (inputs ``[:-1]``, targets
        ``[1:]``), a walk of ``ceil((n+1)/2)`` tokens and its repeat."""
        if not lengths:
            return []
        g = torch.Generator().manual_seed(stream_seed(self.seed, "documents", *key))
        periods = [(n + 2) // 2 for n in lengths]
        walk = self.language.walks(len(lengths), max(periods), g)
        return [torch.cat([walk[i, :p], walk[i, :p]])[:n + 1]
                for i, (n, p) in enumerate(zip(lengths, periods))]

    def entropy_floor(self) -> float:
        """The best achievable mean loss per target token (nats), as
        :meth:`~edu3d.train.data.SyntheticCorpus.entropy_floor`: a document of ``n`` targets
        has ``ceil((n+1)/2) - 1`` unpredictable Markov steps; weighted by length over 4,096
        draws."""
        n = self.lengths(("histogram",), 4096)
        return float(((n + 2) // 2 - 1).sum() * STEP_ENTROPY / n.sum())

    def histogram(self, count: int = 4096) -> tuple[list[int], list[int]]:
        """``(length, how many)`` over ``count`` draws: the distribution the corpus samples."""
        n = self.lengths(("histogram",), count)
        values, counts = torch.unique(n, return_counts=True)
        return values.tolist(), counts.tolist()

