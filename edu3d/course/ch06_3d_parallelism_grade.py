"""The grader of exercise 06 (``exercises/grad_norm_3d.py``): the real 3D trainer, checked
against the serial model.

:func:`grade` is a launch target (``launch(grade, 4, layout=Layout(tp=2, pp=2))``). Every
rank builds the library's :class:`~edu3d.train.trainer.Trainer` on a tp2-pp2 layout with tied
embeddings, back-propagates one global batch (2 micro-batches), and hands the learner's
functions the pieces this rank really holds:

* ``sum_tied_embedding_grads(grad, group)`` gets the first stage's ``tok_emb.weight`` and the
  last stage's ``lm_head.weight`` gradients *before* the library sums them (each holds only
  its half); after it, both must equal this rank's shard of the serial model's gradient;
* ``global_grad_norm(pieces, tp_index, group)`` gets every gradient after the library's
  fixes, as :class:`GradPiece` s, and must return the serial model's gradient norm on every
  rank. The provided buggy norm is measured alongside, to show how far off it is.

Every verdict is a bool agreed by all ranks (:func:`~edu3d.distributed.runtime.all_ok`): an unfinished
stub or a wrong answer is ``False`` everywhere, never an exception that would leave the
other ranks waiting in a collective.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from edu3d.course import grading, lesson_args
from edu3d.config.layout import Layout
from edu3d.distributed.runtime import all_ok
from edu3d.launch import launch
from edu3d.model.gpt import GPT, config_from
from edu3d.model.shapes import padded_size
from edu3d.parallel.tp.layers import shard
from edu3d.train.data import SyntheticCorpus
from edu3d.train.trainer import Trainer


class GradPiece(NamedTuple):
    """One gradient this rank holds, as the exercise sees it."""

    name: str  # the serial model's parameter name, e.g. "blocks.0.ln_1.weight"
    grad: torch.Tensor  # this rank's gradient: a TP shard, or the whole tensor
    replicated: bool  # every tp rank holds this same whole tensor (LayerNorms, biases, pos_emb)
    tied_copy: bool  # the last stage's copy of the tied embedding (lm_head.weight)


def _shard_of(full: torch.Tensor, spec, tp_index: int, tp: int) -> torch.Tensor:
    """This tp rank's shard of a serial tensor, for a spec as ``Parallel.specs`` holds it."""
    if spec is None or tp == 1:
        return full
    dim, parts, size = spec
    pad = padded_size(size, tp) if size is not None else None
    return shard(full, dim, tp_index, tp, parts, pad_to=pad)


def _safe(fn, *args):
    """``fn(*args)``, or None when it raises (an unfinished stub, a learner's bug)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - a grader reports False, it never desynchronizes ranks
        return None


def grade(mesh, *, layers: int = 3, global_batch: int = 4, use: dict | None = None) -> dict:
    """Grade ``grad_norm_3d`` on this rank of a tp2-pp2 launch; returns, the same on every
    rank, ``{"tied": bool, "norm": bool, "serial_norm", "norm_value", "buggy_norm",
    "library_norm"}``. ``use`` grades another function of the module under a graded name
    (``{"global_grad_norm": "buggy_global_grad_norm"}``: the tests prove the bug is caught)."""
    mod = grading.load("grad_norm_3d")
    use = use or {}
    norm_fn = getattr(mod, use.get("global_grad_norm", "global_grad_norm"))
    tied_fn = getattr(mod, use.get("sum_tied_embedding_grads", "sum_tied_embedding_grads"))
    # 3 layers over 2 stages (a cut that does not divide) and a vocabulary of 101, which tp=2
    # pads: the shards are uneven on purpose
    config = config_from("tiny", layers=layers, d_model=32, heads=4, vocab=101, seq=16,
                         tie=True)
    x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0).batch(0, global_batch)
    serial = GPT(config, seed=0)
    serial(x, y)[1].backward()
    want = {n: p.grad.detach().clone() for n, p in serial.named_parameters()}
    serial_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g.double()) for g in want.values()])).float()

    args = lesson_args(tp=2, pp=2, tie=True, microbatches=2, optimizer="sgd", lr=0.1,
                       clip=0.0, schedule="1f1b")
    t = Trainer(GPT(config, seed=0), mesh, args)
    par, tp_index, tp = t.par, mesh.index("tp"), mesh.size("tp")
    tied = par.tied

    # 1. the tied embedding, summed by the learner instead of the library
    par.tied = None  # GradSync.finish skips the tied sum: each stage keeps its half
    try:
        t.forward_backward(x, y)
    finally:
        par.tied = tied
    ok = tied is not None and tied.grad is not None
    if ok:
        raw = tied.grad.detach().clone()
        _safe(tied_fn, tied.grad, mesh.group("embed"))
        expect = _shard_of(want["tok_emb.weight"], par.specs.get("tok_emb.weight"), tp_index, tp)
        ok = (tied.grad.shape == expect.shape
              and torch.allclose(tied.grad, expect, rtol=1e-4, atol=1e-6)
              and not torch.allclose(raw, expect, rtol=1e-4, atol=1e-6))
    tied_ok = all_ok(bool(ok))

    # 2. the global norm, from the pieces this rank holds after the library's fixes
    t.forward_backward(x, y)
    pieces = [GradPiece(name, g.detach(), par.specs.get(name) is None,
                        p is par.tied and not par.is_first)
              for name, p, g in t.grads.held()]
    group = mesh.group("mp")
    norm = _safe(norm_fn, pieces, tp_index, group)
    ok = (isinstance(norm, torch.Tensor) and norm.numel() == 1
          and torch.allclose(norm.detach().double().reshape(()), serial_norm.double(),
                             rtol=1e-4))
    norm_ok = all_ok(bool(ok))
    buggy = _safe(mod.buggy_global_grad_norm, pieces, tp_index, group)
    return {"tied": tied_ok, "norm": norm_ok, "serial_norm": float(serial_norm),
            "norm_value": float(norm) if ok else None,
            "buggy_norm": float(buggy) if isinstance(buggy, torch.Tensor) else None,
            "library_norm": float(t.grads.norm())}


def run(timeout: float = 180, **kwargs) -> dict:
    """Launch :func:`grade` on 4 ranks (tp2-pp2) quietly; rank 0's verdicts."""
    res = launch(grade, 4, layout=Layout(tp=2, pp=2), echo=False, progress=False,
                 timeout=timeout, name="grade_3d", kwargs=kwargs)
    return res.results[0]
