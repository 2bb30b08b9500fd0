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
    out = {"coord": tuple(mesh.coord), "bytes": mine, "mem_bytes": trainer.stats()["mem_bytes"]}
    if args.zero == 3:
        out["engine_activations"] = mine["activations"]
        mine["activations"] = _activations_without_gathered_weights(trainer, x, y)
    return out


def _activations_without_gathered_weights(trainer, x, y) -> int:
    """The engine's activation peak for one more step, its meter told which storages are
    parameters *now*. Under ZeRO-3 a unit's weights are gathered into a new allocation
    before each use, so the meter's list of parameter storages, taken when the engine was
    built, misses them and the weights a linear layer saves are counted as activations."""
    engine, meter = trainer.engine, trainer.engine.meter
    params = [p for stage in engine.stages.values() for p in stage.parameters()]
    count = meter.pack

    def pack(t):
        meter.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        return count(t)

    meter.pack = pack
    engine.activation_bytes, engine.peak_activation_bytes = {}, 0
    trainer.forward_backward(x, y)
    return engine.peak_activation_bytes


def measured_many(mesh, argvs: list[list[str]]) -> list[dict]:
    """:func:`measured` for several option sets (meshes of the launch's world size)."""
    return [measured(mesh, argv) for argv in argvs]
