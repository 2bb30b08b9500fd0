"""``edu3d generate``: tokens from a trained checkpoint, serially or under tensor parallelism.

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

A checkpoint trained on the synthetic corpus (:mod:`edu3d.train.data`) reads and writes token
ids, so a prompt is a list of them, ``"3 17 42"``: a trained model continues a sequence's
Markov walk and, past half of ``seq_len``, repeats it. One trained on real text (``edu3d train
--data stdlib`` or ``text:PATH``, its manifest says which) reads bytes: the prompt is text,
``"def "``, encoded to its UTF-8 bytes (:mod:`edu3d.train.text`), and the bytes generated
are printed as text after it.
"""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.distributed as dist

from edu3d.ckpt.export import state_dict
from edu3d.ckpt.format import CheckpointError, read_manifest
from edu3d.commands.argtypes import (MAX_NEW_TOKENS, MAX_SEED, between, integer, ranks, seconds,
                                     step_number)
from edu3d.config.layout import Layout, LayoutError
from edu3d.launch.api import LaunchError, launch
from edu3d.model.gpt import GPT, GPTConfig
from edu3d.parallel.tp import apply_tp
from edu3d.train.text import decode, encode, is_text


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
    model of real text (``data``), the prompt's UTF-8 bytes."""
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


def main_from_args(args) -> int:
    try:  # every check before any process starts; the checkpoint is read (and checked) here
        if not math.isfinite(args.temperature) or args.temperature < 0:
            raise ValueError(f"--temperature {args.temperature:g}: give a finite number >= 0 "
                             "(0: greedy; above 0: sample from softmax(logits/T))")
        manifest = read_manifest(args.ckpt, args.step)
        config = GPTConfig(**manifest["config"])
        data = manifest["options"].get("data", "synthetic")  # older checkpoints: synthetic
        prompt = parse_prompt(args.prompt, config.vocab_size, data)
        layout = Layout(tp=args.tp)
        layout.validate(config=config)
        model = load_model(args.ckpt, None, manifest["step"])  # every shard, verified
    except (CheckpointError, LayoutError, ValueError) as err:
        print(f"edu3d generate: {err}", file=sys.stderr)
        return 2
    options = {"ckpt": args.ckpt, "step": manifest["step"], "prompt": prompt,
               "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
               "seed": args.seed}
    if args.tp == 1:
        tokens = generate(model, prompt, args.max_new_tokens, args.temperature, args.seed)
    else:
        try:
            tokens = launch(worker, args.tp, args=(options,), layout=layout, echo=False,
                            name="generate", timeout=args.timeout).results[0]
        except LaunchError as err:
            print(f"edu3d generate: {err}", file=sys.stderr)
            return 1
    text = is_text(data)
    if args.json:
        out = {"step": manifest["step"], "prompt": prompt, "tokens": tokens}
        print(json.dumps({**out, "text": decode(tokens)} if text else out))
    else:
        print(args.prompt + decode(tokens) if text else " ".join(map(str, tokens)))
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate tokens from a checkpoint, serially or under TP",
        description="Generate tokens from a checkpoint of edu3d train --ckpt-dir. A model of "
                    "the synthetic corpus takes token ids (\"3 17 42\") and prints the new "
                    "ids, space-separated; a model of real text (--data stdlib or text:PATH) "
                    "takes text (\"def \") and prints it with what follows.")
    p.add_argument("--ckpt", required=True, help="checkpoint folder (edu3d train --ckpt-dir)")
    p.add_argument("--step", type=step_number, default=None,
                   help="which step (default: the newest)")
    p.add_argument("--prompt", required=True,
                   help="token ids, e.g. \"3 17 42\"; text for a model of real text, \"def \"")
    p.add_argument("--tp", type=ranks, default=1, help="tensor-parallel ranks (default: 1)")
    p.add_argument("--max-new-tokens", type=between(0, MAX_NEW_TOKENS), default=16,
                   help="tokens to add (default: 16)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (default); above 0 (finite): sample from softmax(logits/T)")
    p.add_argument("--seed", type=integer(0, "an integer >= 0", MAX_SEED), default=0,
                   help="the sampling seed (default: 0)")
    p.add_argument("--timeout", type=seconds("120"), default=120.0,
                   help="seconds, with --tp (120)")
    p.add_argument("--json", action="store_true",
                   help="print {\"step\", \"prompt\", \"tokens\"} as one JSON object")
    p.set_defaults(func=main_from_args)
