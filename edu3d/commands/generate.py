"""``edu3d generate``: tokens from a trained checkpoint, serially or under tensor parallelism.

After reading this file you should know what the command adds to
:mod:`edu3d.train.generation` (where decoding, and what tensor parallelism changes about it,
is explained): every check before any process starts (the temperature, the checkpoint read
and verified, the prompt against its vocabulary, ``--tp`` against its heads), then one
process, or ``--tp N`` ranks launched with :func:`edu3d.launch.api.launch`, and the new
token ids printed (``--json``: one object).

A checkpoint trained on the synthetic corpus (:mod:`edu3d.train.data`) reads and writes token
ids, so a prompt is a list of them, ``"3 17 42"``. One trained on real text (``edu3d train
--data stdlib`` or ``text:PATH``, its manifest says which) reads bytes: the prompt is text,
``"def "``, encoded to its UTF-8 bytes (:mod:`edu3d.train.text`), and the bytes generated
are printed as text after it.
"""

from __future__ import annotations

import json
import math
import sys

from edu3d.ckpt.format import CheckpointError, read_manifest
from edu3d.commands.argtypes import (MAX_NEW_TOKENS, MAX_SEED, between, integer, ranks, seconds,
                                     step_number)
from edu3d.config.layout import Layout, LayoutError
from edu3d.launch import api
from edu3d.launch.api import LaunchError
from edu3d.model.gpt import GPTConfig
from edu3d.train.generation import generate, load_model, parse_prompt, worker
from edu3d.train.text import decode, is_text


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
            tokens = api.launch(worker, args.tp, args=(options,), layout=layout, echo=False,
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
