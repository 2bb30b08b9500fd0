"""Dynamic batching and sequence packing: how documents of different lengths become
micro-batches, and a loss that stays the serial one whatever the layout.

After reading this file you should understand the five ``--batching`` modes, each a way to
feed the documents of :class:`~edu3d.train.documents.DocumentCorpus` to the model:

* ``fixed``: today's equal sequences (:class:`~edu3d.train.data.SyntheticCorpus`); no padding;
* ``pad``: ``global_batch`` documents a step, each micro-batch padded to its longest
  document. Padding costs compute and is masked out of the loss (target ``-100``);
* ``bucket``: the same, but the documents of ``BUCKET_STEPS`` steps are sorted by length
  and cut into batches of neighbours, so a batch's documents are alike and little is padded;
* ``tokens``: documents sorted by length (``POOL_DOCS`` at a time) are cut into batches of
  at most ``--max-tokens`` positions (``rows x longest``, fairseq's ``--max-tokens``); each
  micro-batch of every data-parallel rank is the next such batch: the number of documents
  per step varies, the compute per micro-batch hardly does;
* ``pack``: ``global_batch`` rows of ``seq_len`` tokens, each filled with whole documents
  (next fit); a row's documents are kept apart by a block-diagonal causal mask and their
  positions restart (:func:`edu3d.model.gpt.document_mask`), so packing changes nothing
  but the padding.

**The loss.** Ranks and micro-batches now hold different numbers of tokens, so the mean of
their means is not the global batch's mean (a micro-batch of 3 tokens would weigh as much as
one of 300). The loss is normalised by the global number of target tokens ``N`` instead:
micro-batch ``i`` with ``n_i`` targets back-propagates ``mean_i * n_i / N`` (times ``dp``,
which data parallelism's average divides back out). Megatron does this with
``calculate_per_token_loss`` (sum the loss, all-reduce the token count, divide the
gradients by it); here every rank already holds the whole global batch, so ``N`` needs no
collective. The sum over every micro-batch and rank is then ``sum of every token's loss / N``:
exactly the per-document loss computed one document at a time (:func:`per_document_loss`).

**Under pipeline parallelism** every mode works, with every schedule: each stage sizes a
micro-batch's activation (and gradient) receive from its own copy of the batch, since every
rank holds the whole step (:mod:`edu3d.parallel.pp.engine`), so no shape is sent ahead; the
last stage weights each micro-batch's loss as above.

**Under context parallelism** (``pack`` only) each of the ``cp`` ranks of a micro-batch
holds its pieces of the rows, and so its own count ``n_i`` of their targets (padding sits at
a row's end, so one rank may hold many, another none). The same rule, with ``n_i`` counted
on the piece and ``dp * cp * m`` for the factor the dp x cp gradient average divides back
out, keeps the sum the serial loss; a piece with no target still runs forward and backward
(its keys and values serve the other ranks' queries) with weight 0. Assuming equal counts
and dividing by ``cp`` instead is the silent error: it inflates the loss of pieces that are
mostly padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edu3d.config.layout import LayoutError
from edu3d.train.data import SyntheticCorpus
from edu3d.train.documents import DocumentCorpus
from edu3d.train.text import TextCorpus

MODES = ("fixed", "pad", "bucket", "tokens", "pack")
BUCKET_STEPS = 8  # bucket: the documents of this many steps are sorted together
POOL_DOCS = 512  # tokens: documents sorted together before they are cut into budgets
IGNORE = -100  # a padding target: no loss, no gradient


@dataclass
class StepBatch:
    """One step's global batch under ``--batching`` (not ``fixed``).

    ``rows``: each row's documents (token tensors, ``n + 1`` long; one per row except when
    packing). ``slots``: where each micro-batch slot starts in ``rows`` (``dp * m + 1``
    bounds, ``tokens`` mode), or ``None``: the rows are cut evenly, as a fixed batch's are.
    Each rank's micro-batches of it are :func:`edu3d.train.cut.cut`'s."""

    mode: str
    seq_len: int
    rows: list[list[torch.Tensor]]
    slots: list[int] | None = None

    @property
    def documents(self) -> list[torch.Tensor]:
        return [d for row in self.rows for d in row]

    @property
    def targets(self) -> int:
        """Target tokens in the step: what the loss is divided by."""
        return sum(len(d) - 1 for d in self.documents)

    def groups(self, count: int) -> list[list[list[torch.Tensor]]]:
        """The rows of each of the step's ``count`` micro-batch slots (rank-major)."""
        if self.slots is not None:
            if len(self.slots) != count + 1:
                raise ValueError(f"this batch was filled for {len(self.slots) - 1} micro-batch "
                                 f"slots (dp x micro-batches), not {count}")
            return [self.rows[a:b] for a, b in zip(self.slots, self.slots[1:])]
        if len(self.rows) % count:
            raise ValueError(f"{len(self.rows)} rows do not split into {count} micro-batches "
                             "(dp x micro-batches); use a global batch that is a multiple")
        n = len(self.rows) // count
        return [self.rows[i * n:(i + 1) * n] for i in range(count)]

    def fed(self, count: int) -> int:
        """Token positions the model computes on, padding included, cut into ``count``
        slots (each padded to its own length)."""
        return sum(len(rows) * width(rows, self.mode, self.seq_len)
                   for rows in self.groups(count))

    def waste(self, count: int) -> float:
        """The share of computed positions that are padding, with ``count`` slots."""
        return 1.0 - self.targets / self.fed(count)


def width(rows: list[list[torch.Tensor]], mode: str, seq_len: int) -> int:
    """A micro-batch's length: ``seq_len`` for packed rows, else its longest document."""
    if mode == "pack":
        return seq_len
    return max(sum(len(d) - 1 for d in row) for row in rows)


def collate(rows: list[list[torch.Tensor]], length: int, packed: bool):
    """``(x, y, doc)`` tensors ``[rows, length]``: inputs (0 where padded), targets (``-100``
    where padded) and, when ``packed``, document ids (padding is a document of its own, so
    its rows of the mask are never empty; it is masked out of the loss anyway)."""
    x = torch.zeros(len(rows), length, dtype=torch.long)
    y = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    doc = torch.zeros(len(rows), length, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i, d in enumerate(row):
            n = len(d) - 1
            x[r, at:at + n], y[r, at:at + n], doc[r, at:at + n] = d[:-1], d[1:], i
            at += n
        doc[r, at:] = len(row)
    return x, y, (doc if packed else None)


def check_options(run, config) -> None:
    """``--batching``'s rules: what each mode needs, and the axes it does not compose with
    (refused rather than trained with a silently wrong loss)."""
    o = run.batch
    if o.batching not in MODES:
        raise LayoutError(f"--batching {o.batching!r}: choose one of {', '.join(MODES)}")
    doc_flags = [f for f, v in (("--max-tokens", o.max_tokens is not None),
                                ("--doc-mean", o.doc_mean is not None),
                                ("--doc-sigma", o.doc_sigma != 0.8)) if v]
    if o.batching == "fixed":
        if doc_flags:
            raise LayoutError(f"{doc_flags[0]} shapes the documents of --batching pad, "
                              "bucket, tokens or pack; add one (fixed has equal sequences)")
        return
    if o.max_tokens is not None and o.batching != "tokens":
        raise LayoutError(f"--max-tokens fills micro-batches of --batching tokens; use it "
                          f"with that, not --batching {o.batching}")
    if o.max_tokens is not None and o.max_tokens < config.seq_len:
        raise LayoutError(f"--max-tokens {o.max_tokens} is less than seq_len="
                          f"{config.seq_len}: the longest document would fit nowhere; use "
                          f">= {config.seq_len}")
    if o.doc_mean is not None and not 1 <= o.doc_mean <= config.seq_len:
        raise LayoutError(f"--doc-mean {o.doc_mean:g}: a mean document length in 1.."
                          f"{config.seq_len} (seq_len)")
    if not 0 <= o.doc_sigma <= 4:
        raise LayoutError(f"--doc-sigma {o.doc_sigma:g}: a spread in 0..4")
    flag = f"--batching {o.batching}"
    refused = [(run.layout.cp > 1 and o.batching != "pack", "--cp", "context parallelism cuts "
                "every "
                "row at fixed positions of seq_len, and these micro-batches are as long as "
                "their longest document; use --batching pack"),
               (run.parallel.sp, "--sp", "sequence parallelism splits a fixed sequence"),
               (run.model.experts > 0, "--experts", "the load-balancing loss counts tokens per "
                                            "micro-batch"),
               (run.parallel.impl == "torch", "--impl torch",
                "only edu3d's trainer takes documents"),
               (run.precision.compile, "--compile", "every new length would compile again")]
    for bad, knob, why in refused:
        if bad:
            raise LayoutError(f"{flag} with {knob} is not supported ({why}); drop {knob} "
                              "or use --batching fixed")


# ---- building a step's batch ------------------------------------------------------------------
def make_corpus(run, config) -> SyntheticCorpus | DocumentCorpus | TextCorpus:
    """The run's corpus: equal sequences (``fixed``), real text (``--data``) or documents
    (every other mode)."""
    if run.batch.data != "synthetic":
        return TextCorpus(run.batch.data, config.seq_len, seed=run.training.seed)
    if run.batch.batching == "fixed":
        return SyntheticCorpus(config.vocab_size, config.seq_len, seed=run.training.seed)
    return DocumentCorpus(config.vocab_size, config.seq_len, seed=run.training.seed,
                          mean=run.batch.doc_mean, sigma=run.batch.doc_sigma)


def global_batch(corpus, run, step: int) -> tuple:
    """Global batch ``step`` as the trainer takes it: ``(x, y)`` tensors (``fixed``), or
    ``(StepBatch, None)``. The same whatever the layout, except ``tokens`` mode, whose
    step fills ``dp x micro-batches`` slots (as fairseq's ``--max-tokens`` per GPU)."""
    if run.batch.batching == "fixed":
        return corpus.batch(step, run.batch.global_batch)
    slots = run.layout.dp * run.microbatches
    return step_batch(corpus, run.batch.batching, step, run.batch.global_batch, slots,
                      run.batch.max_tokens), None


def batch_tokens(x) -> int:
    """Tokens a step trains on (padding excluded): what tokens/s counts."""
    return x.targets if isinstance(x, StepBatch) else x.numel()


def step_batch(corpus: DocumentCorpus, mode: str, step: int, global_batch: int,
               slots: int = 1, max_tokens: int | None = None) -> StepBatch:
    """Global batch ``step`` (from 1) in ``mode``; ``slots`` = dp x micro-batches, which only
    ``tokens`` mode reads (it fills each slot to ``max_tokens``)."""
    seq = corpus.seq_len
    if mode == "pad":
        lengths = corpus.lengths(("pad", step), global_batch).tolist()
        rows = [[d] for d in corpus.documents(("pad", step), lengths)]
        return StepBatch(mode, seq, rows)
    if mode == "bucket":
        pool, at = divmod(step - 1, BUCKET_STEPS)
        lengths = corpus.lengths(("bucket", pool), BUCKET_STEPS * global_batch)
        order = lengths.argsort(stable=True)  # neighbours in length, neighbours in a batch
        g = torch.Generator().manual_seed(pool)
        batch = torch.randperm(BUCKET_STEPS, generator=g)[at]  # shuffle which batch comes when
        chosen = order[batch * global_batch:(batch + 1) * global_batch]
        docs = corpus.documents(("bucket", pool, int(batch)), lengths[chosen].tolist())
        return StepBatch(mode, seq, [[d] for d in docs])
    if mode == "tokens":
        return _fill_tokens(corpus, step, slots, max_tokens or seq * global_batch // slots)
    if mode == "pack":
        return _pack(corpus, step, global_batch)
    raise ValueError(f"--batching {mode!r}: choose one of {', '.join(MODES[1:])} here "
                     "(fixed is SyntheticCorpus.batch)")


def _fill_tokens(corpus: DocumentCorpus, step: int, slots: int, max_tokens: int) -> StepBatch:
    """Step ``step``'s ``slots`` micro-batches: the next ones of the token-budget stream."""
    if max_tokens < corpus.seq_len:
        raise ValueError(f"--max-tokens {max_tokens} is less than seq_len={corpus.seq_len}: "
                         "the longest document would fit nowhere")
    first, rows, bounds, pool = (step - 1) * slots, [], [0], 0
    while len(bounds) <= slots:
        lengths, batches = token_batches(corpus, pool, max_tokens)
        for j, members in enumerate(batches):
            if first > 0:  # a batch an earlier step took
                first -= 1
                continue
            if len(bounds) > slots:
                break
            rows += [[d] for d in corpus.documents(("tokens", pool, j),
                                                   [lengths[i] for i in members])]
            bounds.append(len(rows))
        pool += 1
    return StepBatch("tokens", corpus.seq_len, rows, bounds)


def token_batches(corpus: DocumentCorpus, pool: int, max_tokens: int):
    """Pool ``pool``'s ``POOL_DOCS`` documents sorted by length and cut into batches of at
    most ``max_tokens`` positions (rows x longest), in a shuffled order (fairseq's
    ``batch_by_size``): ``(lengths, [document indices of each batch])``."""
    lengths = corpus.lengths(("tokens", pool), POOL_DOCS).tolist()
    batches: list[list[int]] = [[]]
    for i in sorted(range(POOL_DOCS), key=lengths.__getitem__):  # shortest first
        if batches[-1] and (len(batches[-1]) + 1) * lengths[i] > max_tokens:
            batches.append([])  # i is the longest so far: it would pad every row to it
        batches[-1].append(i)
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(pool))
    return lengths, [batches[j] for j in order.tolist()]


def _pack(corpus: DocumentCorpus, step: int, rows: int) -> StepBatch:
    """Next fit: a document goes into the current row if it fits, else opens the next row."""
    lengths = corpus.lengths(("pack", step), rows * (corpus.seq_len // corpus.min_len)).tolist()
    packed: list[list[int]] = [[]]
    for n in lengths:
        if sum(packed[-1]) + n > corpus.seq_len:
            if len(packed) == rows:
                break
            packed.append([])
        packed[-1].append(n)
    docs = iter(corpus.documents(("pack", step), [n for row in packed for n in row]))
    return StepBatch("pack", corpus.seq_len, [[next(docs) for _ in row] for row in packed])


# ---- the reference and the formula --------------------------------------------------------------
def per_document_loss(model, batch: StepBatch) -> torch.Tensor:
    """The step's loss computed one document at a time, no padding, no packing: the sum of
    every document's token losses over the step's target tokens. What every mode and layout
    must equal."""
    total = sum(model(d[None, :-1], d[None, 1:])[1] * (len(d) - 1) for d in batch.documents)
    return total / batch.targets


def expected_pad_waste(lengths: torch.Tensor, rows: int) -> float:
    """Expected padding share when ``rows`` documents drawn from ``lengths``' distribution
    are padded to their longest: ``1 - E[n] / E[max of rows]``, with
    ``P(max <= k) = F(k)^rows`` read off the empirical distribution function ``F``."""
    values, counts = torch.unique(lengths.double(), return_counts=True)
    cdf = counts.cumsum(0).double() / counts.sum()
    below = torch.cat([torch.zeros(1, dtype=torch.float64), cdf[:-1]])
    expected_max = float((values * (cdf ** rows - below ** rows)).sum())
    return 1.0 - float(lengths.double().mean()) / expected_max
