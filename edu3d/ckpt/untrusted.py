"""A checkpoint folder is untrusted input: what edu3d checks before it uses a byte of one.

After reading this file you should understand why a checkpoint is read like a file from a
stranger, and the checks every reader (``--resume``, ``edu3d ckpt show|export``, ``edu3d
generate``) goes through, each failure one :class:`CheckpointError` line naming the file:

* **names**: a manifest lists its files by name, and a name is a path: ``/etc/shadow`` or
  ``../other-run/step-000040/rank-00000.pt`` would read any file on the machine (with its
  sha256 in the manifest, the checksum vouches for it). Only the names edu3d writes are
  opened, ``rank-NNNNN.pt`` and ``manifest.json``, so nothing outside the step folder
  (:func:`open_inside`);
* **regular files only**: a symbolic link is refused, not followed (``O_NOFOLLOW``, and the
  step folder is no link either); a FIFO, a device or a folder is refused without blocking
  on it;
* **sizes before bytes** (:mod:`edu3d.ckpt.bounds`): a file's size comes from ``fstat``
  before a byte of it is read: a manifest of at most 32 MiB, whose JSON structure is
  counted before it is parsed (:func:`read_json`); a shard or a blob of exactly the size
  its manifest entry states; the content is hashed while it streams in;
* **the manifest's schema** (:func:`edu3d.ckpt.manifest_schema.check_manifest`): every
  field edu3d reads has its JSON type and its range, and the pieces describe the config's
  model, before any of it is used;
* **the shards**: size, then sha256, as the manifest says, then ``torch.load(weights_only=True)``
  (a pickle that would run code is refused; torch's advice to retry with
  ``weights_only=False``, which would run it, is not repeated), then its pieces checked
  against the manifest's entry (:func:`read_file`);
* **the blobs** of an incremental checkpoint (:func:`read_blob`): a reference is 64 hex digits
  naming a file of the root's ``blobs/`` folder, so it can never escape the checkpoint; the
  blob is a regular file whose size and sha256 are the reference's, read as raw numbers of an
  allowed dtype (nothing is unpickled); a missing or corrupted blob is one line naming the
  blob, the tensor and the manifest that refers to it. Verifying a checkpoint hashes each
  blob it names once, however often it is named, and keeps none of its bytes
  (:func:`check_blob`).
"""

from __future__ import annotations

import errno
import io
import os
import re
import stat
import warnings
from pathlib import Path

import torch

from edu3d.ckpt.bounds import MAX_MANIFEST_BYTES, file_size, parse_json, stream

FORMAT = "edu3d-checkpoint/1"
MANIFEST = "manifest.json"
# options that change the computation: a checkpoint continues only a run that agrees on them
MUST_MATCH = ("seed", "global_batch", "optimizer", "lr", "weight_decay", "clip", "warmup",
              "lr_schedule")
# options added later, that change the computation too: absent from an older manifest means
# the default (a checkpoint from before --freeze trained every parameter)
MUST_MATCH_LATER = {"freeze": None, "data": "synthetic"}  # --data: what edu3d generate reads
RANK_FILE = re.compile(r"rank-\d{5}\.pt")  # the only names a manifest may list
# --incremental (edu3d.ckpt.blobs): a rank's entry is a list of blobs, each named by its
# sha256 in the checkpoint root's blobs/ folder: a reference is 64 hex digits, never a path
FORMAT_BLOBS = "edu3d-checkpoint/2"
RANK_KEY = re.compile(r"rank-\d{5}")
SHA256 = re.compile(r"[0-9a-f]{64}")
BLOBS = "blobs"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "uint8": torch.uint8}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, corrupted, or of another run."""


def open_inside(folder: Path, name: str):
    """``folder/name`` opened for reading (a binary file: the caller closes it) if it is a
    file edu3d writes there: ``name`` is ``manifest.json`` or ``rank-NNNNN.pt`` (no folder
    part, so nothing outside ``folder``), or a sha256 in a ``blobs`` folder; ``folder`` is
    no symbolic link, and the file is a regular one (a link is refused, not followed:
    ``O_NOFOLLOW``; a FIFO, a device or a folder is refused without blocking on it)."""
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
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a folder
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file; refused")
    return os.fdopen(fd, "rb")


def read_inside(folder: Path, name: str, size: int | None = None,
                most: int = MAX_MANIFEST_BYTES) -> bytearray:
    """The bytes of ``folder/name`` (:func:`open_inside`), once its size is known to be
    ``size`` (when given) or at most ``most``: nothing is read from a file of another
    size."""
    with open_inside(folder, name) as f:
        n = file_size(f)
        _check_size(folder / name, n, size, most)
        try:
            return stream(f, n, keep=True)[1]
        except ValueError as err:
            raise damaged(folder / name, str(err)) from None


def _check_size(path: Path, n: int, size: int | None, most: int) -> None:
    if size is not None and n != size:
        raise damaged(path, f"it is {n:,} bytes, the manifest says {size:,}")
    if size is None and n > most:
        raise damaged(path, f"it is {n:,} bytes, more than the {most:,} such a file may be")


def read_json(folder: Path, name: str):
    """The JSON value of ``folder/name`` (a manifest): its size, then its structure
    (:func:`edu3d.ckpt.bounds.parse_json`), then parsed."""
    raw = read_inside(folder, name)
    try:
        return parse_json(raw)
    except ValueError as err:
        raise damaged(folder / name, str(err)) from None


def damaged(path: Path, what: str) -> CheckpointError:
    """The error for a file whose content is wrong: the file, what is wrong, and why."""
    return CheckpointError(f"{path}: {what}; the file is damaged or was not written by edu3d")


def _hashed(folder: Path, name: str, sha: str, size: int, keep: bool, whose: str = ""):
    """``folder/name`` checked to be ``size`` bytes whose sha256 is ``sha`` (read in chunks,
    kept when ``keep``): its bytes, or None. ``whose`` ends an error line (which manifest
    refers to the file, for what)."""
    path = folder / name
    try:
        with open_inside(folder, name) as f:
            n = file_size(f)
            if n != size:
                raise CheckpointError(f"{path} is corrupted: it is {n:,} bytes, its manifest "
                                      f"entry says {size:,}")
            digest, data = stream(f, n, keep)
    except (CheckpointError, ValueError) as err:
        raise CheckpointError(f"{err}{whose}") from None
    if digest != sha:
        raise CheckpointError(f"{path} is corrupted: its sha256 is {digest[:12]}... ({n} "
                              f"bytes), the manifest says {sha[:12]}...{whose}")
    return data


def _whose(manifest_path: Path, what: str) -> str:
    return f"; {manifest_path} refers to it for {what}"


def read_blob(root: Path, ref: dict, what: str, manifest_path: Path) -> torch.Tensor:
    """The tensor a blob reference names: ``root/blobs/<sha256>`` (only that folder: the
    name is 64 hex digits), a regular file, its size and sha256 the reference's, read as raw
    numbers of its dtype (no unpickling at all). ``what`` (the tensor) goes into the one-line
    error of a missing or corrupted blob, with the manifest that refers to it."""
    data = _hashed(Path(root) / BLOBS, ref["sha256"], ref["sha256"], ref["bytes"], True,
                   _whose(manifest_path, what))
    return torch.frombuffer(data, dtype=DTYPES[ref["dtype"]]) if data else \
        torch.empty(0, dtype=DTYPES[ref["dtype"]])


def check_blob(root: Path, ref: dict, what: str, manifest_path: Path) -> None:
    """What :func:`read_blob` checks, one chunk in memory at a time, nothing kept."""
    _hashed(Path(root) / BLOBS, ref["sha256"], ref["sha256"], ref["bytes"], False,
            _whose(manifest_path, what))


def verify_blobs(folder: Path, manifest: dict) -> None:
    """Every blob an incremental manifest (of step folder ``folder``) names, checked once
    (:func:`check_blob`), however many pieces name it."""
    seen: set[str] = set()
    for name, info in manifest["files"].items():
        named = [(ref, f"{p['name']} ({p['kind']}) of {name}")
                 for p, ref in zip(info["pieces"], info["blobs"])]
        named += [(ref, f"the random state of {name}") for ref in info["rng"].values()]
        for ref, what in named:
            if ref["sha256"] not in seen:
                check_blob(folder.parent, ref, what, folder / MANIFEST)
                seen.add(ref["sha256"])


def read_rng(folder: Path, name: str, info: dict) -> dict:
    """A rank's random state: its blobs (incremental) or its file's ``"rng"``."""
    if RANK_KEY.fullmatch(name):
        return {k: read_blob(folder.parent, ref, f"the random state of {name}",
                             folder / MANIFEST) for k, ref in info["rng"].items()}
    return read_file(folder, name, info).get("rng")


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
    """One rank's ``.pt`` file: its size, then its sha256 checked against the manifest while
    it is read, loaded weights-only (no code runs), and its pieces checked against the
    manifest's entry (one number per element)."""
    path = folder / name
    data = _hashed(folder, name, info["sha256"], info["bytes"], True)
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
