"""Chapter 08, last section: incremental checkpoints, measured (``--incremental --freeze``).

After reading this file you should know what the section's numbers are: real serial runs of
``edu3d train --incremental --save-every 1`` with three choices of frozen parameters, and,
per save, the bytes it wrote and the bytes it reused from earlier saves, read from each
checkpoint's manifest (:mod:`edu3d.ckpt.blobs`). Nothing here is estimated: the bytes are the
blobs the saves wrote. A run is serial and takes about a second; the layout does not change
what changes between saves (every layout saves the same pieces of the same tensors).
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import torch

from edu3d.ckpt.format import MANIFEST, full_state, step_dir
from edu3d.model.gpt import GPT
from edu3d.model.param_globs import matching, patterns
from edu3d.parallel.freeze import param_names
from edu3d.train.loop import run
from edu3d.config.sections import Run
from edu3d.train.preflight import model_config

CASES = {
    "every parameter trains": None,
    "embeddings frozen": "tok_emb.*,pos_emb.*",
    "embeddings + blocks 0-1 frozen": "tok_emb.*,pos_emb.*,blocks.0.*,blocks.1.*",
}


def _options(ckpt_dir, freeze, steps: int, **more):
    return Run.of(steps=steps, save_every=1, incremental=True, ckpt_dir=str(ckpt_dir),
                    freeze=freeze, json=True, **more)


def incremental_saves(freeze: str | None, steps: int = 3, root=None) -> dict:
    """One serial run saving every step with ``--incremental`` and ``--freeze freeze``:
    its records and, per save, ``{"step", "written", "reused", "bytes", "blobs",
    "blobs_written"}`` from its manifest; the run's checkpoint folder (under ``root``, a
    temporary folder by default) and how many parameters it froze."""
    root = Path(root or tempfile.mkdtemp(prefix="edu3d-incremental-"))
    ckpt = root / (freeze or "nothing").replace("*", "x").replace(",", "+")
    with contextlib.redirect_stderr(io.StringIO()):  # the run's banner: not the chapter's
        records = run(_options(ckpt, freeze, steps), out=io.StringIO())
    saves = []
    for step in range(1, steps + 1):
        manifest = json.loads((step_dir(ckpt, step) / MANIFEST).read_text())
        saves.append({"step": step, **manifest["incremental"]})
    config = model_config(_options(ckpt, freeze, steps))
    names = param_names(config)
    with torch.device("meta"):  # the sizes only
        shapes = {n: p.numel() for n, p in GPT(config).named_parameters()}
    frozen = matching(names, patterns(freeze))
    return {"freeze": freeze, "saves": saves, "records": records, "ckpt_dir": str(ckpt),
            "steps": steps, "frozen": frozen, "params": sum(shapes.values()),
            "frozen_params": sum(shapes[n] for n in frozen)}


def compare(cases: dict | None = None, steps: int = 3, root=None) -> dict[str, dict]:
    """:func:`incremental_saves` for every case ``{label: freeze globs or None}``."""
    return {label: incremental_saves(freeze, steps, root)
            for label, freeze in (cases or CASES).items()}


def resumed_equals_uninterrupted(result: dict, at: int = 2) -> bool:
    """Resume ``result``'s run from its incremental checkpoint of step ``at`` (reading
    through the references to blobs earlier saves wrote) and train to the end: are the
    records the uninterrupted run's, bit for bit?"""
    args = _options(result["ckpt_dir"], result["freeze"], result["steps"], resume_step=at)
    with contextlib.redirect_stderr(io.StringIO()):
        again = run(args, out=io.StringIO())
    key = ("step", "loss", "grad_norm", "lr")
    return [[r[k] for k in key] for r in again] == [[r[k] for k in key]
                                                    for r in result["records"]]


def frozen_unchanged(result: dict) -> bool:
    """Are the frozen parameters of the last checkpoint bitwise their initial values?"""
    _, params = full_state(result["ckpt_dir"])
    init = dict(GPT(model_config(_options("", result["freeze"], 1))).named_parameters())
    return all(torch.equal(params[n], init[n].detach()) for n in result["frozen"])


def summary(results: dict[str, dict]) -> dict[str, dict]:
    """Per case, the saves after the first (the first writes everything): mean bytes written
    and reused, and the written bytes as a share of the every-parameter run's."""
    out = {}
    base = None
    for label, res in results.items():
        later = res["saves"][1:]
        written = sum(s["written"] for s in later) / len(later)
        reused = sum(s["reused"] for s in later) / len(later)
        base = base or written
        out[label] = {"written": written, "reused": reused, "share": written / base,
                      "frozen_share": res["frozen_params"] / res["params"]}
    return out
