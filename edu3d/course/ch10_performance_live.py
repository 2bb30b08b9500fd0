"""Chapter 10 (performance and debugging), its watched run: a straggler, found live.

After reading this file you should understand the chapter's last run and how its verdict is
read: :func:`slow_rank_run` trains the tiny GPT with ``edu3d train``'s own loop on 2
data-parallel ranks, in a run folder a monitor watches (:mod:`edu3d.launch.live`), with one
rank made a straggler (``--inject-fault rank=1,kind=slow,seconds=0.2``: it sleeps before
every step, :mod:`edu3d.train.faults`). :func:`verdict` then compares what every rank
published: all ranks take as long per step (they wait for each other in the gradient
all-reduce), and the straggler is the one that spends the *least* of its step in
communication, because it is the one the others wait for.
"""

from __future__ import annotations

from pathlib import Path

from edu3d.course import lesson_args
from edu3d.config.layout import Layout
from edu3d.launch import live
from edu3d.launch.api import launch
from edu3d.train import loop
from edu3d.train.preflight import check_args


def slow_rank_run(run_dir: str | Path, slow_rank: int | None = 1, seconds: float = 0.2,
                  steps: int = 10, timeout: float = 120) -> list[dict]:
    """Train ``steps`` steps of dp2 with rank ``slow_rank`` sleeping ``seconds`` before each
    (``None``: no straggler), in ``run_dir``; returns every rank's final status record
    (:func:`edu3d.launch.live.read`)."""
    fault = (None if slow_rank is None else
             {"rank": slow_rank, "step": 1, "kind": "slow", "seconds": seconds})
    options = lesson_args(layers=2, dp=2, steps=steps, json=True, inject_fault=fault)
    check_args(options)
    launch(loop.worker, 2, args=(options.flat(),), layout=Layout(dp=2),
           run_dir=run_dir, echo=False, timeout=timeout, name="ch10-live")
    return live.read(Path(run_dir), 2)


def verdict(records: list[dict], seconds: float) -> dict:
    """What the records say: ``slowest`` (the monitor's pick), each rank's ``step_ms``,
    ``busy_ms`` and communication share of the step, and whether every rank's step took at
    least the straggler's sleep (``all_wait``: the others waited for it)."""
    by_rank = {r["rank"]: r for r in records}
    return {"slowest": live.slowest(records),
            "step_ms": {r: round(rec["step_ms"], 1) for r, rec in by_rank.items()},
            "busy_ms": {r: round(live.busy_ms(rec), 1) for r, rec in by_rank.items()},
            "comm_share": {r: live.comm_total_ms(rec) / rec["step_ms"]
                           for r, rec in by_rank.items()},
            "all_wait": all(rec["step_ms"] >= 1e3 * seconds for rec in records)}


def budget(records: list[dict]) -> dict[int, dict]:
    """Each rank's measured step as chapter 10's budget rows (ms): ``compute`` (its own work,
    the sleep included), ``exposed`` = ``comm`` (time in collectives: waiting, then moving)."""
    rows = {}
    for rec in sorted(records, key=lambda r: r["rank"]):
        comm = live.comm_total_ms(rec)
        rows[rec["rank"]] = {"compute": live.busy_ms(rec), "exposed": comm, "idle": 0.0,
                             "comm": comm, "step": rec["step_ms"]}
    return rows


def predict(records: list[dict], recorded_rank: int | None, recorded_seconds: float,
            slow_rank: int | None, seconds: float) -> dict[int, dict]:
    """A straggler's effect predicted from a recorded run (made with ``recorded_rank``
    sleeping ``recorded_seconds``): every rank's own work is what it measured less the sleep
    it was given; the all-reduce's transfer is the least any rank spent in communication (the
    straggler's: nobody left to wait for). With rank ``slow_rank`` sleeping ``seconds``, the
    step is the slowest rank's work plus that transfer, and every other rank waits out the
    difference in its all-reduce."""
    measured = budget(records)
    sleep = {r: 1e3 * recorded_seconds if r == recorded_rank else 0.0 for r in measured}
    work = {r: b["compute"] - sleep[r] for r, b in measured.items()}
    transfer = min(b["comm"] for b in measured.values())
    busy = {r: work[r] + (1e3 * seconds if r == slow_rank else 0.0) for r in work}
    step = max(busy.values()) + transfer
    return {r: {"compute": busy[r], "exposed": step - busy[r], "idle": 0.0,
                "comm": step - busy[r], "step": step} for r in busy}
