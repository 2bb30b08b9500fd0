"""Sharded, atomic checkpoints: every rank writes what it owns; a manifest, last, makes it one.

After reading this file you should understand what ``edu3d train --ckpt-dir DIR`` writes,
why a crash can never leave a checkpoint that loads half-written, and how ``--resume``
continues a run exactly where it stopped, in the same layout or another one.

A checkpoint of step 40 is one folder::

    DIR/step-000040/
        rank-00000.pt     rank 0's pieces: {"pieces": [placement, ...], "data": [1-D tensor,
        rank-00001.pt     ...], "rng": its random-number state}; placements in edu3d.ckpt.reshard
        ...
        rank-00000.json   each rank's receipt: the .pt's sha256, size and pieces, written
        ...               once the .pt is durable
        manifest.json     LAST, by rank 0, once every receipt is there: the step, the records
                          so far, the model config, the options that must match, the layout
                          that wrote it, the optimizer's step count, every file's sha256

**Each rank writes only what it owns** (:meth:`~edu3d.train.trainer.Trainer.checkpoint_slots`):
its TP shards, its pipeline stages, its ZeRO slice of the parameters and of AdamW's moments;
a tensor held by several ranks (TP-replicated, dp replicas, the tied embedding's second copy)
is written once, by one owner.

**Atomic**: every file goes through :func:`write_atomic` (temporary name, fsync, rename,
fsync of the folder). Rank 0 writes the manifest only after every rank's receipt is on disk,
so a folder without ``manifest.json`` is not a checkpoint and is never loaded: a run killed
mid-save resumes from the previous one (:func:`latest_step`). ``--keep-last K`` removes older
checkpoints only after a newer one is committed, and takes a folder's manifest away first
(:func:`prune`): a removal cut short leaves a folder that is not a checkpoint, never a
checkpoint with files missing.

**What resuming needs besides the tensors**: the step. The learning rate is a function of
the step (:func:`edu3d.train.optim.lr_at`), and so is the data: batch ``s`` is
``corpus.batch(s)``, whatever the layout, so the step *is* the data position. The random
state of each rank is restored too when the layout is the same (the model has no dropout, so
nothing depends on it yet). Loading is :func:`torch.load` with ``weights_only=True`` of files
whose sha256 matches the manifest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import torch

from edu3d.ckpt import reshard

FORMAT = "edu3d-checkpoint/1"
MANIFEST = "manifest.json"
# options that change the computation: a checkpoint continues only a run that agrees on them
MUST_MATCH = ("seed", "global_batch", "optimizer", "lr", "weight_decay", "clip", "warmup",
              "lr_schedule")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, corrupted, or of another run."""


def step_dir(root, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def write_atomic(path: Path, data: bytes) -> None:
    """The one place a checkpoint's bytes reach the disk: a temporary name, fsync, rename
    over ``path``, fsync of the folder. A reader sees the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Make a rename or an unlink in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_folders(root: Path) -> dict[int, Path]:
    """Every ``step-N`` folder of ``root``, complete or not, by step."""
    if not root.is_dir():
        return {}
    return {int(d.name[5:]): d for d in root.glob("step-*")
            if d.is_dir() and d.name[5:].isdigit()}


def prune(root, keep: int) -> list[int]:
    """Keep the newest ``keep`` complete checkpoints of ``root`` and remove the older ones
    (torchtitan's ``keep_latest_k``), with any folder a killed save left (no manifest) older
    than the newest; returns the removed steps. Called by rank 0 right after a manifest is
    written, so the newest checkpoint is the one just committed and no save is in flight.
    Each folder loses its manifest first (fsynced): from then on it is not a checkpoint, so a
    removal cut short leaves debris that is never loaded, not a checkpoint with files missing.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    done = steps(root)
    if not done:
        return []
    old = set(done[:-keep]) if len(done) > keep else set()
    old |= {step for step in _step_folders(root)  # the debris of a killed save
            if step < done[-1] and step not in done}
    for step in sorted(old):
        folder = step_dir(root, step)
        (folder / MANIFEST).unlink(missing_ok=True)
        _fsync_folder(folder)
        shutil.rmtree(folder)
    return sorted(old)


# ---- reading ----------------------------------------------------------------------------------
def steps(root) -> list[int]:
    """The steps of ``root`` that have a manifest (complete checkpoints), oldest first."""
    return sorted(step for step, d in _step_folders(Path(root)).items()
                  if (d / MANIFEST).is_file())


def latest_step(root) -> int:
    """The newest step with a manifest in ``root`` (0 when there is none)."""
    done = steps(root) if root else []
    return done[-1] if done else 0


def read_manifest(root, step: int | None = None) -> dict:
    """The manifest of ``step`` (default: the newest), checked for its format."""
    step = latest_step(root) if step is None else step
    path = step_dir(root, step) / MANIFEST
    if not step or not path.is_file():
        which = f"of step {step} " if step else ""
        raise CheckpointError(f"no complete checkpoint {which}in {root} (a complete one has "
                              f"{MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _checked_bytes(path: Path, info: dict) -> bytes:
    """The bytes of ``path`` if its sha256 is the one the manifest lists."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (the manifest lists it)")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != info["sha256"]:
        raise CheckpointError(f"{path} is corrupted: its sha256 is {digest[:12]}..., the "
                              f"manifest says {info['sha256'][:12]}... ({len(data)} bytes, "
                              f"expected {info['bytes']})")
    return data


def read_file(folder: Path, name: str, info: dict) -> dict:
    """One rank's file, its sha256 checked against the manifest, loaded weights-only."""
    return torch.load(io.BytesIO(_checked_bytes(folder / name, info)), weights_only=True)


def verify(root, step: int | None = None) -> dict:
    """Read the manifest and check every file it lists (present, sha256); returns it."""
    manifest = read_manifest(root, step)
    folder = step_dir(root, manifest["step"])
    for name, info in manifest["files"].items():
        _checked_bytes(folder / name, info)
    return manifest


def differences(manifest: dict, config, args) -> list[str]:
    """What differs between a checkpoint and a run that wants to continue it (empty: none)."""
    diff = []
    mine = dataclasses.asdict(config)
    for k, v in manifest["config"].items():
        if mine.get(k) != v:
            diff.append(f"model {k}: checkpoint {v}, this run {mine.get(k)}")
    options = vars(args)  # edu3d train's options (a dataclass); a key it lacks differs too
    for k, v in manifest["options"].items():
        if options.get(k) != v:
            diff.append(f"--{k.replace('_', '-')}: checkpoint {v}, this run {options.get(k)}")
    if args.lr_schedule == "cosine" and manifest["steps"] != args.steps:
        diff.append(f"--steps: checkpoint {manifest['steps']}, this run {args.steps} (the "
                    "cosine schedule depends on the run's length)")
    if manifest["step"] > args.steps:
        diff.append(f"the checkpoint is of step {manifest['step']}, past --steps {args.steps}")
    return diff


def check_resume(args, config) -> int:
    """Before any process starts: the step ``--resume`` will continue from (0: none), after
    checking that checkpoint's files and that it belongs to this run."""
    step = latest_step(args.ckpt_dir)
    if not step:
        return 0
    manifest = verify(args.ckpt_dir, step)
    diff = differences(manifest, config, args)
    if diff:
        raise CheckpointError(f"{step_dir(args.ckpt_dir, step) / MANIFEST} belongs to another "
                              "run: " + "; ".join(diff))
    return step


def check_ckpt_dir(args, config) -> int:
    """``edu3d train``'s checks of ``--ckpt-dir`` before any process starts; returns the step
    the run starts after. With ``--resume``: the newest checkpoint's, checked
    (:func:`check_resume`). Without: the folder must hold no checkpoint, or a restart after a
    failure would resume from a step of some earlier run."""
    if not args.ckpt_dir:
        return 0
    if args.resume:
        return check_resume(args, config)
    done = steps(args.ckpt_dir)
    if done:
        raise CheckpointError(f"--ckpt-dir {args.ckpt_dir} already holds checkpoints (steps "
                              f"{', '.join(map(str, done))}): add --resume to continue from "
                              "the newest, or choose an empty folder")
    return 0


def files_needed(folder: Path, manifest: dict, wanted: list[dict]) -> list[str]:
    """The files of a checkpoint holding a piece that overlaps one of the ``wanted``
    placements (:func:`edu3d.ckpt.reshard.overlaps`): the only ones a loading rank reads."""
    index: dict = {}
    for fname, info in manifest["files"].items():
        for place in info["pieces"]:
            index.setdefault((place["name"], place["kind"]), []).append((fname, place))
    files = set()
    for want in wanted:
        saved = index.get((want["name"], want["kind"]), [])
        if not saved:
            raise CheckpointError(f"{folder / MANIFEST}: no file holds {want['name']} "
                                  f"({want['kind']})")
        files.update(f for f, place in saved if reshard.overlaps(place, want))
    return sorted(files)


def load_pieces(folder: Path, manifest: dict, wanted: list[dict]) -> dict:
    """The saved pieces that overlap the ``wanted`` placements, by ``(name, kind)``: only the
    files holding one are read."""
    out: dict = {}
    for fname in files_needed(folder, manifest, wanted):
        content = read_file(folder, fname, manifest["files"][fname])
        for place, data in zip(content["pieces"], content["data"]):
            out.setdefault((place["name"], place["kind"]), []).append((place, data))
    return out


def full_state(root, step: int | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(manifest, {serial name: full parameter})`` from any layout's checkpoint."""
    manifest = read_manifest(root, step)
    folder = step_dir(root, manifest["step"])
    names = {p["name"]: p["shape"] for info in manifest["files"].values()
             for p in info["pieces"] if p["kind"] == "param"}
    wanted = [{"name": n, "kind": "param", "shape": s, "box": [[0, d] for d in s],
               "flat": [0, max(1, int(torch.Size(s).numel()))]} for n, s in names.items()]
    saved = load_pieces(folder, manifest, wanted)
    try:
        return manifest, {n: reshard.assemble(n, saved[(n, "param")]) for n in names}
    except ValueError as err:
        raise CheckpointError(f"{folder}: {err}") from None
