"""Chapter 02, last section: documents of different lengths, batched five ways.

After reading this file you can:

* draw the length distribution the synthetic documents follow (:func:`length_histogram`:
  log-normal, mean and spread chosen, clipped to ``[2, seq_len]``);
* predict the padding waste of padding each batch to its longest document,
  ``1 - E[n] / E[max of b lengths]`` (:func:`~edu3d.train.batching.expected_pad_waste`),
  and measure it with the other modes in real training runs (:func:`measure_modes`: padding
  waste, tokens/s, the loss), with :func:`edu3d.train.loop.run`, the loop behind ``edu3d
  train --batching``;
* check the two promises packing makes (:func:`packing_checks`): the mask keeps documents
  apart, and the packed loss is the documents' loss computed one at a time.
"""

from __future__ import annotations

import io
import statistics

import torch

from edu3d.model.gpt import GPT, document_mask
from edu3d.train.batching import MODES, expected_pad_waste, per_document_loss, step_batch
from edu3d.train.cut import cut
from edu3d.train.documents import DocumentCorpus
from edu3d.train.loop import run
from edu3d.config.sections import Run
from edu3d.train.preflight import model_config

SEQ = 32
ROWS = 8  # sequences per step, the global batch


def lesson_options(mode: str, mean: float, sigma: float, steps: int = 6):
    """``edu3d train --batching MODE`` for the lesson: the tiny model, ``steps`` steps."""
    return Run.of(batching=mode, doc_mean=None if mode == "fixed" else mean,
                    doc_sigma=0.8 if mode == "fixed" else sigma, steps=steps,
                    global_batch=ROWS, json=True, seq=SEQ)


def length_histogram(mean: float, sigma: float, draws: int = 4096) -> dict:
    """The documents' lengths: ``{"length", "count", "mean"}`` over ``draws`` draws."""
    corpus = DocumentCorpus(256, SEQ, mean=mean, sigma=sigma)
    n = corpus.lengths(("histogram",), draws)
    values, counts = torch.unique(n, return_counts=True)
    return {"length": values.tolist(), "count": counts.tolist(), "mean": float(n.double().mean())}


def formula_waste(mean: float, sigma: float, rows: int = ROWS) -> float:
    """Expected padding share of ``pad`` (each batch of ``rows`` to its longest)."""
    corpus = DocumentCorpus(256, SEQ, mean=mean, sigma=sigma)
    return expected_pad_waste(corpus.lengths(("formula",), 20000), rows)


def measure_modes(mean: float, sigma: float, modes=MODES, steps: int = 6) -> list[dict]:
    """Each mode trained ``steps`` steps for real (serially): its padding waste, median
    tokens/s (target tokens; the first step left out, it warms up) and last loss."""
    out = []
    for mode in modes:
        records = run(lesson_options(mode, mean, sigma, steps), out=io.StringIO())
        rates = [r["tokens_per_s"] for r in records[1:]]
        out.append({"mode": mode, "waste": statistics.mean(r.get("pad_waste", 0.0)
                                                           for r in records),
                    "tokens_per_s": statistics.median(rates),
                    "tokens_per_s_spread": (min(rates), max(rates)),
                    "loss": records[-1]["loss"]})
    return out


def packing_checks(mean: float = 8, sigma: float = 0.8) -> dict:
    """Deterministic verdicts: the packed mask has no entry across documents; the packed
    loss equals the documents' losses summed one at a time over the tokens; without the
    mask it does not."""
    corpus = DocumentCorpus(256, SEQ, mean=mean, sigma=sigma)
    batch = step_batch(corpus, "pack", 1, ROWS)
    (x, y, doc, w), = cut(batch, None, 1)
    mask = document_mask(doc)
    across = (mask & (doc[:, :, None] != doc[:, None, :])[:, None]).any()
    model = GPT(model_config(lesson_options("pack", mean, sigma)), seed=0)
    with torch.no_grad():
        alone = float(per_document_loss(model, batch))
        packed = float(model(x, y, doc)[1] * w)
        unmasked = float(model(x, y)[1] * w)
    return {"documents": len(batch.documents), "rows": len(batch.rows),
            "mask_blocks_other_documents": not bool(across),
            "packed_equals_alone": abs(packed - alone) <= 1e-5 * alone,
            "unmasked_differs": abs(unmasked - alone) > 1e-3,
            "alone": alone, "packed": packed, "unmasked": unmasked}
