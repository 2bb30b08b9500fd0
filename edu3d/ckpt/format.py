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

**Atomic**: every file goes through :func:`edu3d.ckpt.blobs.write_atomic` (temporary name,
fsync, rename, fsync of the folder). Rank 0 writes the manifest only after every rank's
receipt is on disk, so a folder without ``manifest.json`` is not a checkpoint and is never loaded: a run killed
mid-save resumes from the previous one (:func:`latest_step`). ``--keep-last K`` removes older
checkpoints only after a newer one is committed, and takes a folder's manifest away first
(:func:`prune`): a removal cut short leaves a folder that is not a checkpoint, never a
checkpoint with files missing.

**What resuming needs besides the tensors**: the step. The learning rate is a function of
the step (:func:`edu3d.train.optim.lr_at`), and so is the data: batch ``s`` is
``corpus.batch(s)``, whatever the layout, so the step *is* the data position. The random
state of each rank is restored too when the layout is the same (the model has no dropout, so
nothing depends on it yet).

**Incremental checkpoints** (``--incremental``, :mod:`edu3d.ckpt.blobs`): a rank's pieces are
content-addressed blobs in ``DIR/blobs/<sha256>`` shared by every save whose bytes are the same,
and ``files`` lists per rank ``rank-R`` with each piece's blob reference (format
``edu3d-checkpoint/2``); a save writes only blobs that are not there yet, a reader reads only
the blobs of the pieces it needs (:func:`load_pieces`), and after each commit with
``--keep-last`` the blobs no kept manifest names are removed (:func:`collect_blobs`: it reads
only the kept manifests, never an older step's).

**A checkpoint folder is untrusted input** (:mod:`edu3d.ckpt.untrusted`): only the names
edu3d writes are opened, inside the step folder, regular files only; the manifest's schema is
checked before any field is used; a shard is loaded weights-only once its sha256 matches.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import stat
import tempfile
from pathlib import Path

import torch

from edu3d.ckpt import reshard
from edu3d.config.sections import globs
from edu3d.ckpt.blobs import (fsync_folder, remove_unreferenced,
                              write_atomic)  # noqa: F401 (re-exported for the checkpointer)
from edu3d.ckpt.bounds import available_memory
from edu3d.ckpt.manifest_schema import check_manifest
from edu3d.ckpt.untrusted import (FORMAT, FORMAT_BLOBS,  # noqa: F401 (re-exported)
                                  MANIFEST, MUST_MATCH, MUST_MATCH_LATER, CheckpointError,
                                  damaged, read_blob, read_file,  # noqa: F401 (re-exported)
                                  read_inside, read_json, verify_blobs)


def step_dir(root, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def check_writable(ckpt_dir) -> None:
    """Raise ``CheckpointError`` (one line) unless this process can create files in
    ``ckpt_dir``, or create ``ckpt_dir`` itself: checked before any rank starts."""
    path = Path(ckpt_dir).absolute()
    probe = path
    while not probe.exists() and probe != probe.parent:  # the nearest existing ancestor
        probe = probe.parent
    if not probe.is_dir():
        raise CheckpointError(f"--ckpt-dir {ckpt_dir}: {probe} is not a folder; choose a "
                              "folder you can write")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        what = "it" if probe == path else f"its existing parent {probe}"
        raise CheckpointError(f"--ckpt-dir {ckpt_dir}: cannot write in {what} "
                              f"({err.strerror or err}); choose a folder you can write") from None


def _step_folders(root: Path, links: bool = True) -> dict[int, Path]:
    """Every ``step-N`` folder of ``root``, complete or not, by step; a symbolic link to a
    folder only with ``links`` (readers list it, then refuse it: :func:`read_inside`)."""
    if not root.is_dir():
        return {}
    return {int(d.name[5:]): d for d in root.glob("step-*")
            if d.is_dir() and (links or not d.is_symlink()) and d.name[5:].isdigit()}


def prune(root, keep: int, upto: int | None = None) -> list[int]:
    """Keep the newest ``keep`` complete checkpoints of ``root`` and remove the older ones
    (torchtitan's ``keep_latest_k``), with any folder a killed save left (no manifest) older
    than the newest; returns the removed steps. Called by rank 0 right after a manifest is
    written, so the newest checkpoint is the one just committed and no save is in flight.
    Each folder loses its manifest first (fsynced): from then on it is not a checkpoint, so a
    removal cut short leaves debris that is never loaded, not a checkpoint with files missing.
    ``upto`` (the step just committed): checkpoints past it, which a run resumed with
    ``--resume-step`` finds, are neither counted nor removed.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    done = [s for s in steps(root) if upto is None or s <= upto]
    if not done:
        return []
    old = set(done[:-keep]) if len(done) > keep else set()
    old |= {step for step in _step_folders(root)  # the debris of a killed save
            if step < done[-1] and step not in done}
    for step in sorted(old):
        folder = step_dir(root, step)
        if folder.is_symlink():  # never remove anything through a link
            continue
        (folder / MANIFEST).unlink(missing_ok=True)
        fsync_folder(folder)
        shutil.rmtree(folder)
    return sorted(old)


# ---- reading ----------------------------------------------------------------------------------
def _regular(path: Path) -> bool:
    """Is ``path`` a regular file itself (``lstat``: a symbolic link is not)?"""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def steps(root) -> list[int]:
    """The steps of ``root`` that have a manifest (complete checkpoints), oldest first (a
    step folder that is a symbolic link is listed, and refused when read)."""
    return sorted(step for step, d in _step_folders(Path(root)).items()
                  if _regular(d / MANIFEST))


def latest_step(root) -> int:
    """The newest step with a manifest in ``root`` (0 when there is none)."""
    done = steps(root) if root else []
    return done[-1] if done else 0


def read_manifest(root, step: int | None = None) -> dict:
    """The manifest of ``step`` (default: the newest), checked (:func:`check_manifest`)."""
    if root is None or not Path(root).is_dir():
        raise CheckpointError(f"{root}: no such checkpoint folder")
    step = latest_step(root) if step is None else step
    folder = step_dir(root, step)
    path = folder / MANIFEST
    if not step or not folder.is_dir() or not (path.is_file() or path.is_symlink()):
        which = f"of step {step} " if step else ""
        done = steps(root)
        have = f" (complete: steps {', '.join(map(str, done))})" if done else ""
        raise CheckpointError(f"no complete checkpoint {which}in {root} (a complete one has "
                              f"{MANIFEST}){have}")
    return check_manifest(read_json(folder, MANIFEST), path, step)


def verify(root, step: int | None = None) -> dict:
    """Read the manifest and every file it lists (:func:`read_file`: present, size, sha256,
    weights-only, pieces; an incremental checkpoint's blobs: size and sha256, each once,
    streamed); returns the manifest."""
    manifest = read_manifest(root, step)
    folder = step_dir(root, manifest["step"])
    if manifest["format"] == FORMAT_BLOBS:
        verify_blobs(folder, manifest)
        return manifest
    for name, info in manifest["files"].items():
        read_file(folder, name, info)
    return manifest


def differences(manifest: dict, config, run) -> list[str]:
    """What differs between a checkpoint and a run that wants to continue it (empty: none)."""
    diff = []
    mine = dataclasses.asdict(config)
    for k, v in manifest["config"].items():
        if mine.get(k) != v:
            diff.append(f"model {k}: checkpoint {v}, this run {mine.get(k)}")
    options = run.flat()  # edu3d train's flags; a key it lacks differs too
    saved = {**MUST_MATCH_LATER, **manifest["options"]}
    for k, v in saved.items():
        mine = options.get(k)
        if k == "freeze" and isinstance(v, (str, list, type(None))):  # the globs, as typed
            v, mine = ",".join(globs(v)) or None, ",".join(globs(mine)) or None
        if mine != v:
            diff.append(f"--{k.replace('_', '-')}: checkpoint {v}, this run {mine}")
    if run.training.lr_schedule == "cosine" and manifest["steps"] != run.training.steps:
        diff.append(f"--steps: checkpoint {manifest['steps']}, this run {run.training.steps} (the "
                    "cosine schedule depends on the run's length)")
    return diff


def _complete(root) -> str:
    done = steps(root)
    return f"complete: steps {', '.join(map(str, done))}" if done else "no complete checkpoint"


def resume_from(run) -> int:
    """The step a run with ``--resume`` continues from (0: none): ``--resume-step N``, else
    the newest complete checkpoint. A restart after a failure (``--max-restarts``: attempt
    1 and on) takes the newest not past ``--steps``: the run's own last save, or one of the
    same computation that an earlier run left (the options that change it must match)."""
    done = steps(run.checkpoint.ckpt_dir)
    resume_step = run.checkpoint.resume_step
    if run.launch.attempt:
        done = [s for s in done if s <= run.training.steps]
    elif resume_step:
        return resume_step
    return done[-1] if done else 0


def check_continues(manifest: dict, config, run) -> None:
    """Raise ``CheckpointError`` unless the run ``run`` can continue ``manifest``'s step:
    not past ``--steps``, and the same model and options (:func:`differences`)."""
    step, root = manifest["step"], run.checkpoint.ckpt_dir
    if step > run.training.steps:
        if run.checkpoint.resume_step and not run.launch.attempt:
            raise CheckpointError(f"--resume-step {step} is past --steps "
                                  f"{run.training.steps}: pass "
                                  f"--steps above {step}, or an earlier --resume-step "
                                  f"({_complete(root)})")
        raise CheckpointError(f"the newest checkpoint in {root} is step {step}, past --steps "
                              f"{run.training.steps}: pass --steps above {step} to continue it, or "
                              f"--resume-step N to continue an older one ({_complete(root)})")
    diff = differences(manifest, config, run)
    if diff:
        raise CheckpointError(f"{step_dir(root, step) / MANIFEST} belongs to another "
                              "run: " + "; ".join(diff))


def check_resume(run, config) -> int:
    """Before any process starts: the step ``--resume`` will continue from (0: none), after
    checking that checkpoint's files (:func:`verify`) and that this run can continue it."""
    step = resume_from(run)
    if not step:
        return 0
    if step not in steps(run.checkpoint.ckpt_dir):
        raise CheckpointError(f"--resume-step {step}: no complete checkpoint of step {step} in "
                              f"{run.checkpoint.ckpt_dir} ({_complete(run.checkpoint.ckpt_dir)})")
    manifest = read_manifest(run.checkpoint.ckpt_dir, step)
    check_continues(manifest, config, run)
    verify(run.checkpoint.ckpt_dir, step)
    return step


def check_ckpt_dir(run, config) -> int:
    """``edu3d train``'s checks of ``--ckpt-dir`` before any process starts; returns the step
    the run starts after. The folder must be writable (:func:`check_writable`). With
    ``--resume`` (or ``--resume-step``): the checkpoint it continues, checked
    (:func:`check_resume`). Without: the folder must hold no checkpoint, or a restart after a
    failure would resume from a step of some earlier run."""
    if not run.checkpoint.ckpt_dir:
        return 0
    check_writable(run.checkpoint.ckpt_dir)
    if run.checkpoint.resume or run.checkpoint.resume_step:
        return check_resume(run, config)
    done = steps(run.checkpoint.ckpt_dir)
    if done:
        raise CheckpointError(f"--ckpt-dir {run.checkpoint.ckpt_dir} already holds checkpoints "
                              f"(steps "
                              f"{', '.join(map(str, done))}): add --resume to continue from "
                              "the newest, or choose an empty folder")
    return 0


def rank_entry(manifest: dict, rank: int) -> str:
    """The name of rank ``rank``'s entry in ``manifest["files"]``: its file ``rank-R.pt``,
    or, in an incremental checkpoint, ``rank-R`` (its pieces are blobs)."""
    return f"rank-{rank:05d}" + ("" if manifest["format"] == FORMAT_BLOBS else ".pt")


def pieces_needed(folder: Path, manifest: dict, wanted: list[dict]) -> list[tuple]:
    """``(entry, index, placement)`` of every saved piece that overlaps one of the
    ``wanted`` placements (:func:`edu3d.ckpt.reshard.overlaps`): all a loading rank reads."""
    index: dict = {}
    for fname, info in manifest["files"].items():
        for i, place in enumerate(info["pieces"]):
            index.setdefault((place["name"], place["kind"]), []).append((fname, i, place))
    found: dict = {}
    for want in wanted:
        saved = index.get((want["name"], want["kind"]), [])
        if not saved:
            raise CheckpointError(f"{folder / MANIFEST}: no file holds {want['name']} "
                                  f"({want['kind']})")
        found.update({(f, i): place for f, i, place in saved if reshard.overlaps(place, want)})
    return [(f, i, place) for (f, i), place in sorted(found.items())]


def files_needed(folder: Path, manifest: dict, wanted: list[dict]) -> list[str]:
    """The files (rank entries) holding a piece that overlaps one of the ``wanted``
    placements: the only ones a loading rank reads."""
    return sorted({f for f, _, _ in pieces_needed(folder, manifest, wanted)})


def load_pieces(folder: Path, manifest: dict, wanted: list[dict]) -> dict:
    """The saved pieces that overlap the ``wanted`` placements, by ``(name, kind)``: only the
    files holding one are read (in an incremental checkpoint only those pieces' blobs)."""
    out: dict = {}
    if manifest["format"] == FORMAT_BLOBS:
        for fname, i, place in pieces_needed(folder, manifest, wanted):
            what = f"{place['name']} ({place['kind']}) of {fname}"
            data = read_blob(folder.parent, manifest["files"][fname]["blobs"][i], what,
                             folder / MANIFEST)
            out.setdefault((place["name"], place["kind"]), []).append((place, data))
        return out
    for fname in files_needed(folder, manifest, wanted):
        content = read_file(folder, fname, manifest["files"][fname])
        for place, data in zip(content["pieces"], content["data"]):
            out.setdefault((place["name"], place["kind"]), []).append((place, data))
    return out


def collect_blobs(root, known: dict | None = None) -> tuple[int, int] | None:
    """Remove the blobs of ``root`` that no complete checkpoint's manifest names (after
    ``--keep-last`` removed older manifests, or debris of a killed save); returns ``(files,
    bytes)`` removed, or ``None`` when some manifest cannot be read: then what it refers to
    is unknown and nothing is removed. ``known`` (the checkpointer's, by step: the manifest
    file's identity and the blobs it names) spares reading a manifest again that has not
    changed since it was written or read: a save reads only the kept manifests it has not
    seen yet. Called by rank 0 once a save is committed, when no save is in flight."""
    known = {} if known is None else known
    referenced: set[str] = set()
    for step in steps(root):
        path = step_dir(root, step) / MANIFEST
        try:
            seen = known.get(step)
            if seen is None or seen[0] != file_identity(path):
                manifest = read_manifest(root, step)
                known[step] = seen = (file_identity(path), blob_names(manifest))
        except (CheckpointError, OSError):
            return None
        referenced |= seen[1]
    return remove_unreferenced(root, referenced)


def file_identity(path: Path) -> tuple:
    """What changes when a file is replaced or rewritten: its inode, size and time."""
    st = os.lstat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def blob_names(manifest: dict) -> set[str]:
    """The sha256 of every blob an incremental manifest names (none for a plain one)."""
    if manifest["format"] != FORMAT_BLOBS:
        return set()
    return {r["sha256"] for info in manifest["files"].values()
            for r in [*info["blobs"], *info["rng"].values()]}


def full_state(root, step: int | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(manifest, {serial name: full parameter})`` from any layout's checkpoint."""
    manifest = read_manifest(root, step)
    folder = step_dir(root, manifest["step"])
    names = {p["name"]: p["shape"] for info in manifest["files"].values()
             for p in info["pieces"] if p["kind"] == "param"}
    need, free = 4 * sum(math.prod(s) for s in names.values()), available_memory()
    if free is not None and need > free:  # the pieces agree with the config: it is this big
        raise CheckpointError(f"{folder / MANIFEST}: its model's parameters take "
                              f"{need / 2**30:.1f} GiB, and this machine has "
                              f"{free / 2**30:.1f} GiB available")
    wanted = [{"name": n, "kind": "param", "shape": s, "box": [[0, d] for d in s],
               "flat": [0, max(1, int(torch.Size(s).numel()))]} for n, s in names.items()]
    saved = load_pieces(folder, manifest, wanted)
    try:
        return manifest, {n: reshard.assemble(n, saved[(n, "param")]) for n in names}
    except (ValueError, RuntimeError, IndexError) as err:
        raise CheckpointError(f"{folder}: {err}") from None
