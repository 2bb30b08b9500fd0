"""The grader of exercise 06 (``exercises/grad_norm_3d.py``): the real 3D trainer, checked
against the serial model, then a cut of the layers into pipeline stages.

:func:`grade` is a launch target (``launch(grade, 4, layout=Layout(tp=2, pp=2))``). Every
rank builds the library's :class:`~edu3d.train.trainer.Trainer` on a tp2-pp2 layout with tied
embeddings, back-propagates one global batch (2 micro-batches), and hands the learner's
functions the pieces this rank really holds:

* ``sum_tied_embedding_grads(grad, group)`` gets the first stage's ``tok_emb.weight`` and the
  last stage's ``lm_head.weight`` gradients *before* the library sums them (each holds only
  its half); after it, both must equal this rank's shard of the serial model's gradient;
* ``global_grad_norm(pieces, tp_index, group)`` gets every gradient after the library's
  fixes, as :class:`GradPiece` s, and must return the serial model's gradient norm on every
  rank, on tp2-pp2 and again with the same 4 ranks as dp2-tp2: two replicas, so the
  model-parallel group it is given is no longer the whole world (a norm that sums over the
  world counts every square twice). The provided buggy norm is measured alongside, to show
  how far off it is.

Every verdict is a bool agreed by all ranks (:func:`~edu3d.distributed.runtime.all_ok`): an unfinished
stub or a wrong answer is ``False`` everywhere, never an exception that would leave the
other ranks waiting in a collective.

The design: ``split_layers(job)`` returns how many transformer layers each pipeline stage
holds, for a job of :data:`JOBS` whose first stage also holds the embedding and whose last
holds the LM head and the loss (the tied embedding's two homes). :func:`cost` prices it
under 1F1B: the step is ``(m + p - 1)`` times the slowest stage's forward and backward, and
stage ``s`` keeps ``p - s`` micro-batches of activations beside its weights' state. The
target: the fullest stage fits, the step within 2 % of the best cut (every cut is listed).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from edu3d.course import grading, lesson_args
from edu3d.course.targets import Cost, Target, fmt_bytes, meet, target_of
from edu3d.config.layout import Layout
from edu3d.distributed.mesh import Mesh
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

    def right(value) -> bool:
        return (isinstance(value, torch.Tensor) and value.numel() == 1
                and torch.allclose(value.detach().double().reshape(()), serial_norm.double(),
                                   rtol=1e-4))

    ok = right(norm)
    buggy = _safe(mod.buggy_global_grad_norm, pieces, tp_index, group)

    # 3. the same ranks as dp2-tp2: two replicas, so the model-parallel group is not the world
    replica = Mesh.build(Layout(dp=2, tp=2))
    t2 = Trainer(GPT(config, seed=0), replica, lesson_args(
        dp=2, tp=2, tie=True, microbatches=2, optimizer="sgd", lr=0.1, clip=0.0))
    t2.forward_backward(x, y)
    pieces2 = [GradPiece(name, g.detach(), t2.par.specs.get(name) is None, False)
               for name, p, g in t2.grads.held()]
    ok = ok and right(_safe(norm_fn, pieces2, replica.index("tp"), replica.group("mp")))
    norm_ok = all_ok(bool(ok))
    return {"tied": tied_ok, "norm": norm_ok, "serial_norm": float(serial_norm),
            "norm_value": float(norm) if ok else None,
            "buggy_norm": float(buggy) if isinstance(buggy, torch.Tensor) else None,
            "library_norm": float(t.grads.norm())}


def run(timeout: float = 180, **kwargs) -> dict:
    """Launch :func:`grade` on 4 ranks (tp2-pp2) quietly; rank 0's verdicts."""
    res = launch(grade, 4, layout=Layout(tp=2, pp=2), echo=False, progress=False,
                 timeout=timeout, name="grade_3d", kwargs=kwargs)
    return res.results[0]


# ---- the design: which layers go to which stage --------------------------------------------------
@dataclass(frozen=True)
class Job:
    layers: int
    pp: int
    microbatches: int
    gpu_gb: float
    layer_state: float  # bytes of one layer's state (16 per parameter)
    layer_act: float  # bytes of one layer's activations for one micro-batch


EMB_UNITS, HEAD_UNITS = 0.2, 6.0  # forward + backward, in units of one layer's
EMB_STATE, HEAD_STATE, HEAD_ACT = 1.6e9, 1.6e9, 3.0e9  # the embedding and its tied copy
JOBS = {"a": Job(layers=24, pp=4, microbatches=16, gpu_gb=40, layer_state=3.2e9,
                 layer_act=1.0e9),
        "b": Job(layers=32, pp=4, microbatches=32, gpu_gb=30, layer_state=1.6e9,
                 layer_act=0.5e9)}
SLACK = 1.02


def stage_costs(job: str, split) -> list[Cost]:
    """Each stage's forward and backward (units) and bytes, for ``split`` layers per stage."""
    j = JOBS[job]
    assert isinstance(split, (list, tuple)) and len(split) == j.pp, \
        f"job {job}: split_layers must return {j.pp} layer counts, one per stage"
    split = [int(n) for n in split]
    assert min(split) >= 0 and sum(split) == j.layers, \
        f"job {job}: the stages hold {sum(split)} layers, the model has {j.layers}"
    out = []
    for s, n in enumerate(split):
        first, last = s == 0, s == j.pp - 1
        units = n + (EMB_UNITS if first else 0) + (HEAD_UNITS if last else 0)
        state = n * j.layer_state + (EMB_STATE if first else 0) + (HEAD_STATE if last else 0)
        act = n * j.layer_act + (HEAD_ACT if last else 0)
        out.append(Cost(units, state + (j.pp - s) * act))  # 1F1B: p - s micro-batches alive
    return out


def cost(job: str, split) -> Cost:
    stages = stage_costs(job, split)
    return Cost(time=(JOBS[job].microbatches + JOBS[job].pp - 1) * max(c.time for c in stages),
                memory=max(c.memory for c in stages))


def splits(job: str):
    """Every cut of the layers into ``pp`` stages of at least one layer."""
    n, p = JOBS[job].layers, JOBS[job].pp
    for cuts in itertools.combinations(range(1, n), p - 1):
        yield [b - a for a, b in zip((0,) + cuts, cuts + (n,))]


def target(job: str) -> Target:
    return target_of(splits(job), lambda s: cost(job, s), JOBS[job].gpu_gb * 1e9, SLACK)


def check_design(ex, job: str) -> None:
    split = ex.split_layers(job)
    meet(f"job {job}: stages of {list(split)} layers", cost(job, split), target(job),
         fmt=lambda u: f"{u:g} units")


def describe(job: str, split) -> str:
    try:
        stages = stage_costs(job, split)
    except AssertionError as why:
        return str(why)
    c, t = cost(job, split), target(job)
    per = ", ".join(f"{s.time:g} u / {fmt_bytes(s.memory)}" for s in stages)
    return (f"job {job}: {list(split)}: step {c.time:g} units (target {t.time:g}), fullest "
            f"stage {fmt_bytes(c.memory)} (at most {fmt_bytes(t.memory)}); per stage: {per}")

