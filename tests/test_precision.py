"""Mixed precision in the 3D step: bf16 and fp16 track the fp32 serial run, and an fp16
overflow on one rank skips the same step on every rank.

Tolerances, measured on dp2-tp2-pp2 over 5 AdamW steps (tiny model): bf16 losses differ from
the fp32 serial ones by about 1e-4 relative, fp16 by about 1e-5. bf16 keeps 8 significant
bits (unit roundoff 2^-9 = 2e-3), fp16 11 (2^-12 = 2.4e-4); the loss is an average over 8 x 32
tokens, so its error stays well under one unit roundoff. The tests allow one unit roundoff:
a wrong scale, a missed unscale or a lost all-reduce would be off by orders of magnitude more.
One launch runs all three checks (8 ranks start in seconds; they share them).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from edu3d.course import lesson_args
from edu3d.train.data import SyntheticCorpus
from edu3d.launch import launch
from edu3d.config.layout import Layout
from edu3d.model.gpt import GPT
from edu3d.train.optim import make_optimizer
from edu3d.train.preflight import model_config
from edu3d.train.loop import train_step
from edu3d.train.trainer import Trainer

LAYOUT = dict(dp=2, tp=2, pp=2, microbatches=2)
TOL = {"bf16": 2.0**-9, "fp16": 2.0**-12}
STEPS = 3  # AdamW steps compared (was 5: the first 3 are the same steps; losses 5.56 -> 5.48)


def _losses(trainer, args) -> list[float]:
    corpus = SyntheticCorpus(args_vocab(args), model_config(args).seq_len, seed=0)
    return [trainer.step(*corpus.batch(s, args.batch.global_batch), s)["loss"]
            for s in range(1, STEPS + 1)]


def args_vocab(args) -> int:
    return model_config(args).vocab_size


def overflow_run(mesh, bad_rank: int, bad_step: int) -> list[dict]:
    """fp16 training where ``bad_rank`` finds an inf in one of its own gradients at
    ``bad_step`` (after the cross-axis fixes, before the norm): every rank must skip it."""
    args = lesson_args(**LAYOUT, precision="fp16")
    trainer = Trainer(GPT(model_config(args), seed=0), mesh, args)
    corpus = SyntheticCorpus(args_vocab(args), model_config(args).seq_len, seed=0)
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
        rec = trainer.step(*corpus.batch(s, args.batch.global_batch), s)
        unchanged = all(torch.equal(a, p) for a, p in zip(before, trainer.par.module.parameters()))
        records.append({"skipped": rec["skipped"], "scale": rec["loss_scale"],
                        "unchanged": unchanged, "scale_after": trainer.precision.scale})
    return records


def precision_worker(mesh, bad_rank: int, bad_step: int) -> dict:
    out = {}
    for precision in TOL:
        args = lesson_args(**LAYOUT, precision=precision)
        out[precision] = _losses(Trainer(GPT(model_config(args), seed=0), mesh, args), args)
    out["overflow"] = overflow_run(mesh, bad_rank, bad_step)
    return out


@functools.lru_cache(maxsize=None)
def _run() -> list[dict]:
    return launch(precision_worker, 8, args=(5, 2), layout=Layout(dp=2, tp=2, pp=2),
                  timeout=300, name="precision").results


def _serial() -> list[float]:
    args = lesson_args(**LAYOUT)
    model = GPT(model_config(args), seed=0)
    opt = make_optimizer(model, args)
    corpus = SyntheticCorpus(args_vocab(args), model_config(args).seq_len, seed=0)
    return [train_step(model, opt, *corpus.batch(s, args.batch.global_batch), s, args)["loss"]
            for s in range(1, STEPS + 1)]


@pytest.mark.parametrize("precision", list(TOL))
def test_16_bit_3d_tracks_fp32_serial(precision):
    got, serial = _run()[0][precision], _serial()
    worst = max(abs(a - b) / b for a, b in zip(got, serial))
    print(f"\n{precision} dp2-tp2-pp2: worst loss rel diff {worst:.1e}")
    assert worst < TOL[precision]
    assert got[-1] < got[0]


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    for per_rank in _run():
        records = per_rank["overflow"]
        assert [r["skipped"] for r in records] == [False, True, False, False]
        assert [r["unchanged"] for r in records] == [False, True, False, False]
        assert records[1]["scale_after"] == records[0]["scale"] / 2
