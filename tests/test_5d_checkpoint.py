"""Checkpoints written under one 5D layout resume and reshard into another: the expert
weights (held whole, each by one rank of its expert-parallel group) and the sequence-split
ranks' replicas are written once and read back wherever the new layout puts them; and
``edu3d generate`` runs on a mixture-of-experts checkpoint."""

from __future__ import annotations

import io

import pytest

from edu3d.train.generation import generate as generate_tokens, load_model
from edu3d.train.loop import run
from edu3d.config.sections import Run

MODEL = dict(layers=2, d_model=32, heads=4, seq=16, vocab=64, experts=4, topk=2,
             capacity_factor=1.0, json=True, timeout=300)


def _losses(records):
    return [r["loss"] for r in records]


def test_moe_checkpoint_reshards_across_5d_layouts(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # dp2 x cp2 with the experts over ep 2 (4 ranks) saves at step 3 ...
    run(Run.of(**MODEL, dp=2, cp=2, ep=2, steps=3, ckpt_dir=ckpt), out=io.StringIO())
    # ... dp2 x tp2 (4 ranks, experts whole on every rank) resumes to step 5
    resumed = run(Run.of(**MODEL, dp=2, tp=2, steps=5, ckpt_dir=ckpt, resume=True),
                  out=io.StringIO())
    # the same 5 steps without a break, on the first layout
    whole = run(Run.of(**MODEL, dp=2, cp=2, ep=2, steps=5), out=io.StringIO())
    assert len(resumed) == 5
    for a, b in zip(_losses(resumed)[3:], _losses(whole)[3:], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert resumed[-1]["tokens_per_expert"] and sum(resumed[-1]["tokens_per_expert"]) == 8 * 16 * 2

    model = load_model(ckpt)  # the serial model, whole, from the 4-rank dp2 x tp2 shards
    assert model.config.n_experts == 4
    tokens = generate_tokens(model, [3, 17, 42], 5)
    assert len(tokens) == 5 and all(0 <= t < 64 for t in tokens)
