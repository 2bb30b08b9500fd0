"""A checkpoint folder is untrusted input: what edu3d checks before it uses a byte of one.

After reading this file you should understand why a checkpoint is read like a file from a
stranger, and the checks every reader (``--resume``, ``edu3d ckpt show|export``, ``edu3d
generate``) goes through, each failure one :class:`CheckpointError` line naming the file:

* **names**: a manifest lists its files by name, and a name is a path: ``/etc/shadow`` or
  ``../other-run/step-000040/rank-00000.pt`` would read any file on the machine (with its
  sha256 in the manifest, the checksum vouches for it). Only the names edu3d writes are
  opened, ``rank-NNNNN.pt`` and ``manifest.json``, so nothing outside the step folder
  (:func:`read_inside`);
* **regular files only**: a symbolic link is refused, not followed (``O_NOFOLLOW``, and the
  step folder is no link either); a FIFO or a device is refused without blocking on it;
* **the manifest's schema** (:func:`check_manifest`): every field edu3d reads has its JSON
  type and sense (a ``step`` that is an integer and the folder's, ``files`` not empty, every
  placement a box inside its shape), before any of it is used;
* **the shards**: sha256 and size as the manifest says, then ``torch.load(weights_only=True)``
  (a pickle that would run code is refused; torch's advice to retry with
  ``weights_only=False``, which would run it, is not repeated), then its pieces checked
  against the manifest's entry (:func:`read_file`);
* **the blobs** of an incremental checkpoint (:func:`read_blob`): a reference is 64 hex digits
  naming a file of the root's ``blobs/`` folder, so it can never escape the checkpoint; the
  blob is a regular file whose size and sha256 are the reference's, read as raw numbers of an
  allowed dtype (nothing is unpickled); a missing or corrupted blob is one line naming the
  blob, the tensor and the manifest that refers to it.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import os
import re
import stat
import warnings
from pathlib import Path

import torch

from edu3d.model.gpt import GPTConfig

FORMAT = "edu3d-checkpoint/1"
MANIFEST = "manifest.json"
# options that change the computation: a checkpoint continues only a run that agrees on them
MUST_MATCH = ("seed", "global_batch", "optimizer", "lr", "weight_decay", "clip", "warmup",
              "lr_schedule")
# options added later, that change the computation too: absent from an older manifest means
# the default (a checkpoint from before --freeze trained every parameter)
MUST_MATCH_LATER = {"freeze": None}
RANK_FILE = re.compile(r"rank-\d{5}\.pt")  # the only names a manifest may list
# --incremental (edu3d.ckpt.blobs): a rank's entry is a list of blobs, each named by its
# sha256 in the checkpoint root's blobs/ folder: a reference is 64 hex digits, never a path
FORMAT_BLOBS = "edu3d-checkpoint/2"
RANK_KEY = re.compile(r"rank-\d{5}")
SHA256 = re.compile(r"[0-9a-f]{64}")
BLOBS = "blobs"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "uint8": torch.uint8}
# the manifest's fields and their JSON types (int: a JSON integer, never true/false)
SCHEMA = {"step": int, "steps": int, "files": dict, "config": dict, "options": dict,
          "layout": dict, "optimizer_step": int, "precision": dict, "records": list,
          "data_position": str}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, corrupted, or of another run."""


def read_inside(folder: Path, name: str) -> bytes:
    """The bytes of ``folder/name`` if it is a file edu3d writes there: ``name`` is
    ``manifest.json`` or ``rank-NNNNN.pt`` (no folder part, so nothing outside ``folder``),
    or a sha256 in a ``blobs`` folder; ``folder`` is no symbolic link, and the file is a
    regular one (a link is refused, not followed: ``O_NOFOLLOW``; a FIFO or a device is
    refused without blocking)."""
    path = folder / str(name)
    blob = folder.name == BLOBS and isinstance(name, str) and SHA256.fullmatch(name)
    if not isinstance(name, str) or not (name == MANIFEST or RANK_FILE.fullmatch(name) or blob):
        raise CheckpointError(f"{folder / MANIFEST} lists {name!r}: not a file edu3d writes "
                              "(rank-NNNNN.pt in the checkpoint's own folder); refused")
    if folder.is_symlink():
        raise CheckpointError(f"{folder} is a symbolic link: a checkpoint is read only from "
                              "its own folder; refused")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (the manifest lists it)") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise CheckpointError(f"{path} is a symbolic link: a checkpoint's files are regular "
                                  "files in its own folder; refused") from None
        raise CheckpointError(f"{path}: cannot read it ({err.strerror or err})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CheckpointError(f"{path} is not a regular file; refused")
        return f.read()


def damaged(path: Path, what: str) -> CheckpointError:
    """The error for a file whose content is wrong: the file, what is wrong, and why."""
    return CheckpointError(f"{path}: {what}; the file is damaged or was not written by edu3d")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_piece(where: Path, name: str, p) -> None:
    """One placement (:mod:`edu3d.ckpt.reshard`): its shape, a box inside it, a flat range
    inside the box."""
    ok = (isinstance(p, dict) and isinstance(p.get("name"), str)
          and isinstance(p.get("kind"), str) and isinstance(p.get("shape"), list)
          and isinstance(p.get("box"), list) and isinstance(p.get("flat"), list)
          and len(p["shape"]) >= 1 and all(_is_int(d) and d >= 0 for d in p["shape"])
          and len(p["box"]) == len(p["shape"]))
    ok = ok and all(isinstance(r, list) and len(r) == 2 and all(map(_is_int, r))
                    and 0 <= r[0] < r[1] <= d for r, d in zip(p["box"], p["shape"]))
    ok = ok and len(p["flat"]) == 2 and all(map(_is_int, p["flat"])) and \
        0 <= p["flat"][0] < p["flat"][1] <= math.prod(b - a for a, b in p["box"])
    if not ok:
        raise damaged(where, f"a piece of {name} is not a placement (name, kind, shape, box, "
                             f"flat inside one another): {json.dumps(p)[:120]}")


def check_manifest(manifest, path: Path, step: int) -> dict:
    """``manifest`` (parsed from ``path``, the folder of ``step``) if every field edu3d reads
    has its type and sense; else one :class:`CheckpointError` line naming the field."""
    if not isinstance(manifest, dict):
        raise damaged(path, f"holds a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") not in (FORMAT, FORMAT_BLOBS):
        raise damaged(path, f"format {manifest.get('format')!r}, expected {FORMAT!r} or "
                            f"{FORMAT_BLOBS!r}")
    for key, kind in SCHEMA.items():
        if key not in manifest:
            raise damaged(path, f"no {key!r}")
        value = manifest[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            want = {int: "integer", dict: "object", list: "list", str: "string"}[kind]
            raise damaged(path, f"{key!r} is {json.dumps(value)[:40]}, not a JSON {want}")
    if manifest["step"] != step:
        raise damaged(path, f"'step' is {manifest['step']}, but the folder is of step {step}")
    if not manifest["files"]:
        raise damaged(path, "'files' lists no file")
    lay, prec = manifest["layout"], manifest["precision"]
    if not all(_is_int(lay.get(k)) and lay[k] >= 1 for k in ("dp", "tp", "pp", "vpp",
                                                               "world_size")):
        raise damaged(path, f"'layout' {json.dumps(lay)[:80]} lacks dp, tp, pp, vpp, world_size")
    if not (isinstance(prec.get("mode"), str) and isinstance(prec.get("scale"), (int, float))
            and _is_int(prec.get("good_steps")) and _is_int(prec.get("skipped"))):
        raise damaged(path, f"'precision' {json.dumps(prec)[:80]} lacks mode, scale, "
                            "good_steps, skipped")
    missing = [k for k in MUST_MATCH if k not in manifest["options"]]
    if missing:
        raise damaged(path, f"'options' lacks {', '.join(missing)}")
    try:
        GPTConfig(**manifest["config"])
    except (TypeError, ValueError) as err:
        raise damaged(path, f"'config' is no model: {err}") from None
    if len(manifest["records"]) != step or not all(isinstance(r, dict)
                                                   for r in manifest["records"]):
        raise damaged(path, f"'records' holds {len(manifest['records'])} entries, not one "
                            f"object per step up to {step}")
    if manifest["format"] == FORMAT_BLOBS:
        return _check_blob_entries(manifest, path)
    shapes: dict = {}
    for name, info in manifest["files"].items():
        if not RANK_FILE.fullmatch(name):
            raise CheckpointError(f"{path} lists {name!r}: not a file edu3d writes "
                                  "(rank-NNNNN.pt in the checkpoint's own folder); refused")
        if not (isinstance(info, dict) and _is_int(info.get("rank"))
                and name == f"rank-{info['rank']:05d}.pt"
                and isinstance(info.get("sha256"), str)
                and re.fullmatch(r"[0-9a-f]{64}", info["sha256"])
                and _is_int(info.get("bytes")) and isinstance(info.get("pieces"), list)):
            raise damaged(path, f"the entry of {name} is not {{rank, sha256, bytes, pieces}}")
        for p in info["pieces"]:
            _check_piece(path, name, p)
            if shapes.setdefault((p["name"], p["kind"]), p["shape"]) != p["shape"]:
                raise damaged(path, f"pieces of {p['name']} ({p['kind']}) disagree on its "
                                    f"shape: {shapes[(p['name'], p['kind'])]} and {p['shape']}")
    return manifest


def _is_ref(ref) -> bool:
    """A blob reference: ``{"sha256": 64 hex digits, "bytes": n >= 0, "dtype": known}``."""
    return (isinstance(ref, dict) and isinstance(ref.get("sha256"), str)
            and bool(SHA256.fullmatch(ref["sha256"])) and _is_int(ref.get("bytes"))
            and ref["bytes"] >= 0 and ref.get("dtype") in DTYPES)


def _check_blob_entries(manifest: dict, path: Path) -> dict:
    """An incremental manifest's ``files``: per rank ``rank-NNNNN``, its pieces, one blob
    reference per piece whose size is the piece's, and its random state's blob."""
    shapes: dict = {}
    for name, info in manifest["files"].items():
        if not (RANK_KEY.fullmatch(name) and isinstance(info, dict)
                and _is_int(info.get("rank")) and name == f"rank-{info['rank']:05d}"
                and isinstance(info.get("pieces"), list) and isinstance(info.get("blobs"), list)
                and len(info["blobs"]) == len(info["pieces"])
                and all(map(_is_ref, info["blobs"])) and isinstance(info.get("rng"), dict)
                and all(_is_ref(r) and r["dtype"] == "uint8" for r in info["rng"].values())):
            raise damaged(path, f"the entry {name!r} is not {{rank, pieces, blobs (one "
                                "sha256 reference per piece), rng}")
        for p, ref in zip(info["pieces"], info["blobs"]):
            _check_piece(path, name, p)
            if ref["bytes"] != (p["flat"][1] - p["flat"][0]) * DTYPES[ref["dtype"]].itemsize:
                raise damaged(path, f"{name}: the blob of {p['name']} ({p['kind']}) holds "
                                    f"{ref['bytes']} bytes, not its piece's")
            if ref["dtype"] == "uint8":
                raise damaged(path, f"{name}: {p['name']} ({p['kind']}) is not floating-point")
            if shapes.setdefault((p["name"], p["kind"]), p["shape"]) != p["shape"]:
                raise damaged(path, f"pieces of {p['name']} ({p['kind']}) disagree on its "
                                    f"shape: {shapes[(p['name'], p['kind'])]} and {p['shape']}")
    return manifest


def read_blob(root: Path, ref: dict, what: str, manifest_path: Path) -> torch.Tensor:
    """The tensor a blob reference names: ``root/blobs/<sha256>`` (only that folder: the
    name is 64 hex digits), a regular file, its size and sha256 the reference's, read as raw
    numbers of its dtype (no unpickling at all). ``what`` (the tensor) goes into the one-line
    error of a missing or corrupted blob, with the manifest that refers to it."""
    folder, sha = Path(root) / BLOBS, ref["sha256"]
    try:
        data = read_inside(folder, sha)
    except CheckpointError as err:
        raise CheckpointError(f"{err}; {manifest_path} refers to it for {what}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha or len(data) != ref["bytes"]:
        raise CheckpointError(f"{folder / sha} is corrupted: its sha256 is {digest[:12]}... "
                              f"({len(data)} bytes), its name says {sha[:12]}... "
                              f"({ref['bytes']} bytes); {manifest_path} refers to it for {what}")
    return torch.frombuffer(bytearray(data), dtype=DTYPES[ref["dtype"]]) if data else \
        torch.empty(0, dtype=DTYPES[ref["dtype"]])


def read_blobs(folder: Path, name: str, info: dict) -> dict:
    """An incremental checkpoint's rank entry read like a rank file (:func:`read_file`):
    ``{"pieces", "data", "rng"}``, every blob checked (:func:`read_blob`)."""
    where = folder / MANIFEST
    data = [read_blob(folder.parent, ref, f"{p['name']} ({p['kind']}) of {name}", where)
            for p, ref in zip(info["pieces"], info["blobs"])]
    rng = {k: read_blob(folder.parent, ref, f"the random state of {name}", where)
           for k, ref in info["rng"].items()}
    return {"pieces": info["pieces"], "data": data, "rng": rng}


def _checked_bytes(folder: Path, name: str, info: dict) -> bytes:
    """The bytes of ``folder/name`` (:func:`read_inside`) if its size and sha256 are the ones
    the manifest lists."""
    data = read_inside(folder, name)
    digest = hashlib.sha256(data).hexdigest()
    if digest != info["sha256"]:
        raise CheckpointError(f"{folder / name} is corrupted: its sha256 is {digest[:12]}..., "
                              f"the manifest says {info['sha256'][:12]}... ({len(data)} bytes, "
                              f"expected {info['bytes']})")
    return data


def _torch_reason(err: BaseException) -> str:
    """The line of a ``torch.load`` error that says what is wrong, without torch's advice to
    retry with ``weights_only=False`` (which would run the file's code)."""
    boiler = ("Weights only load failed", "Please file an issue", "Check the documentation",
              "Re-running", "In PyTorch")
    lines = [ln.strip().removeprefix("WeightsUnpickler error:").strip()
             for ln in str(err).splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(boiler)]
    return lines[0][:160] if lines else type(err).__name__


def read_file(folder: Path, name: str, info: dict) -> dict:
    """One rank's file: sha256 checked against the manifest, loaded weights-only (no code
    runs), and its pieces checked against the manifest's entry (one number per element).
    An incremental checkpoint's entry (``blobs``) is read blob by blob (:func:`read_blobs`)."""
    if RANK_KEY.fullmatch(name):  # only an incremental manifest passes such a name
        return read_blobs(folder, name, info)
    path = folder / name
    data = _checked_bytes(folder, name, info)
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 4": a foreign file
            warnings.simplefilter("ignore")
            content = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to load is one line
        raise damaged(path, "torch.load(weights_only=True) refused it: "
                            f"{_torch_reason(err)}") from None
    if not (isinstance(content, dict) and isinstance(content.get("pieces"), list)
            and isinstance(content.get("data"), list)):
        raise damaged(path, "it holds no {'pieces', 'data'}")
    if content["pieces"] != info["pieces"]:
        raise damaged(path, "its pieces differ from the ones the manifest lists for it")
    for place, t in zip(content["pieces"], content["data"], strict=False):
        lo, hi = place["flat"]
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 1
                and t.numel() == hi - lo):
            raise damaged(path, f"the data of {place['name']} ({place['kind']}) is not "
                                f"{hi - lo} floating-point numbers")
    if len(content["data"]) != len(content["pieces"]):
        raise damaged(path, f"{len(content['data'])} tensors for {len(content['pieces'])} "
                            "pieces")
    return content
