"""Reading a sharded checkpoint from outside the run that wrote it (``edu3d ckpt show|export``,
whose command line is :mod:`edu3d.commands.ckpt`).

After reading this file you should understand how a checkpoint leaves edu3d:

* ``edu3d ckpt show DIR`` prints what a folder holds: the complete steps (each one's files
  checked: present, sha256, loadable weights-only; a damaged one is listed as damaged, with
  what is wrong), the folders that are not checkpoints (no manifest), the layout that wrote
  the newest one, and each rank's file with its pieces;
* ``edu3d ckpt export DIR OUT`` assembles every parameter's full tensor from the shards
  (:func:`edu3d.ckpt.format.full_state`) and writes **one file** that plain ``torch.load``
  reads: ``{"config": {...}, "step": 40, "model": state_dict}``, so
  ``GPT(GPTConfig(**d["config"])).load_state_dict(d["model"])`` is the whole recipe;
* ``--format dcp`` writes the same state dict with ``torch.distributed.checkpoint.save``
  (PyTorch's distributed checkpoint, DCP), which ``dcp.load`` reads back into the serial
  model, and which other tools built on DCP (torchtitan, for one) can reshard themselves.

Why an export rather than DCP metadata over edu3d's own shards: DCP describes every saved
chunk as a *box* (offsets and sizes per dimension, ``ChunkStorageMetadata``). A TP shard is a
box, but a ZeRO shard is a run of a flat buffer that starts and ends inside rows (see
:mod:`edu3d.ckpt.reshard`): it has no box, and DCP cannot name it. (PyTorch's FSDP2 shards each
parameter along dimension 0 for that reason.) Assembling first sidesteps the question.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from edu3d.ckpt.format import (FORMAT_BLOBS, CheckpointError, full_state, read_manifest,
                               step_dir, steps, verify)
from edu3d.ckpt.untrusted import BLOBS
from edu3d.model.gpt import GPT, GPTConfig


def state_dict(ckpt_dir, step: int | None = None) -> tuple[dict, dict]:
    """``(manifest, state dict of the serial GPT)``, the tied head included when tied."""
    manifest, params = full_state(ckpt_dir, step)
    model = GPT(GPTConfig(**manifest["config"]))
    missing = set(n for n, _ in model.named_parameters()) - set(params)
    if missing:
        raise CheckpointError(f"{ckpt_dir}: no saved pieces of {sorted(missing)}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if params[name].shape != p.shape:
                raise CheckpointError(f"{ckpt_dir}: {name} is saved with shape "
                                      f"{list(params[name].shape)}, the model's is "
                                      f"{list(p.shape)}")
            p.copy_(params[name])
    return manifest, model.state_dict()


def export(ckpt_dir, out, step: int | None = None, fmt: str = "torch") -> Path:
    """Write one consolidated checkpoint (``fmt`` ``"torch"``: one file; ``"dcp"``: a DCP
    folder); returns its path. An ``out`` that cannot be written is one ``CheckpointError``
    line, checked before the shards are read."""
    out = Path(out)
    _check_out(out, fmt)
    manifest, sd = state_dict(ckpt_dir, step)
    try:
        if fmt == "dcp":
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.save({"model": sd}, checkpoint_id=str(out), no_dist=True)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"config": manifest["config"], "step": manifest["step"], "model": sd}, out)
    except (OSError, RuntimeError) as err:
        raise CheckpointError(f"cannot write {out}: {getattr(err, 'strerror', None) or err}"
                              ) from None
    return out


def _check_out(out: Path, fmt: str) -> None:
    """Refuse an export target that cannot be written: an existing folder for one file,
    an existing file for a DCP folder, or a path under a file or an unwritable folder."""
    if fmt == "torch" and out.is_dir():
        raise CheckpointError(f"{out} is a folder; give a file name, e.g. {out / 'model.pt'}")
    if fmt == "dcp" and out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file; --format dcp writes a folder")
    probe = out if fmt == "dcp" and out.is_dir() else out.parent
    while not probe.exists() and probe != probe.parent:  # the nearest existing ancestor
        probe = probe.parent
    if not probe.is_dir():
        raise CheckpointError(f"cannot write {out}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write {out}: {probe} is not writable")


def describe(ckpt_dir, step: int | None = None, check: bool = True) -> tuple[str, list[str]]:
    """What ``edu3d ckpt show`` prints, and the problems found, one line per damaged
    checkpoint. ``check``: every complete checkpoint's files are read and verified
    (:func:`~edu3d.ckpt.format.verify`); without it the text says they were not."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such folder" if not root.exists() else
                              f"{root} is not a folder (a checkpoint folder holds step-N ones)")
    done = steps(root)
    partial = sorted(d.name for d in root.glob("step-*") if d.is_dir() and
                     d.name[5:].isdigit() and int(d.name[5:]) not in done)
    problems, bad = [], []
    for s in done if check else []:
        try:
            verify(root, s)
        except CheckpointError as err:
            problems.append(str(err))
            bad.append(s)
    good = [s for s in done if s not in bad]
    how = "files verified" if check else "files NOT verified (--no-verify)"
    lines = [f"{root}: complete checkpoints at steps {', '.join(map(str, good)) or 'none'} "
             f"({how})"]
    if bad:
        lines.append(f"damaged, never loaded: steps {', '.join(map(str, bad))}")
    if partial:
        lines.append(f"not checkpoints (no manifest, never loaded): {', '.join(partial)}")
    if (step is None and not good) or step in bad:
        return "\n".join(lines), problems
    m = read_manifest(root, step if step is not None else good[-1])
    lay = m["layout"]
    lines.append(f"step {m['step']} written by dp={lay['dp']} tp={lay['tp']} pp={lay['pp']}"
                 f" vpp={lay['vpp']} zero={lay.get('zero')}"
                 + (f" hsdp={lay['hsdp']}" if lay.get("hsdp", 1) != 1 else "")
                 + f" ({lay['world_size']} ranks); model "
                 + " ".join(f"{k}={v}" for k, v in m["config"].items()))
    lines.append(f"optimizer {m['options']['optimizer']}, {m['optimizer_step']} updates; "
                 f"{len(m['records'])} records kept; {m['data_position']}")
    folder = step_dir(root, m["step"])
    if m["format"] == FORMAT_BLOBS:
        lines += _references(root, m)
    for name, info in m["files"].items():
        kinds: dict[str, int] = {}
        for p in info["pieces"]:
            kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
        what = ", ".join(f"{k} {n}" for k, n in kinds.items()) or "nothing it alone owns"
        if m["format"] == FORMAT_BLOBS:
            refs = [*info["blobs"], *info["rng"].values()]
            new = set(info["written"])
            wrote = sum(r["bytes"] for r in refs if r["sha256"] in new)
            lines.append(f"  {folder.name}/{name}  {sum(r['bytes'] for r in refs) / 2**10:8.1f}"
                         f" KiB in {len(refs)} blobs, {wrote / 2**10:.1f} KiB written by this "
                         f"save  pieces: {what}")
            continue
        lines.append(f"  {folder.name}/{name}  {info['bytes'] / 2**10:8.1f} KiB  sha256 "
                     f"{info['sha256'][:12]}  pieces: {what}")
    return "\n".join(lines), problems


def _references(root: Path, m: dict) -> list[str]:
    """What an incremental checkpoint refers to in ``blobs/``, and what else is there."""
    size: dict = {}
    for info in m["files"].values():
        size.update({r["sha256"]: r["bytes"] for r in [*info["blobs"], *info["rng"].values()]})
    new = {s for info in m["files"].values() for s in info["written"]}
    wrote = sum(size[s] for s in new if s in size)
    total = sum(size.values())
    out = [f"incremental: refers to {len(size)} blobs in {root / BLOBS} ({total / 2**10:.1f} "
           f"KiB); this save wrote {len(new)} of them ({wrote / 2**10:.1f} KiB), the other "
           f"{len(size) - len(new)} ({(total - wrote) / 2**10:.1f} KiB) were "
           "already there, written by earlier saves"]
    folder = root / BLOBS
    if folder.is_dir() and not folder.is_symlink():
        held = [p for p in folder.iterdir() if p.is_file() and not p.is_symlink()]
        kib = sum(p.stat().st_size for p in held) / 2**10
        out.append(f"{BLOBS}/ holds {len(held)} files ({kib:.1f} KiB) for every complete "
                   "checkpoint here")
    return out
