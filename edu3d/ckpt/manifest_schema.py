"""A checkpoint's manifest, checked field by field before any of it is used.

After reading this file you should understand what a manifest may say, and why each number
in it has a range rather than a type alone (:func:`check_manifest`):

* **every field has its JSON type and its range**: a ``step`` that is the folder's, a
  ``steps`` not below it, an ``optimizer_step`` from 0 to ``step`` (a negative one once
  reached AdamW's bias correction as a complex number), a layout of at most
  :data:`MAX_RANKS` ranks, a precision whose scale is a finite number above 0, options that
  are plain values. A number out of range is one line naming the field;
* **the config describes a model** (:class:`~edu3d.model.gpt.GPTConfig`, whose fields are
  bounded before any arithmetic: :mod:`edu3d.model.config_schema`), and that model fixes
  every parameter's name and shape (:func:`~edu3d.model.config_schema.param_shapes`);
* **the pieces describe that model** (:func:`check_pieces`): a piece names one of its
  parameters with that parameter's shape, a known kind, a box inside the shape and a flat
  range inside the box; the pieces of one tensor and kind together hold exactly its
  elements (each number has one writer), and every parameter has its pieces. So the bytes a
  manifest can ask a reader to read or allocate are the model's, never more: a shape of
  20000x20000 (or 2^70) on a 64-wide model, or one blob listed 10,000 times, is refused
  here, before a file is opened;
* **each piece's bytes agree with its shape**: a blob reference's size is its piece's
  element count times its dtype's size; a shard file's size is bounded by its pieces'
  (:func:`shard_bytes_limit`); the files' sizes are then checked against these numbers
  before a byte is read (:mod:`edu3d.ckpt.untrusted`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from edu3d.ckpt.untrusted import (DTYPES, FORMAT, FORMAT_BLOBS, MUST_MATCH, RANK_FILE,
                                  RANK_KEY, SHA256, CheckpointError, damaged)
from edu3d.model.config_schema import param_shapes
from edu3d.model.gpt import GPTConfig

# the manifest's fields and their JSON types (int: a JSON integer, never true/false)
SCHEMA = {"step": int, "steps": int, "files": dict, "config": dict, "options": dict,
          "layout": dict, "optimizer_step": int, "precision": dict, "records": list,
          "data_position": str}
MAX_STEP = 10**9  # edu3d train's --steps ceiling
MAX_RANKS = 2**20  # ranks of one run, every node together
MAX_PIECES = 2**18  # pieces in one manifest, every rank's
MAX_TEXT = 1000  # characters of a string field (an option, the data position)
KINDS = ("param", "exp_avg", "exp_avg_sq")  # a parameter and AdamW's two moments
PRECISIONS = ("fp32", "bf16", "fp16")
MAX_RNG_BYTES = 2**20  # a random state: torch's is 5,056 bytes


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _within(v, low: int, high: int) -> bool:
    return is_int(v) and low <= v <= high


def _plain(v) -> bool:
    """A JSON scalar edu3d can compare and print: null, a boolean, a finite number, a short
    string."""
    if isinstance(v, float):
        return math.isfinite(v)
    return v is None or isinstance(v, (bool, int)) or (isinstance(v, str) and len(v) <= MAX_TEXT)


def _clip(value) -> str:
    return json.dumps(value)[:80]


def check_manifest(manifest, path: Path, step: int) -> dict:
    """``manifest`` (parsed from ``path``, the folder of ``step``) if every field edu3d reads
    has its type, its range and its sense; else one :class:`CheckpointError` line naming
    the field."""
    if not isinstance(manifest, dict):
        raise damaged(path, f"holds a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") not in (FORMAT, FORMAT_BLOBS):
        raise damaged(path, f"format {_clip(manifest.get('format'))}, expected {FORMAT!r} or "
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
    _check_numbers(manifest, path)
    try:
        config = GPTConfig(**manifest["config"])
    except (TypeError, ValueError) as err:
        raise damaged(path, f"'config' is no model: {str(err)[:200]}") from None
    if len(manifest["records"]) != step or not all(isinstance(r, dict)
                                                   for r in manifest["records"]):
        raise damaged(path, f"'records' holds {len(manifest['records'])} entries, not one "
                            f"object per step up to {step}")
    check_pieces(manifest, path, param_shapes(config))
    return manifest


def _check_numbers(manifest: dict, path: Path) -> None:
    """The ranges of the manifest's numbers and plain fields."""
    step, lay, prec = manifest["step"], manifest["layout"], manifest["precision"]
    if not _within(step, 1, MAX_STEP) or not _within(manifest["steps"], step, MAX_STEP):
        raise damaged(path, f"'step' {step} and 'steps' {_clip(manifest['steps'])} are not "
                            f"1 <= step <= steps <= {MAX_STEP:,}")
    if not _within(manifest["optimizer_step"], 0, step):
        raise damaged(path, f"'optimizer_step' is {_clip(manifest['optimizer_step'])}: the "
                            f"optimizer's updates are 0 to the step, {step}")
    if not (all(_within(lay.get(k), 1, MAX_RANKS) for k in ("dp", "tp", "pp", "vpp",
                                                            "world_size"))
            and all(_plain(v) for v in lay.values())):
        raise damaged(path, f"'layout' {_clip(lay)} lacks dp, tp, pp, vpp, world_size "
                            f"(each 1 to {MAX_RANKS:,})")
    scale = prec.get("scale")
    if not (prec.get("mode") in PRECISIONS and isinstance(scale, (int, float))
            and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0
            and _within(prec.get("good_steps"), 0, MAX_STEP)
            and _within(prec.get("skipped"), 0, step)):
        raise damaged(path, f"'precision' {_clip(prec)} lacks mode ({', '.join(PRECISIONS)}), "
                            "scale (finite, > 0), good_steps, skipped (0 to the step)")
    missing = [k for k in MUST_MATCH if k not in manifest["options"]]
    if missing:
        raise damaged(path, f"'options' lacks {', '.join(missing)}")
    bad = [k for k, v in manifest["options"].items() if not _plain(v) or len(k) > 40]
    if bad:
        raise damaged(path, f"'options' {_clip(bad[0])} is not a plain value (a number, a "
                            f"string of at most {MAX_TEXT} characters, true, false, null)")
    if len(manifest["data_position"]) > MAX_TEXT:
        raise damaged(path, f"'data_position' is {len(manifest['data_position'])} characters")


def _check_piece(where: Path, name: str, p, shapes: dict) -> None:
    """One placement (:mod:`edu3d.ckpt.reshard`): a parameter of the model with its shape, a
    known kind, a box inside the shape, a flat range inside the box."""
    ok = (isinstance(p, dict) and isinstance(p.get("name"), str) and p.get("kind") in KINDS
          and isinstance(p.get("box"), list) and isinstance(p.get("flat"), list))
    if ok and (p["name"] not in shapes or list(shapes[p["name"]]) != p.get("shape")):
        raise damaged(where, f"a piece of {name} is of {_clip(p['name'])} with shape "
                             f"{_clip(p.get('shape'))}: the config's model has "
                             + (f"shape {list(shapes[p['name']])}" if p["name"] in shapes
                                else "no such parameter"))
    ok = ok and len(p["box"]) == len(p["shape"])
    ok = ok and all(isinstance(r, list) and len(r) == 2 and all(map(is_int, r))
                    and 0 <= r[0] < r[1] <= d for r, d in zip(p["box"], p["shape"]))
    ok = ok and len(p["flat"]) == 2 and all(map(is_int, p["flat"])) and \
        0 <= p["flat"][0] < p["flat"][1] <= math.prod(b - a for a, b in p["box"])
    if not ok:
        raise damaged(where, f"a piece of {name} is not a placement (name, kind, shape, box, "
                             f"flat inside one another): {_clip(p)}")


def check_pieces(manifest: dict, path: Path, shapes: dict) -> None:
    """Every rank's entry, its pieces (each a placement of the model ``shapes`` describes),
    and their total: each tensor and kind covered exactly once, every parameter saved."""
    files, world = manifest["files"], manifest["layout"]["world_size"]
    if not files:
        raise damaged(path, "'files' lists no file")
    if len(files) > world:
        raise damaged(path, f"'files' lists {len(files)} entries for {world} ranks")
    if not all(isinstance(info, dict) and isinstance(info.get("pieces"), list)
               for info in files.values()):
        raise damaged(path, "an entry of 'files' has no list of 'pieces'")
    count = sum(len(info["pieces"]) for info in files.values())
    if count > MAX_PIECES:
        raise damaged(path, f"lists {count:,} pieces (at most {MAX_PIECES:,})")
    blobs = manifest["format"] == FORMAT_BLOBS
    covered: dict = {}
    for name, info in files.items():
        _check_entry(path, name, info, world, blobs)
        for i, p in enumerate(info["pieces"]):
            _check_piece(path, name, p, shapes)
            if blobs:
                _check_blob_of(path, name, p, info["blobs"][i])
            key = (p["name"], p["kind"])
            covered[key] = covered.get(key, 0) + p["flat"][1] - p["flat"][0]
    for (tensor, kind), n in covered.items():
        if n != math.prod(shapes[tensor]):
            raise damaged(path, f"the pieces of {tensor} ({kind}) hold {n:,} numbers, its "
                                f"shape {list(shapes[tensor])} holds "
                                f"{math.prod(shapes[tensor]):,}")
    missing = [t for t in shapes if (t, "param") not in covered]
    if missing:
        raise damaged(path, f"no piece holds {missing[0]}" + (f" (nor {len(missing) - 1} more "
                                                               "parameters)" if missing[1:]
                                                               else ""))


def _check_entry(path: Path, name: str, info: dict, world: int, blobs: bool) -> None:
    """A rank's entry: ``rank-R.pt`` with its sha256, size and pieces, or (incremental)
    ``rank-R`` with one blob reference per piece, its random state's blobs and the blobs
    its save wrote."""
    if not (RANK_KEY if blobs else RANK_FILE).fullmatch(name):
        raise CheckpointError(f"{path} lists {name!r}: not a file edu3d writes "
                              "(rank-NNNNN.pt in the checkpoint's own folder); refused")
    if not (_within(info.get("rank"), 0, world - 1)
            and name == f"rank-{info['rank']:05d}" + ("" if blobs else ".pt")):
        raise damaged(path, f"the entry {name!r} names rank {_clip(info.get('rank'))}, not "
                            f"its own (0 to {world - 1})")
    if not blobs:
        limit = shard_bytes_limit(info["pieces"])
        if not (isinstance(info.get("sha256"), str) and SHA256.fullmatch(info["sha256"])
                and _within(info.get("bytes"), 0, limit)):
            raise damaged(path, f"the entry of {name} is not {{rank, sha256, bytes, pieces}} "
                                f"with bytes 0 to {limit:,} (what its pieces can take)")
        return
    refs = info.get("blobs")
    rng = info.get("rng")
    ok = (isinstance(refs, list) and len(refs) == len(info["pieces"]) and all(map(is_ref, refs))
          and isinstance(rng, dict) and 1 <= len(rng) <= 4
          and all(len(k) <= 20 and is_ref(r) and r["dtype"] == "uint8"
                  and r["bytes"] <= MAX_RNG_BYTES for k, r in rng.items()))
    if not ok:
        raise damaged(path, f"the entry {name!r} is not {{rank, pieces, blobs (one sha256 "
                            "reference per piece), rng}")
    written, named = info.get("written"), {r["sha256"] for r in [*refs, *rng.values()]}
    if not (isinstance(written, list) and len(written) <= len(named)
            and all(isinstance(s, str) and s in named for s in written)):
        raise damaged(path, f"the entry {name!r}: 'written' is {_clip(written)}, not a list of "
                            "the sha256 of blobs it refers to")


def is_ref(ref) -> bool:
    """A blob reference: ``{"sha256": 64 hex digits, "bytes": n >= 0, "dtype": known}``."""
    return (isinstance(ref, dict) and isinstance(ref.get("sha256"), str)
            and bool(SHA256.fullmatch(ref["sha256"])) and _within(ref.get("bytes"), 0, 2**48)
            and ref.get("dtype") in DTYPES)


def _check_blob_of(path: Path, name: str, p: dict, ref: dict) -> None:
    """A piece's blob holds its numbers: floating-point, as many bytes as the piece's
    elements take."""
    if ref["dtype"] == "uint8":
        raise damaged(path, f"{name}: {p['name']} ({p['kind']}) is not floating-point")
    if ref["bytes"] != (p["flat"][1] - p["flat"][0]) * DTYPES[ref["dtype"]].itemsize:
        raise damaged(path, f"{name}: the blob of {p['name']} ({p['kind']}) holds "
                            f"{ref['bytes']} bytes, not its piece's")


def shard_bytes_limit(pieces: list) -> int:
    """The most bytes a rank's ``.pt`` file of these pieces can take: 8 per number (float64
    at most), a random state, and the pickled placements and archive entries."""
    numbers = sum(p["flat"][1] - p["flat"][0] for p in pieces if isinstance(p, dict)
                  and isinstance(p.get("flat"), list) and len(p["flat"]) == 2
                  and all(map(is_int, p["flat"])))
    return 8 * numbers + MAX_RNG_BYTES + 4096 * (len(pieces) + 1)
