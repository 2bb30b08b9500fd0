"""Real text as training data: bytes as tokens, a corpus prepared once and memory-mapped.

After reading this file you should understand:

* **byte-level tokens**: the tokens of a text are its UTF-8 bytes, a vocabulary of 256 with
  nothing to download and no unknown token (GPT-2's BPE starts from the same bytes, then merges
  frequent pairs; edu3d stops before the merges). An ASCII character is one token, an ``é``
  two, an emoji four; :func:`decode` joins the bytes back and marks a character cut in half
  with U+FFFD;
* **prepare, then memory-map** (nanoGPT's ``prepare.py`` and ``np.memmap``): the source is read
  once, checked (every file must be UTF-8), and its tokens written to one file of ``uint8``
  (:func:`prepare`), cached by the sources' names, sizes and modification times. Every rank
  then *maps* that file: the operating system reads in only the pages a batch touches, so a
  corpus of many gigabytes costs no memory;
* **batches that do not depend on the layout**: global batch ``step`` is ``global_batch``
  windows of ``seq_len + 1`` tokens, at offsets drawn from ``(seed, step, global_batch)``
  alone (:meth:`TextCorpus.batch`), as the synthetic corpus's walks are: every layout trains on
  the same tokens, and a data-parallel rank takes its rows;
* the sources: ``--data text:PATH`` (a UTF-8 file, or a folder: every file under it, hidden
  ones left out, in name order) and ``--data stdlib``, a real corpus every machine already has:
  the Python standard library's own sources (about 11 MB of code and docstrings for Python
  3.11, its tests left out), so a model can learn to write Python offline.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edu3d.train.data import stream_seed

VOCAB = 256  # one token per byte value
STDLIB = "stdlib"
STDLIB_SKIPS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib",
                          "__pycache__"})  # the standard library's tests, installed packages
SEPARATOR = b"\n\n"  # between two files of a folder
CHUNK = 1 << 24  # bytes read (and checked) at a time


def encode(text: str) -> list[int]:
    """``"déf"`` -> ``[100, 195, 169, 102]``: the UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(tokens) -> str:
    """Token ids (bytes) back to text; an incomplete character becomes U+FFFD."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def is_text(data: str) -> bool:
    """Whether ``--data`` names real text (``stdlib`` or ``text:PATH``), not the synthetic
    corpus."""
    return data == STDLIB or data.startswith("text:")


def sources(data: str) -> tuple[Path, list[Path]]:
    """The root and the files of ``--data`` (``stdlib`` or ``text:PATH``), in order; raises
    ``ValueError`` saying what to give instead."""
    if data == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in _walk(root, STDLIB_SKIPS) if p.suffix == ".py"]
        return root, files
    if not data.startswith("text:") or not data[5:]:
        raise ValueError(f"--data {data!r}: choose synthetic, stdlib (the Python standard "
                         "library's sources) or text:PATH (a UTF-8 file or a folder of them)")
    root = Path(data[5:]).expanduser()
    if root.is_file():
        return root.parent, [root]
    if not root.is_dir():
        raise ValueError(f"--data {data}: no such file or folder")
    files = _walk(root)
    if not files:
        raise ValueError(f"--data {data}: the folder holds no file (hidden ones are left out)")
    return root, files


def _walk(root: Path, skip=frozenset()) -> list[Path]:
    """Every regular file under ``root`` in name order, hidden files and folders and the
    folders named in ``skip`` left out."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in skip)
        out += [Path(folder) / f for f in sorted(files) if not f.startswith(".")
                and (Path(folder) / f).is_file()]
    return out


def cache_dir() -> Path:
    """Where prepared token files live: ``$EDU3D_DATA``, default ``~/.cache/edu3d/text``."""
    return Path(os.environ.get("EDU3D_DATA") or Path.home() / ".cache" / "edu3d" / "text")


@dataclass
class Prepared:
    """A prepared corpus: its token ``path``, ``tokens`` in it, the ``files`` read and the
    ones ``skipped`` (not UTF-8; only the standard library's are skipped, a user's refused)."""

    path: Path
    tokens: int
    files: int
    skipped: int


def prepare(data: str, min_tokens: int = 2) -> Prepared:
    """The token file of ``--data``, written once (cached by the sources' names, sizes and
    modification times; written to a temporary name, then renamed, so ranks preparing the
    same corpus at once cannot see half a file). Raises ``ValueError`` when a file is not
    UTF-8 or the corpus has fewer than ``min_tokens`` tokens."""
    root, files = sources(data)
    stats = [(str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha256(repr((data == STDLIB, str(root.resolve()), stats)).encode())
    path = cache_dir() / f"{key.hexdigest()[:20]}.u8"
    meta = path.with_suffix(".txt")
    if not (path.exists() and meta.exists()):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        skipped = 0
        with open(tmp, "wb") as out:
            for f in files:
                start = out.tell()
                try:
                    _copy_checked(f, out, SEPARATOR if start else b"")
                except ValueError:
                    if data != STDLIB:
                        out.close()
                        tmp.unlink()
                        raise
                    out.seek(start)
                    out.truncate()
                    skipped += 1
        os.replace(tmp, path)
        meta.write_text(f"{len(files) - skipped} {skipped}\n")
    kept, skipped = map(int, meta.read_text().split())
    tokens = path.stat().st_size
    if tokens < min_tokens:
        raise ValueError(f"--data {data} holds {tokens} tokens (bytes), fewer than one "
                         f"sequence of {min_tokens}: give a longer text or a shorter --seq")
    return Prepared(path, tokens, kept, skipped)


def _copy_checked(path: Path, out, before: bytes) -> None:
    """Append ``before`` and the bytes of ``path`` to ``out``, a chunk at a time, each
    checked to be UTF-8 (a character may span two chunks); raises ``ValueError`` naming the
    file and the first bad byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    out.write(before)
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:  # err.object: the bytes held back, then chunk
                at = offset - (len(err.object) - len(chunk)) + err.start
                raise ValueError(f"{path} is not UTF-8 text (byte 0x{err.object[err.start]:02x} "
                                 f"at offset {at}): convert it (iconv -t UTF-8) or leave it "
                                 "out") from None
            out.write(chunk)
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text (it ends inside a character): convert it "
                         "(iconv -t UTF-8) or leave it out") from None


class TextCorpus:
    """Windows of a prepared text, ``seq_len + 1`` tokens each (the model reads ``seq_len``,
    the targets are the same shifted by one). Has the synthetic corpus's interface:
    :meth:`batch`, ``vocab_size``, ``seq_len`` and :meth:`entropy_floor` (unknown: None)."""

    def __init__(self, data: str, seq_len: int, seed: int = 0):
        self.data, self.seq_len, self.seed, self.vocab_size = data, seq_len, seed, VOCAB
        self.prepared = prepare(data, seq_len + 1)
        self.tokens = np.memmap(self.prepared.path, dtype=np.uint8, mode="r")

    def entropy_floor(self) -> None:
        """Real text's best possible loss is not known (the synthetic corpus's is)."""
        return None

    def batch(self, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` int64 ``[global_batch, seq_len]``: windows at offsets drawn from
        ``(seed, step, global_batch)`` alone, ``y`` is ``x`` shifted left by one."""
        g = torch.Generator().manual_seed(stream_seed(self.seed, "text", step, global_batch))
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (global_batch,),
                               generator=g).tolist()
        rows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])
        tokens = torch.from_numpy(rows.astype(np.int64))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def check_data(run, config) -> Prepared | None:
    """``--data``'s rules, before any rank starts: a source that exists, is UTF-8 and holds
    one sequence; byte tokens (vocabulary 256); equal windows (``--batching fixed``). Prepares
    the token file (a cache hit after the first time); None for the synthetic corpus."""
    data = run.batch.data
    if data == "synthetic":
        return None
    if not is_text(data):
        sources(data)  # raises: what --data takes
    if config.vocab_size != VOCAB:
        raise ValueError(f"--data {data} trains on bytes, a vocabulary of {VOCAB}: drop --vocab "
                         f"{config.vocab_size} (or give --vocab {VOCAB})")
    if run.batch.batching != "fixed":
        raise ValueError(f"--data {data} cuts the text into windows of --seq tokens: use "
                         f"--batching fixed, not {run.batch.batching} (the documents of the "
                         "other modes are synthetic)")
    return prepare(data, config.seq_len + 1)
