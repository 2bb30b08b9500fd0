"""Rank functions for the planner-vs-measurement tests (launched with edu3d.launch)."""

from __future__ import annotations

from edu3d import memory
from edu3d.data import SyntheticCorpus
from edu3d.mesh import Layout, Mesh
from edu3d.model import GPT
from edu3d.options import config_from_args
from edu3d.trainer import Trainer
from tests.workers_3d import options


def measured(mesh, argv: list[str]) -> dict:
    """One AdamW step of the layout ``argv``: this rank's bytes by category after the step
    (what ``Trainer.stats`` measures), the peak of its activations during the step, its
    coordinates, and the fullest rank's ``mem_bytes`` as ``edu3d train`` records it."""
    args = options(argv)
    layout = Layout(dp=args.dp, tp=args.tp, pp=args.pp, vpp=args.vpp)
    if layout != mesh.layout:
        mesh = Mesh.build(layout)
    config = config_from_args(args)
    x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.seed).batch(
        1, args.global_batch)
    trainer = Trainer(GPT(config, seed=args.seed), mesh, args)
    trainer.step(x, y, 1)
    mine = memory.measure(trainer.tensors())
    mine["activations"] = trainer.engine.peak_activation_bytes
    mine.pop("total")
    return {"coord": tuple(mesh.coord), "bytes": mine, "mem_bytes": trainer.stats()["mem_bytes"]}


def measured_many(mesh, argvs: list[list[str]]) -> list[dict]:
    """:func:`measured` for several option sets (meshes of the launch's world size)."""
    return [measured(mesh, argv) for argv in argvs]
