"""Generation: tokens from a trained checkpoint, serially or under tensor parallelism.

After reading this file you should understand autoregressive decoding, and what tensor
parallelism changes about it:

* the model reads the context (the prompt and what it generated so far, at most ``seq_len``
  tokens: older ones are cropped) and gives logits for the next token; **greedy** decoding
  takes the most likely one, **sampling** draws from ``softmax(logits / temperature)``:
  below 1 sharper, above 1 flatter. A seeded generator makes a sample reproducible;
* under **tensor parallelism** (``--tp N``) each rank holds a slice of every weight
  (:func:`edu3d.parallel.tp.apply_tp`, cut from the checkpoint's full tensors) and its
  vocabulary-parallel head gives only *its columns* of the logits. One all-gather over tp
  puts the whole row together; every rank then picks the same token (same logits, same
  seed), so the ranks stay in step without another message. Greedy tokens are the serial
  model's: TP changes the order of a few sums (a difference near 1e-7), not the argmax.

The course's corpus is synthetic (:mod:`edu3d.train.data`): tokens are integers, so a prompt is a
list of token ids, ``"3 17 42"``. A trained model continues a sequence's Markov walk and,
past half of ``seq_len``, repeats it.

``edu3d generate`` (:mod:`edu3d.commands.generate`) is this module's command line; a notebook
or a script calls :func:`load_model` and :func:`generate` directly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.ckpt.export import state_dict
from edu3d.model.gpt import GPT, GPTConfig
from edu3d.parallel.tp import apply_tp
from edu3d.train.text import encode, is_text


def load_model(ckpt_dir, mesh=None, step: int | None = None):
    """The serial GPT with the checkpoint's weights, or this rank's TP piece of it when
    ``mesh`` has tp > 1 (every rank must call)."""
    manifest, sd = state_dict(ckpt_dir, step)
    model = GPT(GPTConfig(**manifest["config"]))
    model.load_state_dict(sd)
    if mesh is not None and mesh.size("tp") > 1:
        apply_tp(model, mesh)
    return model.eval()


@torch.no_grad()
def generate(model, prompt: list[int], new_tokens: int, temperature: float = 0.0,
             seed: int = 0, mesh=None) -> list[int]:
    """``new_tokens`` token ids after ``prompt``: greedy for ``temperature`` 0, sampled
    otherwise (seeded). ``mesh``: the TP ranks' mesh (every tp rank calls, same arguments)."""
    config = model.config
    tp = mesh.size("tp") if mesh is not None else 1
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.long)
    for _ in range(new_tokens):
        logits, _ = model(idx[:, -config.seq_len:])
        last = logits[0, -1].contiguous()
        if tp > 1:  # each rank holds vocab/tp columns: put the row together
            parts = [torch.empty_like(last) for _ in range(tp)]
            dist.all_gather(parts, last, group=mesh.tp)
            last = torch.cat(parts)
        last = last[:config.vocab_size]  # drop the padding columns of a padded vocabulary
        if temperature == 0:
            token = int(last.argmax())
        else:
            probs = torch.softmax(last.double() / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=gen))
        idx = torch.cat([idx, torch.tensor([[token]])], dim=1)
    return idx[0, len(prompt):].tolist()


def worker(mesh, options: dict) -> list[int]:
    """What each rank of ``edu3d generate --tp N`` runs."""
    model = load_model(options["ckpt"], mesh, options["step"])
    return generate(model, options["prompt"], options["max_new_tokens"],
                    options["temperature"], options["seed"], mesh)


def parse_prompt(text: str, vocab_size: int, data: str = "synthetic") -> list[int]:
    """``"3 17 42"`` (or ``"3,17,42"``) -> token ids, checked against the vocabulary; for a
    model of real text (``data``: ``stdlib`` or ``text:PATH``), the prompt's UTF-8 bytes."""
    if is_text(data):
        if not text:
            raise ValueError("--prompt is empty: give the start of a text, e.g. \"def \"")
        return encode(text)
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--prompt {text!r}: the corpus is synthetic token ids; give integers "
                         f"in 0..{vocab_size - 1}, e.g. \"3 17 42\"") from None
    if not ids:
        raise ValueError("--prompt is empty: give at least one token id, e.g. \"3 17 42\"")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"--prompt: token ids {bad} are outside the vocabulary 0.."
                         f"{vocab_size - 1}")
    return ids
