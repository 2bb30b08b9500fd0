"""Live pipeline runs for the chapter, the tests and the benchmark: run schedules, keep events.

After reading this file you should know how a measured timeline is produced: every rank
builds the same model, keeps its stages, and runs a few steps of each schedule inside
``trace.current().context(step=k)``, so every engine event carries the step it belongs to.
The first step of each schedule warms up (allocations, first messages); the bubble is
measured on the later ones, as the idle share of the ranks' time between the step's first
compute start and its last compute end (:func:`edu3d.schedules.simulate.bubble_of`).

Stages are balanced (equal layer counts and a light head: small vocabulary), so what the
chart shows is the schedule's bubble, not an uneven cut.

The chapter's panel: :func:`pp_problem` says why a schedule setting cannot be drawn or run,
:func:`pp_bubble_curve` gives the formula and the simulation over the number of
micro-batches, and :func:`pp_run_kwargs` the live run of :func:`run_schedules` that "run it"
makes.
"""

from __future__ import annotations

import statistics
import time
from functools import lru_cache

import torch

from edu3d.course import lesson_args
from edu3d.distributed import trace
from edu3d.model.gpt import GPT, config_from
from edu3d.parallel.pp.engine import PipelineEngine
from edu3d.schedules.actions import build, chunks, placement, stages_of
from edu3d.schedules.simulate import Costs, bubble_formula, bubble_of, simulate
from edu3d.train.data import SyntheticCorpus
from edu3d.train.trainer import Trainer


def pipeline_args(schedule: str, m: int, vpp: int = 1, **overrides):
    """``edu3d train``'s options for a pipeline run of ``schedule`` with ``m`` micro-batches."""
    return lesson_args(schedule=schedule, microbatches=m, vpp=vpp, **overrides)


def run_schedules(mesh, runs: list[dict], *, layers: int = 4, d_model: int = 128,
                  seq: int = 64, vocab: int = 64, rows: int = 1, steps: int = 3,
                  seed: int = 0) -> list[dict]:
    """Run each ``{"name", "m", "vpp"}`` for ``steps`` forward/backward steps.

    Returns, per run, the trace step ids it used and this rank's peak in-flight micro-batches
    and peak activation bytes. Use it through :func:`edu3d.launch.api.launch` with a
    ``Layout(pp=P)``; read the events from the launch result.
    """
    torch.manual_seed(seed)
    rec = trace.current()
    config = config_from("tiny", layers=layers, heads=4, d_model=d_model, seq=seq, vocab=vocab)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=seed)
    out, step_id = [], 0
    for run in runs:
        model = GPT(config, seed=seed)
        args = pipeline_args(run["name"], run["m"], run.get("vpp", 1), lr=1e-3,
                              weight_decay=0.0, optimizer="sgd")
        trainer = Trainer(model, mesh, args)
        x, y = corpus.batch(1, run["m"] * rows * mesh.size("dp"))
        ids = []
        for _ in range(steps):
            with rec.context(step=step_id):
                trainer.forward_backward(x, y)
            ids.append(step_id)
            step_id += 1
        out.append({**run, "steps": ids, "peak_in_flight": trainer.engine.peak_in_flight,
                    "peak_activation_bytes": trainer.engine.peak_activation_bytes})
    return out


def measured_bubbles(events: list[dict], steps: list[int]) -> list[float]:
    """The bubble fraction of each of ``steps`` (all ranks' compute events of that step)."""
    return [bubble_of([e for e in events if e.get("step") == s and e["lane"] == "compute"])
            for s in steps]


def measured_bubble(events: list[dict], steps: list[int]) -> float:
    """Median bubble fraction over ``steps`` after the first (warm-up) one."""
    return statistics.median(measured_bubbles(events, steps[1:] or steps))


def replay_bubble(events: list[dict], step: int, name: str, pp: int, m: int,
                  vpp: int = 1) -> float:
    """The bubble the schedule would have with exactly the compute times measured in
    ``step`` and nothing between actions (no message latency, no Python overhead).

    measured - replay = what the engine and the messages add; replay - formula = what
    unequal action times add (uneven stages, or a busy machine slowing some actions)."""
    durations = {(e["stage"], e["op"], e["mb"]): e["t1"] - e["t0"] for e in events
                 if e.get("step") == step and e["lane"] == "compute"}
    return simulate(build(name, pp, m, vpp), pp, Costs(measured=durations)).bubble


# ---- stages of known cost: the schedule's own bubble, without CPU contention -------------------
class _Wait(torch.autograd.Function):
    """Identity that takes ``f`` seconds forward and ``b`` seconds backward (sleeping, so two
    ranks on a shared CPU do not slow each other down)."""

    @staticmethod
    def forward(ctx, x, f: float, b: float):
        time.sleep(f)
        ctx.b = b
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.b)
        return grad, None, None


class TimedStage(torch.nn.Module):
    """A pipeline stage whose forward lasts ``f`` s and backward ``b`` s (one tiny weight so
    gradients really flow), ``w`` s of which belong to the weight's gradient: a split
    backward spends ``b - w`` in ``I`` and ``w`` in ``W``. Same interface as
    :class:`~edu3d.parallel.pp.stage.PipelineStage`.
    """

    def __init__(self, f: float, b: float, is_first: bool, is_last: bool, width: int = 16,
                 w: float = 0.0):
        super().__init__()
        self.f, self.b, self.w, self.is_first, self.is_last = f, b, w, is_first, is_last
        self.weight = torch.nn.Parameter(torch.ones(width))

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return idx.float().unsqueeze(-1) * self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the weight's own path carries the W wait: autograd runs it only for the weight
        return _Wait.apply(x, self.f, self.b - self.w) * _Wait.apply(self.weight, 0.0, self.w)

    def body_parameters(self):
        return [self.weight]

    @staticmethod
    def loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return out.mean()


def run_timed(mesh, runs: list[dict], *, f_ms: float = 4.0, b_ms: float = 8.0,
              steps: int = 3, w_ms: float = 0.0) -> list[dict]:
    """Like :func:`run_schedules`, with :class:`TimedStage` stages of fixed cost.

    The engine, the schedule and the messages are real; only the compute is a wait of known
    length, so the measured bubble is the schedule's (plus message latency and overhead),
    not the machine's other processes. Backward-split schedules (ZB-H1, ZBV, DualPipeV) put
    ``w_ms`` of the backward into ``W`` and the rest into ``I`` (``w_ms = 0``: all in ``I``).
    A schedule with ``v`` chunks per rank gives each chunk ``1/v`` of every time.
    """
    rec = trace.current()
    pp, rank = mesh.size("pp"), mesh.index("pp")
    out, step_id = [], 0
    for run in runs:
        v = chunks(run["name"], run.get("vpp", 1))
        n = pp * v
        style = placement(run["name"])
        stages = {s: TimedStage(f_ms / 1e3 / v, b_ms / 1e3 / v, s == 0, s == n - 1,
                                w=w_ms / 1e3 / v) for s in stages_of(rank, pp, n, style)}
        engine = PipelineEngine(stages, build(run["name"], pp, run["m"], v)[rank], n,
                                mesh.ranks("pp"), mesh.pp, run["m"], placement=style)
        batch = [(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
                 for _ in range(run["m"])]
        ids = []
        for _ in range(steps):
            with rec.context(step=step_id):
                engine.run(batch)
            ids.append(step_id)
            step_id += 1
        out.append({**run, "steps": ids, "peak_in_flight": engine.peak_in_flight})
    return out


# ---- the chapter's panel ------------------------------------------------------------------------
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")


def pp_problem(schedule: str, pp: int, m: int, vpp: int) -> str | None:
    """Why ``schedule`` with ``pp`` ranks, ``m`` micro-batches and ``vpp`` chunks per rank
    cannot be drawn (None if it can)."""
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}"
    if pp < 1 or m < 1 or vpp < 1:
        return "pp, micro-batches and vpp must be at least 1"
    if vpp > 1 and schedule != "interleaved":
        return (f"vpp = {vpp} chunks per rank needs the interleaved schedule: {schedule} "
                f"runs {chunks(schedule, 1)} chunk(s) per rank, its own (set vpp = 1, or "
                "choose interleaved)")
    if schedule == "interleaved" and vpp == 1:
        return ("interleaved with vpp = 1 is plain 1F1B: give each rank at least 2 chunks "
                "(vpp >= 2)")
    if schedule == "interleaved" and m % pp:
        return (f"interleaved sends micro-batches through the chunks in groups of pp: "
                f"m = {m} must be a multiple of pp = {pp} (try m = {pp * max(1, m // pp)})")

    try:  # the generators' own limits (ZB-H1 groups its micro-batches like interleaving)
        build(schedule, pp, m, vpp)
    except ValueError as err:
        return f"{schedule} with pp = {pp}, m = {m} cannot be built ({err})"
    return None


def pp_run_problem(schedule: str, pp: int, m: int, vpp: int, max_ranks: int = 8) -> str | None:
    """Why the live run of that setting cannot go (None if it can)."""
    bad = pp_problem(schedule, pp, m, vpp)
    if bad:
        return bad
    if pp > max_ranks:
        return f"the live run is limited to {max_ranks} ranks on this machine (pp = {pp})"
    return None


def pp_run_kwargs(schedule: str, pp: int, m: int, vpp: int, steps: int = 2) -> dict:
    """Options of :func:`edu3d.course.ch05_pipeline_parallel.run_schedules` for one schedule: one layer per
    global stage (at least 4; a V-shaped schedule has two per rank), chapter 05's sizes (d = 128, s = 64, 2 rows per micro-batch),
    so compute, not message overhead, fills most of a step."""
    return {"layers": max(4, pp * chunks(schedule, vpp)), "d_model": 128, "seq": 64, "rows": 2, "steps": steps}


@lru_cache(maxsize=256)
def pp_bubble_curve(schedule: str, pp: int, vpp: int, ms: tuple, p2p: float = 0.0) -> dict:
    """Bubble fraction for each m in ``ms``: the formula and the simulation (F = 1, B = 2,
    I = W = 1, ``p2p`` per message in the same unit); settings that cannot run are left
    out."""
    out = {"m": [], "formula": [], "simulated": [], "p2p": p2p}
    for m in ms:  # a tuple, so the curve is computed once per setting
        if pp_problem(schedule, pp, m, vpp):
            continue
        sim = simulate(build(schedule, pp, m, vpp), pp, Costs(F=1, B=2, I=1, W=1, p2p=p2p))
        out["m"].append(m)
        out["formula"].append(bubble_formula(schedule, pp, m, vpp))
        out["simulated"].append(sim.bubble)
    return out
