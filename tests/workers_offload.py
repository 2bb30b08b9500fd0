"""Rank functions for the activation-offloading tests (launched with edu3d.launch.api, or
called with ``mesh=None`` for one process)."""

from __future__ import annotations

import torch

from edu3d.distributed.mesh import Mesh
from edu3d.model.gpt import GPT
from edu3d.train.data import SyntheticCorpus
from edu3d.train.memory_recorder import MemoryRecorder, document, gather_timelines
from edu3d.train.preflight import model_config
from edu3d.train.trainer import Trainer
from tests.workers_3d import options


def _steps(trainer: Trainer, corpus, run, steps: int, recorder=None) -> list[dict]:
    out = []
    for s in range(1, steps + 1):
        batch = corpus.batch(s, run.batch.global_batch)
        if recorder is not None and s == steps:
            with recorder.watch(s):
                out.append(trainer.step(*batch, s))
        else:
            out.append(trainer.step(*batch, s))
    return out


def compare(mesh, argv: list[str], offload: list[str], steps: int = 2) -> dict:
    """The layout ``argv`` with the offload options ``offload`` against ``argv`` alone, both
    trained ``steps`` AdamW steps on the same data: whether every loss, gradient norm, final
    gradient and final parameter is bitwise equal; the offloader's counts of the last step
    (this rank), each side's pipeline-engine activation peak; and on rank 0 the memory
    timeline of the last step with the planner's estimate (every rank's). ``mesh`` is
    rebuilt on the same ranks when ``argv`` names another layout."""
    base, moved = options(argv), options(argv + offload)
    if mesh is not None and mesh.layout != base.layout:  # the same ranks, this layout
        mesh = Mesh.build(base.layout)
    config = model_config(base)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=base.training.seed)
    plain = Trainer(GPT(config, seed=base.training.seed), mesh, base)
    ref = _steps(plain, corpus, base, steps)
    trainer = Trainer(GPT(config, seed=base.training.seed), mesh, moved)
    recorder = MemoryRecorder(trainer)
    got = _steps(trainer, corpus, moved, steps, recorder)
    out = {"losses": [r["loss"] for r in got],
           "losses_equal": [a["loss"] == b["loss"] for a, b in zip(got, ref)],
           "norms_equal": [a["grad_norm"] == b["grad_norm"] for a, b in zip(got, ref)]}
    for what in ("grad", "param"):
        mine, theirs = trainer.gather(what), plain.gather(what)
        out[f"{what}s_exact"] = all(torch.equal(mine[n], theirs[n]) for n in theirs)
    out["offload"] = trainer.par.offload.read(reset=False)
    out["engine"] = {"plain": plain.engine.peak_activation_bytes,
                     "offload": trainer.engine.peak_activation_bytes}
    timelines = gather_timelines(recorder)
    out["doc"] = None if timelines is None else document(moved, timelines)
    return out


def compare_many(mesh, cases: list[tuple[list[str], list[str]]]) -> list[dict]:
    """:func:`compare` for several ``(layout options, offload options)`` on ``mesh``."""
    return [compare(mesh, argv, offload) for argv, offload in cases]
