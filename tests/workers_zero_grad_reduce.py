"""Rank workers for tests/test_zero_grad_reduce.py: ZeRO-2/3 reducing per micro-batch or per
step, through the trainer (parity, peak memory, bytes on the wire), as a library, and on
FSDP2 (``--impl torch``); with HSDP (``--hsdp``, ``Zero(..., replicate_group=)``) too.

Imports inside functions: :func:`torch_cases` alone needs ``torch.distributed.pipelining``
(through the torch bridge), which the other workers' ranks need not import."""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.distributed import trace
from edu3d.distributed.mesh import Mesh
from edu3d.config.layout import Layout
from edu3d.model.gpt import GPT
from edu3d.parallel.zero.sharding import Zero
from edu3d.train.data import SyntheticCorpus
from edu3d.train.preflight import model_config
from edu3d.train.trainer import Trainer
from tests.workers_3d import options, parity
from tests.workers_library_zero import OPTIMIZERS, LibModel, batch, groups


def on_layout(meshes: dict, argv: list[str]) -> Mesh:
    """The mesh of ``argv``'s layout from ``meshes`` (by layout), built there the first time
    (by every rank: ``new_group`` is collective)."""
    layout = options(argv).layout
    if layout not in meshes:
        meshes[layout] = Mesh.build(layout)
    return meshes[layout]


def measured(mesh, argv: list[str], name: str = "") -> dict:
    """One AdamW step of ``argv`` (traced as ``case=name``): the trainer's record figures
    (peak memory by category, bytes sent per collective kind) and the unit sizes they
    follow from."""
    args = options(argv)
    config = model_config(args)
    x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed).batch(1, 8)
    trainer = Trainer(GPT(config, seed=args.training.seed), mesh, args)
    with trace.current().context(case=name):
        trainer.step(x, y, 1)
    stats = trainer.stats()
    zero = trainer.par.zero
    return {"mem": stats["mem_bytes"], "wire": stats["wire_bytes"], "coord": mesh.index("dp"),
            "padded": sum(u.padded for u in zero.units) if zero else 0,
            "numel": sum(u.numel for u in zero.units) if zero else 0,
            "shard": sum(u.shard_numel for u in zero.units) if zero else 0}


def trainer_cases(mesh, parity_cases: list, refs: list, measure_cases: list,
                  hsdp_library: bool = False) -> dict:
    """:func:`tests.workers_3d.parity` for each ``(name, argv)`` of ``parity_cases`` against
    its serial reference, :func:`measured` for each of ``measure_cases`` (each on a mesh of
    its layout), and with ``hsdp_library`` :func:`library_hsdp`."""
    meshes = {mesh.layout: mesh}
    out = {name: parity(on_layout(meshes, argv), argv, ref)
           for (name, argv), ref in zip(parity_cases, refs, strict=True)}
    out.update({name: measured(on_layout(meshes, argv), argv, name)
                for name, argv in measure_cases})
    if hsdp_library:
        out["hsdp library"] = library_hsdp()
    return out


# ---- Zero as a library: the model's own micro-batch loop ----------------------------------
def _reference(opt: str, m: int, world: int = 2) -> dict:
    model = LibModel()
    model.use_extra = True
    cls, kw = OPTIMIZERS[opt]
    optimizer = cls(groups(model), **kw)
    for step in range(1, 4):
        optimizer.zero_grad()
        for part in batch(step).chunk(world * m):  # rank r's micro-batch i: part r*m+i
            (model(part) / (world * m)).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zero_run(stage: int, mode: str, opt: str, m: int, group=None, replicate=None) -> dict:
    """Three steps of ``m`` micro-batches per rank, the user marking nothing per micro-batch
    (per-microbatch) or every backward but the last inside ``no_sync()`` (per-step); sharded
    over ``group`` (and with HSDP across ``replicate``), each rank its own rows."""
    model = LibModel()
    cls, kw = OPTIMIZERS[opt]
    zero = Zero(model, group, stage, optimizer_class=cls, params=groups(model),
                grad_reduce=mode, replicate_group=replicate, **kw)
    rank, world = dist.get_rank(), dist.get_world_size()
    sent = []
    for step in range(1, 4):
        zero.zero_grad()
        parts = batch(step).chunk(world * m)[rank * m:(rank + 1) * m]
        for i, part in enumerate(parts):
            quiet = zero.no_sync() if mode == "per-step" and i < m - 1 else None
            if quiet is None:
                (model(part) / m).backward()
            else:
                with quiet:
                    (model(part) / m).backward()
            sent.append(sum(p.grad is not None for p in model.parameters()))
        zero.finish()
        zero.step()
    return {"state": model.state_dict(), "grads_kept": sent,
            "n_params": len(list(model.parameters()))}


def library_cases(mesh) -> dict:
    """Zero on a plain model at stages 1-3 in both modes, m = 1, 2, 4, against one process;
    and what ``no_sync`` does per micro-batch."""
    out = {}
    for opt in ("adamw", "sgd"):
        for m in (1, 2, 4):
            ref = _reference(opt, m)
            for stage in (1, 2, 3):
                for mode in ("per-microbatch", "per-step"):
                    got = _zero_run(stage, mode, opt, m)
                    err = max(float((got["state"][k].double() - v.double()).abs().max())
                              for k, v in ref.items())
                    out[f"zero{stage}/{mode}/{opt}/m{m}"] = err
                    if opt == "adamw" and m == 4:
                        out[f"zero{stage}/{mode}/kept"] = got["grads_kept"][:m]
                        out["n_params"] = got["n_params"]
    for stage in (1, 2, 3):
        zero = Zero(LibModel(), None, stage)
        try:
            with zero.no_sync():
                pass
            out[f"zero{stage}/no_sync"] = "ran"
        except RuntimeError as err:
            out[f"zero{stage}/no_sync"] = str(err)
    try:
        Zero(LibModel(), None, 2, grad_reduce="per-batch")
    except ValueError as err:
        out["bad_mode"] = str(err)
    return out


def library_hsdp() -> dict:
    """``Zero(model, shard_group, replicate_group=...)`` on 4 ranks (2 replica groups of 2)
    with the user's own loop of 2 micro-batches, every stage and mode: the largest
    difference from one process, by case."""
    mesh = Mesh.build(Layout(dp=4), hsdp=2)
    shard, across = mesh.group("shard"), mesh.group("replicate")
    out = {}
    for opt in ("adamw", "sgd"):
        ref = _reference(opt, 2, world=4)
        for stage in (1, 2, 3):
            for mode in ("per-microbatch", "per-step"):
                got = _zero_run(stage, mode, opt, 2, shard, across)
                out[f"zero{stage}/{mode}/{opt}"] = max(
                    float((got["state"][k].double() - v.double()).abs().max())
                    for k, v in ref.items())
    return out


# ---- --impl torch: what FSDP2 does in each mode -------------------------------------------
def torch_cases(mesh, argvs: list[list[str]], steps: int) -> dict:
    """:func:`edu3d.production.compare.parity` for each of ``argvs`` (``--impl torch``), and
    FSDP2's reduce-scatters and all-gathers of one step of each, counted by wrapping the
    ``torch.distributed`` functions FSDP2 calls (edu3d's own collectives are not counted)."""
    from edu3d.production.compare import options, parity
    from edu3d.production.torch_impl import TorchTrainer

    out = {}
    counts = {"reduce_scatter_single": 0, "all_gather_single": 0}
    saved = {name: getattr(dist, name) for name in counts}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return saved[name](*args, **kwargs)
        return call

    for argv in argvs:
        key = " ".join(argv)
        out[key] = parity(argv, steps, False)
        args = options([*argv, "--impl", "torch"])
        config = model_config(args)
        x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed).batch(1, 8)
        trainer = TorchTrainer(GPT(config, seed=args.training.seed), mesh, args)
        for name in counts:
            counts[name] = 0
            setattr(dist, name, counting(name))
        try:
            trainer.step(x, y, 1)
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
        out[key]["calls"] = dict(counts)
    return out
