"""Live pipeline runs for the chapter, the tests and the benchmark: run schedules, keep events.

After reading this file you should know how a measured timeline is produced: every rank
builds the same model, keeps its stages, and runs a few steps of each schedule inside
``trace.current().context(step=k)``, so every engine event carries the step it belongs to.
The first step of each schedule warms up (allocations, first messages); the bubble is
measured on the later ones, as the idle share of the ranks' time between the step's first
compute start and its last compute end (:func:`edu3d.parallel.pp.simulate.bubble_of`).

Stages are balanced (equal layer counts and a light head: small vocabulary), so what the
chart shows is the schedule's bubble, not an uneven cut.
"""

from __future__ import annotations

import statistics
from argparse import Namespace

import torch

from edu3d import trace
from edu3d.data import SyntheticCorpus
from edu3d.model import GPT, config_from
from edu3d.parallel.pp.simulate import bubble_of
from edu3d.parallel.pp.trainer import PipelineTrainer


def run_schedules(mesh, runs: list[dict], *, layers: int = 4, d_model: int = 128,
                  seq: int = 64, vocab: int = 64, rows: int = 1, steps: int = 3,
                  seed: int = 0) -> list[dict]:
    """Run each ``{"name", "m", "vpp"}`` for ``steps`` forward/backward steps.

    Returns, per run, the trace step ids it used and this rank's peak in-flight micro-batches
    and peak activation bytes. Use it through :func:`edu3d.launch.launch` with a
    ``Layout(pp=P)``; read the events from the launch result.
    """
    torch.manual_seed(seed)
    rec = trace.current()
    config = config_from("tiny", layers=layers, heads=4, d_model=d_model, seq=seq, vocab=vocab)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=seed)
    args = Namespace(lr=1e-3, clip=1.0, weight_decay=0.0, optimizer="sgd", warmup=0)
    out, step_id = [], 0
    for run in runs:
        model = GPT(config, seed=seed)
        trainer = PipelineTrainer(model, mesh, run["name"], run["m"], args,
                                  vpp=run.get("vpp", 1))
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
