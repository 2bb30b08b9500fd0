"""Incremental checkpoints made honest: content-addressed blobs (``edu3d train --incremental``).

After reading this file you should understand what an incremental save writes, and why it
is never a chain of deltas:

* every piece of training state a rank owns (one placement of one tensor, one kind:
  :mod:`edu3d.ckpt.reshard`) is stored as its raw bytes in ``DIR/blobs/<sha256>``, the
  file named by the hash of its own content (git's objects, restic's and borg's chunks);
* a save hashes each piece; a blob already in ``blobs/`` is **reused**, not written
  (checked first: size, and the sha256 of what is on disk, once per run); only pieces whose
  bytes changed since any kept save are **written**. Each manifest lists, per rank, every
  piece with the sha256 of its blob: a complete description, so resuming reads one manifest
  and the blobs it names, never a chain;
* what changes: AdamW moves every trainable weight and both moments at every step, so with
  every parameter training *every* piece changes and an incremental save writes as much as
  a full one (plus nothing: it costs a hash). What stays: a frozen parameter
  (``--freeze``) has no optimizer state and its bytes never change, so after the first save
  it is never written again. The granularity matters: one blob per rank's whole shard would
  always change; one per tensor piece lets the frozen ones be reused;
* ``--keep-last K`` removes old manifests first, then every blob no remaining manifest
  refers to (a garbage collection, :func:`edu3d.ckpt.format.collect_blobs`); a blob two
  checkpoints share stays while either is kept. A save reads only the kept manifests, and
  each once (it knows the ones it wrote), never an older step's: what sits in an old step
  folder cannot slow a live run down. Without ``--keep-last`` no manifest is ever removed,
  so a save reads none and removes only the temporary files a killed save left (the whole
  blobs such a save finished stay until a run with ``--keep-last`` collects them);
* no "full save every K saves": with content addressing a full save would rewrite bytes
  that are already on disk under the same name, buying nothing but a second copy. What it
  buys a delta chain (a bounded chain to replay) does not exist here, and what it buys
  against a damaged blob (every checkpoint naming it is damaged) is a backup's job: copy
  the folder. ``edu3d ckpt show`` verifies every blob each checkpoint names.

Writes are atomic like every checkpoint file: a unique temporary name per writer (two ranks
may write the same blob at once: the same bytes), fsync, rename. A rank killed mid-blob
leaves a temporary file that no manifest names; the next garbage collection removes it.
Reading a blob is in :func:`edu3d.ckpt.untrusted.read_blob` (a reference is 64 hex digits,
never a path; size and sha256 checked; raw numbers, nothing unpickled).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from edu3d.ckpt.untrusted import BLOBS, DTYPES, SHA256

DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def raw_bytes(t: torch.Tensor) -> bytes:
    """A CPU tensor's numbers as bytes, in memory order (what a blob holds)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def fsync_folder(folder: Path) -> None:
    """Make a rename or an unlink in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, tmp: Path | None = None, write=None,
                 sync_folder: bool = True, what: str = "file") -> None:
    """The one place a checkpoint's bytes reach the disk: a temporary name, fsync, rename
    over ``path``, then (``sync_folder``) fsync of the folder. A reader sees the old file or
    the whole new one. ``tmp`` is the temporary's name (``path.tmp``; a blob's is unique per
    writer), ``write(f, data)`` writes the bytes (``f.write``). A failed write (a full disk)
    raises ``OSError`` naming ``path`` and removes the temporary."""
    tmp = tmp or path.with_name(path.name + ".tmp")
    try:
        tmp.unlink(missing_ok=True)  # a killed save's leftover, or a planted link
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            write(f, data) if write else f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OSError(err.errno, f"cannot write checkpoint {what} {path}: "
                      f"{err.strerror or err}") from err
    if sync_folder:
        fsync_folder(path.parent)


class BlobStore:
    """The ``blobs/`` folder of checkpoint root ``root``, as one rank writes into it."""

    def __init__(self, root, rank: int):
        self.folder = Path(root) / BLOBS
        self.rank = rank
        self.known: set[str] = set()  # blobs this process wrote or verified on disk

    def put(self, t: torch.Tensor) -> tuple[dict, bool]:
        """Store ``t``'s bytes unless a blob with them is there; returns its reference
        ``{"sha256", "bytes", "dtype"}`` and whether this call wrote it."""
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"a checkpoint blob holds {', '.join(DTYPES)}, not {t.dtype}")
        data = raw_bytes(t)
        sha = hashlib.sha256(data).hexdigest()
        ref = {"sha256": sha, "bytes": len(data), "dtype": DTYPE_NAMES[t.dtype]}
        if self._present(sha, len(data)):
            return ref, False
        self._write(sha, data)
        self.known.add(sha)
        return ref, True

    def _present(self, sha: str, size: int) -> bool:
        """Is a good copy of blob ``sha`` on disk? Its size always; its content once per run
        (a damaged one is rewritten, never reused)."""
        path = self.folder / sha
        if self.folder.is_symlink() or path.is_symlink() or not path.is_file():
            return False
        if path.stat().st_size != size:
            return False
        if sha in self.known:
            return True
        if hashlib.sha256(path.read_bytes()).hexdigest() != sha:
            return False
        self.known.add(sha)
        return True

    def _write(self, sha: str, data: bytes) -> None:
        if self.folder.is_symlink():
            raise OSError(f"{self.folder} is a symbolic link: a checkpoint's blobs are written "
                          "only into its own folder; remove the link")
        self.folder.mkdir(parents=True, exist_ok=True)
        # the folder is synced once per save (:meth:`sync`), not once per blob
        write_atomic(self.folder / sha, data, write=write_blob_data, sync_folder=False,
                     tmp=self.folder / f".{sha}.{self.rank}.{os.getpid()}.tmp", what="blob")

    def sync(self) -> None:
        """Make this save's renames in ``blobs/`` durable (once per save, not per blob)."""
        if self.folder.is_dir():
            fsync_folder(self.folder)


def write_blob_data(f, data: bytes) -> None:
    """Write a blob's bytes (one function, so a test can kill a rank halfway through)."""
    f.write(data)


def remove_unreferenced(root, referenced: set[str] | None) -> tuple[int, int]:
    """Remove every entry of ``root/blobs`` that is not a referenced blob (blobs no kept
    manifest names, temporary files a killed save left; ``referenced`` None: the temporary
    files only); returns ``(files, bytes)``. Only regular files and links are removed, never
    through a link."""
    folder = Path(root) / BLOBS
    if not folder.is_dir() or folder.is_symlink():
        return 0, 0
    files = size = 0
    for path in folder.iterdir():
        if SHA256.fullmatch(path.name) and (referenced is None or path.name in referenced):
            continue
        if path.is_symlink() or path.is_file():
            size += path.lstat().st_size
            path.unlink(missing_ok=True)
            files += 1
    if files:
        fsync_folder(folder)
    return files, size
