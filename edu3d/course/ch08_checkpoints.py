"""Chapter 08's live runs: a sharded checkpoint to look at, a rank killed and the run
recovering, a mismatched collective diagnosed, and the recovery measurement at scale.

After reading this file you should understand how the chapter's pictures are made from real
runs of ``edu3d train`` (:func:`edu3d.train.loop.run`, the same function as the command line):

* :func:`checkpointed_run` trains a few steps with ``--ckpt-dir`` and returns the newest
  manifest, which lists every rank's pieces and where they sit in the full tensors;
* :func:`recovery` runs a layout twice, once uninterrupted and once with a rank killed (or
  hung) mid-run under ``--max-restarts 1``, and returns both runs' records and the time the
  failure cost; ``python -m edu3d.course.ch08_checkpoints`` measures it at world size 8;
* :func:`mismatch` launches ranks that call different collectives and returns the launcher's
  diagnosis (what each rank was waiting in, from its flight record).
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
import time
from contextlib import redirect_stderr
from pathlib import Path

import torch

from edu3d.ckpt import format as checkpoint
from edu3d.distributed import comm, trace
from edu3d.launch import run_files, runs
from edu3d.launch.api import LaunchError, launch
from edu3d.train import loop as train
from edu3d.config.sections import Run
from edu3d.train.preflight import check_args

KEYS = ("step", "loss", "grad_norm", "lr")


def _args(**kw):
    return Run.of(**{"layers": 2, "json": True, "timeout": 300.0, **kw})


def checkpointed_run(ckpt_dir: str | Path, **layout) -> dict:
    """Train ``steps`` steps in ``layout`` (``dp=2, tp=2, zero=1`` ...) saving into
    ``ckpt_dir`` every step; returns the newest manifest and the run's folder."""
    args = _args(**{"steps": 2, "save_every": 1, **layout, "ckpt_dir": str(ckpt_dir)})
    with redirect_stderr(io.StringIO()):
        records = train.run(args, out=io.StringIO())
    manifest = checkpoint.read_manifest(ckpt_dir)
    return {"manifest": manifest, "records": records}


class _Lines(io.TextIOBase):
    """A text stream that keeps each line with the time it was written."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []
        self._rest = ""

    def write(self, text: str) -> int:
        now, parts = time.time(), (self._rest + text).split("\n")
        self._rest = parts.pop()
        self.lines += [(now, line) for line in parts]
        return len(text)


def recovery(kind: str = "kill", rank: int = 1, step: int = 3, save_every: int = 2,
             heartbeat: float = 3.0, clean: list[dict] | None = None, **layout) -> dict:
    """The same run twice: uninterrupted, then with ``rank`` failing (``kind``: exit, kill,
    hang) at ``step`` under ``--max-restarts 1``. Returns both runs' records, whether they
    are equal bit for bit, and what the failure cost:

    * ``lost_s``: the recovered run's wall time minus the uninterrupted one's;
    * ``gap_s``: from the last step finished before the failure to the first step finished
      after the restart, minus one ordinary step: detection, killing every rank, the new
      launch, loading the checkpoint and redoing the steps since it (measured inside the
      recovered run alone, so a busy machine distorts it less than ``lost_s``);
    * ``detect_s``: from the failure to the launcher's verdict.

    ``clean``: the records of an uninterrupted run of the same layout and options, if one was
    already made (it is then not run again, and ``clean_s``/``lost_s`` are None)."""
    layout = {"steps": 4, **layout}
    clean_s = None
    if clean is None:
        t0 = time.perf_counter()
        with redirect_stderr(io.StringIO()):
            clean = train.run(_args(**layout), out=io.StringIO())
        clean_s = time.perf_counter() - t0
    log, out = _Lines(), _Lines()
    with tempfile.TemporaryDirectory() as ckpt:
        args = _args(**layout, ckpt_dir=ckpt, save_every=save_every, max_restarts=1,
                     heartbeat=heartbeat, inject_fault={"rank": rank, "step": step,
                                                        "kind": kind})
        t0 = time.perf_counter()
        with redirect_stderr(log):
            recovered = train.run(args, out=out)
        recovered_s = time.perf_counter() - t0
    restarts = [(t, line) for t, line in log.lines if "restart 1 of 1" in line]
    injected = [t for t, line in log.lines if "injecting a fault" in line]
    injected += _deaths(rank, since=time.time() - recovered_s)  # a SIGKILL says nothing
    steps = [(t, json.loads(line)["step"]) for t, line in out.lines if line.startswith("{")]
    before = max((t for t, s in steps if restarts and t < restarts[0][0]), default=None)
    after = min((t for t, s in steps if restarts and t > restarts[0][0]), default=None)
    ordinary = sorted(b - a for (a, _), (b, _) in zip(steps, steps[1:]))
    gap = (after - before - ordinary[len(ordinary) // 2]
           if before is not None and after is not None and ordinary else None)
    same = ([{k: r[k] for k in KEYS} for r in recovered]
            == [{k: r[k] for k in KEYS} for r in clean])
    line = restarts[0][1] if restarts else ""
    return {"clean": clean, "recovered": recovered, "clean_s": clean_s,
            "recovered_s": recovered_s, "gap_s": gap,
            "lost_s": recovered_s - clean_s if clean_s is not None else None,
            "detect_s": restarts[0][0] - min(injected) if restarts and injected else None,
            "same": same, "restart": line, "resumed_at": _resumed_at([line])}


def _deaths(rank: int, since: float) -> list[float]:
    """When the launcher's agent saw ``rank`` die in runs started after ``since`` (wall)."""
    found = []
    for folder in runs.list_runs():
        exit_ = run_files.read_record(run_files.path(folder, "exits", rank), run_files.EXIT,
                                      ("time_ns",))
        if exit_ is None:
            continue
        died = exit_["time_ns"]
        if exit_.get("code") != 0 and died / 1e9 >= since:  # a death, not a clean end
            found.append(died / 1e9)
    return sorted(found)


def _resumed_at(restarts: list[str]) -> int:
    line = restarts[0] if restarts else ""
    marker = "the checkpoint of step "
    return int(line.split(marker)[1].split()[0]) if marker in line else 0


def async_save_run(ckpt_dir: str | Path, **layout) -> dict:
    """A short run saving every step with ``--async-save`` (default) in ``layout``; returns
    its records, trace events (the checkpointer's own ``ckpt_blocked`` and ``ckpt_write``
    beside the steps) and newest manifest."""
    args = _args(**{"steps": 4, "save_every": 1, "async_save": True, **layout,
                    "ckpt_dir": str(ckpt_dir)})
    _, mesh_layout = check_args(args)
    options = args.flat()
    run = launch(train.worker, mesh_layout.world_size, args=(options,), layout=mesh_layout,
                 echo=False, timeout=args.launch.timeout, name="async-save")
    return {"records": run.results[0], "events": run.events(),
            "manifest": checkpoint.read_manifest(ckpt_dir)}


def placements_only(manifest: dict) -> dict:
    """A manifest without its records and checksums: what the pictures need (kept small)."""
    keep = ("format", "step", "layout", "config")
    return {**{k: manifest[k] for k in keep},
            "files": {f: {"rank": i["rank"], "pieces": i["pieces"]}
                      for f, i in manifest["files"].items()}}


def mismatched(mesh) -> None:
    """Rank 0 calls all-reduce where every other rank calls broadcast (launched by
    :func:`mismatch`): each waits for a partner that is in another collective."""
    t = torch.ones(4)
    with trace.current().context(step=1):
        comm.all_reduce(t)  # all agree here
        if mesh.rank == 0:
            comm.all_reduce(t)
        else:
            comm.broadcast(t, src=1)


def mismatch(n: int = 2, heartbeat: float = 2.0) -> str:
    """The launcher's diagnosis of :func:`mismatched` (the first line of its error)."""
    try:
        launch(mismatched, n, heartbeat=heartbeat, echo=False, timeout=120)
    except LaunchError as err:
        return str(err).splitlines()[0]
    raise AssertionError("the mismatched collectives finished")


def main(argv: list[str] | None = None) -> None:
    """``python -m edu3d.course.ch08_checkpoints``: the recovery measurement at world size 8
    (dp2-tp2-pp2, ZeRO-1; rank 5 killed at step 5, checkpoints every 2 steps).
    ``python -m edu3d.course.ch08_checkpoints manifest OUT.json``: record the placements of a
    dp2-tp2-pp2 ZeRO-1 checkpoint (8 ranks) for chapter 08's resharding picture."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["manifest"]:
        with tempfile.TemporaryDirectory() as ckpt:
            got = checkpointed_run(ckpt, dp=2, tp=2, pp=2, zero=1)
        Path(argv[1]).write_text(json.dumps(placements_only(got["manifest"])) + "\n")
        return
    out = recovery("kill", rank=5, step=5, save_every=2, dp=2, tp=2, pp=2, zero=1, steps=6)
    print(json.dumps({k: out[k] for k in ("clean_s", "recovered_s", "lost_s", "gap_s",
                                          "detect_s", "same", "resumed_at", "restart")},
                     indent=1))


if __name__ == "__main__":
    main()
