"""Rank functions for the checkpoint tests (launched with edu3d.launch.api)."""

from __future__ import annotations


from edu3d.ckpt.format import files_needed, full_state, read_manifest, step_dir
from edu3d.ckpt.checkpointer import Checkpointer
from edu3d.train.data import SyntheticCorpus
from edu3d.distributed.mesh import Mesh
from edu3d.model.gpt import GPT
from edu3d.train.optim import lr_at
from edu3d.commands.train import parse
from edu3d.config.sections import Run
from edu3d.train.preflight import check_args, model_config
from edu3d.train.loop import loop
from edu3d.train.trainer import Trainer


def options(argv: list[str]) -> Run:
    args = parse(argv)
    check_args(args)
    return args


def _trainer(args, serial: bool = False) -> Trainer:
    config = model_config(args)
    if serial:
        return Trainer(GPT(config, seed=args.training.seed), None, args)
    mesh = Mesh.build(args.layout)
    return Trainer(GPT(config, seed=args.training.seed), mesh, args)


def _numbers(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records]


def save_and_resume(mesh, cases: list[tuple[list[str], str]], steps: int = 4,
                    save_at: int = 2) -> list[dict]:
    """For each ``(argv, ckpt_dir)``: train ``steps`` steps with ``edu3d train``'s loop,
    saving asynchronously every ``save_at`` steps (the uninterrupted run); then a fresh
    trainer of the same layout resumes from step ``save_at`` and trains to ``steps``."""
    out = []
    for argv, ckpt_dir in cases:
        args = options([*argv, "--steps", str(steps), "--ckpt-dir", ckpt_dir,
                        "--save-every", str(save_at), "--async-save"])
        config = model_config(args)
        corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
        full = loop(_trainer(args), corpus, args)
        trainer = _trainer(args)
        kept = Checkpointer(trainer, args, model_config(args)).resume(step=save_at)
        resumed = list(kept)
        for s in range(save_at + 1, steps + 1):
            x, y = corpus.batch(s, args.batch.global_batch)
            resumed.append({"step": s, **trainer.step(x, y, s), "lr": lr_at(s, args)})
        out.append({"argv": argv, "full": _numbers(full), "resumed": _numbers(resumed),
                    "blocked": [r.get("ckpt_blocked_s") for r in full]})
    return out


def reshard_into(mesh, ckpt_dir: str, step: int, targets: list[list[str]]) -> list[dict]:
    """Load the checkpoint of ``step`` into each target layout (one process: on rank 0) and train one more step: its loss, and how far the loaded parameters are from
    the checkpoint's full tensors (gathered back from the new layout's shards), and the
    files this rank read."""
    _, want = full_state(ckpt_dir, step)
    out = []
    for argv in targets:
        args = options([*argv, "--steps", str(step + 1), "--ckpt-dir", ckpt_dir])
        serial = args.layout.dp * args.layout.tp * args.layout.pp == 1
        if serial and mesh.rank != 0:
            continue
        config = model_config(args)
        corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
        trainer = _trainer(args, serial)
        folder = step_dir(ckpt_dir, step)
        files = files_needed(folder, read_manifest(ckpt_dir, step),
                             [place for place, _, _ in trainer.checkpoint_slots()])
        kept = Checkpointer(trainer, args, model_config(args)).resume(step=step)
        params = trainer.gather("param")
        err = max(float((params[n] - t).abs().max()) for n, t in want.items())
        x, y = corpus.batch(step + 1, args.batch.global_batch)
        rec = trainer.step(x, y, step + 1)
        out.append({"argv": argv, "kept": len(kept), "param_err": err, "files": files, **rec})
    return out


def resume_then_reshard(mesh, cases, steps: int, save_at: int, into: list[list[str]]) -> dict:
    """:func:`save_and_resume` for ``cases``, then the first case's checkpoint of step
    ``save_at`` loaded into the ``into`` layouts (:func:`reshard_into`), in one launch."""
    return {"resume": save_and_resume(mesh, cases, steps, save_at),
            "reshard": reshard_into(mesh, cases[0][1], save_at, into)}


def generate_tp(mesh, ckpt_dir: str, prompt: list[int], new: int) -> dict:
    """Greedy and sampled tokens under this launch's tensor parallelism."""
    from edu3d.train.generation import generate, load_model

    model = load_model(ckpt_dir, mesh)
    return {"greedy": generate(model, prompt, new, temperature=0.0, mesh=mesh),
            "sampled": generate(model, prompt, new, temperature=0.8, seed=3, mesh=mesh)}



def sync_save_is_committed(mesh, ckpt_dir: str, manifest_delay_s: float = 1.0) -> bool:
    """One step on dp=2, then a synchronous save whose manifest rank 0 writes late: is the
    checkpoint complete on every rank the moment ``save`` returns?"""
    import time

    from edu3d.ckpt.format import MANIFEST

    args = options(["--dp", "2", "--layers", "2", "--steps", "2", "--ckpt-dir", ckpt_dir,
                    "--save-every", "1"])
    config = model_config(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    trainer = _trainer(args)
    ckpt = Checkpointer(trainer, args, model_config(args))
    if mesh.rank == 0:
        write = ckpt.write_manifest

        def late(job):
            time.sleep(manifest_delay_s)  # a busy machine: rank 0 is slow to commit
            write(job)

        ckpt.write_manifest = late
    x, y = corpus.batch(1, args.batch.global_batch)
    records = [{"step": 1, **trainer.step(x, y, 1)}]
    ckpt.save(1, records)
    return (step_dir(ckpt_dir, 1) / MANIFEST).is_file()


def save_on_a_slow_disk(mesh, ckpt_dir: str, slow_rank: int, stall_s: float) -> bool:
    """One step on dp=world, then a synchronous save in which ``slow_rank``'s first fsync
    takes ``stall_s`` seconds (a slow disk: the process sleeps in a system call)."""
    import os
    import time

    from edu3d.distributed import trace

    world = mesh.layout.world_size
    args = options(["--dp", str(world), "--global-batch", str(2 * world), "--layers", "2",
                    "--steps", "1", "--ckpt-dir", ckpt_dir])
    config = model_config(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    trainer = _trainer(args)
    ckpt = Checkpointer(trainer, args, config)
    x, y = corpus.batch(1, args.batch.global_batch)
    with trace.current().context(step=1):
        records = [{"step": 1, **trainer.step(x, y, 1)}]
    if mesh.rank == slow_rank:
        fsync = os.fsync

        def slow(fd):
            print("fsync stalls", flush=True)
            time.sleep(stall_s)
            fsync(fd)

        os.fsync = slow
    ckpt.save(1, records)
    return True
