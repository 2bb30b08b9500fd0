"""Chapter 00, last section: the tiny model learns to write Python, from text every machine has.

After reading this file you should know what "training a language model" means in the
smallest honest form, and that it is the same machinery the rest of the course parallelises:

* :func:`train_on_text` trains edu3d's tiny GPT on ``--data stdlib`` (the Python standard
  library's own sources, one token per UTF-8 byte: :mod:`edu3d.train.text`) in this process,
  with the same :class:`~edu3d.train.trainer.Trainer` and the same batches as
  ``edu3d train --data stdlib``, for about ``seconds`` seconds (at least ``min_steps`` steps),
  printing its progress every few seconds. At the start the loss is near ``ln 256 = 5.55``
  nats (every byte equally likely); it falls as the model learns which bytes follow which;
* :func:`sample` continues a prompt byte by byte, as ``edu3d generate`` does from a checkpoint:
  the model gives logits for the next byte, one is drawn from ``softmax(logits / temperature)``
  (seeded), appended, and the window moves on (at most ``seq_len`` bytes of context);
* :func:`sample_takeaway` says what a sample shows, from its text alone.
"""

from __future__ import annotations

import math
import os
import re
import time

import torch

from edu3d.course import lesson_args
from edu3d.distributed import trace
from edu3d.model.gpt import GPT
from edu3d.train.batching import global_batch, make_corpus
from edu3d.train.preflight import model_config
from edu3d.train.text import decode, encode
from edu3d.train.trainer import Trainer

PYTHON_WORDS = ("def", "return", "self", "import", "if", "for", "in", "None", "class", "not")
TEXT = dict(data="stdlib", seq=64, global_batch=16, lr=3e-3)  # the tiny preset otherwise


def text_seconds() -> float:
    """How long the chapter trains on text: ``$EDU3D_TEXT_SECONDS``, else 60 (an instructor
    on a slow laptop may shorten it; the browser test runs 15)."""
    raw = os.environ.get("EDU3D_TEXT_SECONDS", "60")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= 3600:
        raise ValueError(f"EDU3D_TEXT_SECONDS={raw!r}: give the seconds to train, between 0 "
                         "and 3600 (unset: 60)")
    return value


def train_on_text(seconds: float | None = None, min_steps: int = 60, max_steps: int = 5000,
                  every: float = 10.0, out=print, **overrides) -> dict:
    """Train the tiny GPT on the standard library for about ``seconds`` (default
    :func:`text_seconds`; between ``min_steps`` and ``max_steps`` steps), calling ``out``
    with a progress line every ``every`` seconds. Returns ``model``, ``losses`` (one per
    step), ``seconds`` spent and ``tokens`` trained on."""
    seconds = text_seconds() if seconds is None else seconds
    torch.set_num_threads(1)  # as edu3d train does
    run = lesson_args(**{**TEXT, "steps": max_steps, **overrides})
    config = model_config(run)
    corpus = make_corpus(run, config)
    model = GPT(config, seed=run.training.seed)
    trainer = Trainer(model, None, run)
    out(f"{config.n_layers} layers, d_model {config.d_model}, seq {config.seq_len} bytes, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters; "
        f"{corpus.prepared.tokens:,} bytes of text; loss at start ~ ln 256 = {math.log(256):.2f}")
    losses, start = [], time.perf_counter()
    shown = start
    with trace.use(trace.NullRecorder()):
        for step in range(1, max_steps + 1):
            x, y = global_batch(corpus, run, step)
            losses.append(float(trainer.step(x, y, step)["loss"]))
            now = time.perf_counter()
            if now - shown >= every:
                shown = now
                recent = losses[-10:]
                out(f"{now - start:5.0f} s  step {step:5d}  loss {sum(recent) / len(recent):.3f} "
                    f"(mean of the last {len(recent)} steps)")
            if now - start >= seconds and step >= min_steps:
                break
    spent = time.perf_counter() - start
    tokens = len(losses) * run.batch.global_batch * config.seq_len
    out(f"{len(losses)} steps, {tokens:,} tokens in {spent:.0f} s; loss {losses[0]:.2f} -> "
        f"{sum(losses[-10:]) / len(losses[-10:]):.2f} (last 10 steps)")
    return {"model": model.eval(), "losses": losses, "seconds": spent, "tokens": tokens}


@torch.no_grad()
def sample(model, prompt: str = "def ", new_tokens: int = 200, temperature: float = 0.8,
           seed: int = 0) -> str:
    """``prompt`` and ``new_tokens`` bytes drawn after it, as text (a character cut in half
    at the end shows as U+FFFD)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor([encode(prompt)], dtype=torch.long)
    for _ in range(new_tokens):
        logits, _ = model(idx[:, -model.config.seq_len:])
        probs = torch.softmax(logits[0, -1, :256].double() / temperature, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=gen).view(1, 1)], dim=1)
    return decode(idx[0].tolist())


def sample_takeaway(text: str, prompt: str = "") -> str:
    """What a sample shows, from what the model wrote after ``prompt``: the share of letters
    and spaces, and the Python words it wrote."""
    text = text[len(prompt):] if text.startswith(prompt) else text
    keywords = [k for k in PYTHON_WORDS if re.search(rf"\b{k}\b", text)]
    letters = sum(ch.isalpha() or ch.isspace() for ch in text) / max(len(text), 1)
    return (f"{100 * letters:.0f}% letters and spaces; Python words written: "
            + (", ".join(keywords) if keywords else "none yet"))
