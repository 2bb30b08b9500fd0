"""Mixed precision in the 3D step: bf16 and fp16 track the fp32 serial run, and an fp16
overflow on one rank skips the same step on every rank.

Tolerances, measured on dp2-tp2-pp2 over 5 AdamW steps (tiny model): bf16 losses differ from
the fp32 serial ones by up to ~1e-4 relative, fp16 by ~2e-5. bf16 keeps 8 significant bits
(unit roundoff 2^-9 = 2e-3), fp16 11 (2^-12 = 2.4e-4); the loss is an average over 8 x 32
tokens, so its error stays well under one unit roundoff. The tests allow one unit roundoff:
bf16 2e-3, fp16 2.4e-4 — a wrong scale, a missed unscale or a lost all-reduce would be off by
orders of magnitude more.
"""

from __future__ import annotations

import argparse
import io
import math

import pytest
import torch

from edu3d.launch import launch
from edu3d.mesh import Layout
from edu3d.options import add_arguments
from edu3d.train import run

ARGV = ["--steps", "5", "--json", "--global-batch", "8"]
LAYOUT = ["--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2"]
TOL = {"bf16": 2.0**-9, "fp16": 2.0**-12}


def _losses(*argv):
    args = add_arguments(argparse.ArgumentParser()).parse_args([*ARGV, *argv])
    return [r["loss"] for r in run(args, out=io.StringIO())]


@pytest.fixture(scope="module")
def serial():
    return _losses()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_3d_tracks_fp32_serial(serial, precision):
    got = _losses(*LAYOUT, "--precision", precision)
    worst = max(abs(a - b) / b for a, b in zip(got, serial))
    print(f"\n{precision} dp2-tp2-pp2: worst loss rel diff {worst:.1e}")
    assert worst < TOL[precision]
    assert got[-1] < got[0]


def overflow_worker(mesh, bad_rank: int, bad_step: int) -> dict:
    """fp16 training where ``bad_rank`` finds an inf in one of its own gradients at
    ``bad_step`` (after the cross-axis fixes, before the norm): every rank must skip it."""
    from edu3d.course import lesson_args
    from edu3d.data import SyntheticCorpus
    from edu3d.model import GPT
    from edu3d.trainer import Trainer

    args = lesson_args(dp=2, tp=2, pp=2, microbatches=2, precision="fp16")
    model = GPT(args_config(args), seed=0)
    trainer = Trainer(model, mesh, args)
    corpus = SyntheticCorpus(model.config.vocab_size, model.config.seq_len, seed=0)
    finish, current = trainer.grads.finish, {"step": 0}

    def finish_with_overflow():
        finish()
        if mesh.rank == bad_rank and current["step"] == bad_step:
            p = next(p for p in trainer.par.module.parameters()
                     if trainer.par.specs[trainer.par.names[p]] is not None)
            p.grad.view(-1)[0] = math.inf  # a TP shard: only this rank holds it

    trainer.grads.finish = finish_with_overflow
    records = []
    for s in range(1, 5):
        current["step"] = s
        before = [p.detach().clone() for p in trainer.par.module.parameters()]
        rec = trainer.step(*corpus.batch(s, args.global_batch), s)
        unchanged = all(torch.equal(a, p) for a, p in zip(before, trainer.par.module.parameters()))
        records.append({"skipped": rec["skipped"], "scale": rec["loss_scale"],
                        "unchanged": unchanged})
    return {"records": records, "scale_after": trainer.precision.scale}


def args_config(args):
    from edu3d.options import config_from_args

    return config_from_args(args)


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    res = launch(overflow_worker, 8, args=(5, 2), layout=Layout(dp=2, tp=2, pp=2),
                 timeout=240, name="fp16-overflow").results
    for r in res:
        assert [rec["skipped"] for rec in r["records"]] == [False, True, False, False]
        assert [rec["unchanged"] for rec in r["records"]] == [False, True, False, False]
        assert r["scale_after"] == res[0]["records"][0]["scale"] / 2
