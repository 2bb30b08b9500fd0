"""Reading a file from a stranger in bounded memory: sizes before bytes, structure before parsing.

After reading this file you should understand why a checkpoint reader never reads a file
whole before it knows the file's size, and never hands JSON to the parser before it knows
the JSON's shape. A file is a number the filesystem will happily make up: ``truncate -s 6G``
makes a 6 GiB file in no time and no disk, and ``f.read()`` then asks for 6 GiB of memory.
So, in order:

* **the size first** (``fstat`` of the open file): a manifest is at most
  :data:`MAX_MANIFEST_BYTES`; a blob or a shard has exactly the size its manifest entry
  states, and that size agrees with its pieces' shapes, which agree with the model's config
  (:mod:`edu3d.ckpt.untrusted`). A file of another size is refused before a byte is read;
* **hashed while streaming** (:func:`stream`): a file is read in chunks of
  :data:`CHUNK` bytes into the sha256 (and, when its numbers are needed, into one buffer of
  the size already checked), so verifying a checkpoint (``edu3d ckpt show``) holds one chunk
  at a time, whatever the checkpoint's size;
* **JSON's structure before the parser** (:func:`parse_json`): a small file can still
  parse into a huge object (``[{},{},...]``: each three bytes become a 64-byte dict), nest
  deeper than the parser's recursion, or hold an integer of 5,000 digits that Python's
  ``int`` refuses to convert. The bytes are counted first, in C (``bytes.count``,
  ``bytes.translate``): at most :data:`MAX_CONTAINERS` objects and lists,
  :data:`MAX_VALUES` values and :data:`MAX_DEPTH` levels; then the parser runs, handing
  every integer to a check of at most :data:`MAX_DIGITS` digits before ``int`` sees it.

The limits are generous for what edu3d writes, and keep what parsing takes within about
200 MB whatever the JSON: a manifest holds a record per step (about 400 bytes and 10
values) and a few hundred bytes per piece, so its records stop at some 50,000 steps.
"""

from __future__ import annotations

import hashlib
import json
import os

MAX_MANIFEST_BYTES = 32 * 2**20
MAX_DEPTH = 16  # a manifest nests 6 deep (files, rank, pieces, piece, box, range)
MAX_CONTAINERS = 2**18  # objects and lists in one JSON file
MAX_VALUES = 2**19  # commas: values (and key-value pairs) in one JSON file, about
MAX_DIGITS = 32  # a JSON number edu3d writes has at most 17 significant digits and an exponent
CHUNK = 2**20  # bytes read at a time

_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")  # bytes.translate deletes these


def _depth(brackets: bytes) -> int:
    """The deepest nesting of a string of brackets only (at most ``2 * MAX_CONTAINERS``)."""
    depth = deepest = 0
    for b in brackets:
        depth += 1 if b in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _integer(text: str) -> int:
    """json's ``parse_int``: a JSON integer of at most :data:`MAX_DIGITS` digits."""
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"holds a number of {len(text.lstrip('-'))} digits (at most "
                         f"{MAX_DIGITS})")
    return int(text)


def parse_json(raw: bytearray):
    """The JSON value in ``raw`` (UTF-8, at most :data:`MAX_MANIFEST_BYTES`, checked by the
    caller before reading), once its structure is within bounds; ``ValueError`` with one line
    that says what is wrong otherwise. The counts are of the bytes as they are: a bracket or
    a comma inside a string counts too, which errs on the safe side (edu3d writes no such
    strings in bulk). ``raw`` is emptied once decoded: the parser then holds the text alone."""
    opened = raw.count(b"{") + raw.count(b"[")
    closed = raw.count(b"}") + raw.count(b"]")
    if max(opened, closed) > MAX_CONTAINERS:
        raise ValueError(f"holds {max(opened, closed):,} objects and lists (at most "
                         f"{MAX_CONTAINERS:,})")
    if raw.count(b",") > MAX_VALUES:
        raise ValueError(f"holds {raw.count(b','):,} values (at most {MAX_VALUES:,})")
    depth = _depth(raw.translate(None, _BRACKETS))
    if depth > MAX_DEPTH:
        raise ValueError(f"nests {depth} levels deep (at most {MAX_DEPTH})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"not valid JSON ({err})") from None
    raw.clear()
    try:  # digits are counted by the parser itself, before int() would refuse them
        return json.loads(text, parse_int=_integer)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err})") from None
    except ValueError:
        raise
    except RecursionError as err:  # what the scan above should have caught
        raise ValueError(f"not JSON edu3d reads ({str(err)[:80]})") from None


def stream(f, size: int, keep: bool) -> tuple[str, bytearray | None]:
    """Read the ``size`` bytes of the open file ``f`` (its size already checked) in chunks:
    ``(sha256 hex, the bytes when keep else None)``. ``ValueError`` when the file holds
    fewer (it shrank since it was checked)."""
    sha, done = hashlib.sha256(), 0
    data = bytearray(size) if keep else None
    view = memoryview(data) if keep else None
    buffer = None if keep else bytearray(min(size, CHUNK))
    while done < size:
        n = min(CHUNK, size - done)
        target = view[done:done + n] if keep else memoryview(buffer)[:n]
        got = f.readinto(target)
        if not got:
            raise ValueError(f"ends after {done} of its {size} bytes")
        sha.update(target[:got])
        done += got
    return sha.hexdigest(), data


def available_memory() -> int | None:
    """Bytes this machine can still hand out (Linux's ``MemAvailable``), or None where
    unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def file_size(f) -> int:
    """The size of the open file ``f``, from the file itself (``fstat``)."""
    return os.fstat(f.fileno()).st_size
