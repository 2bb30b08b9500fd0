"""The grader of exercise 05 (``exercises/pp_schedule.py``): 1F1B as data, the missing 1/m, and
a schedule of the learner's own that beats 1F1B's bubble at the same memory.

After reading this file you should know what ``exercises/05_pipeline.ipynb`` runs:

* :func:`schedule_parity` (a launch target) executes per-rank compute lists with edu3d's
  pipeline engine for one step and returns the worst relative gradient error against the
  serial GPT; :func:`gradients` and :func:`loss_curves` run a one-rank pipeline in this
  process (two stages, ``m`` micro-batches) next to the serial model, with or without each
  micro-batch's loss scaled;
* the design: ``faster_schedule(pp, m)`` returns per-rank compute lists that may split a
  backward ``B`` into its input-gradient half ``I`` and its weight-gradient half ``W``.
  :func:`check_design` checks them with :func:`edu3d.schedules.check` (every dependency,
  every message, no deadlock), replays them with :func:`edu3d.schedules.simulate` (``F``,
  ``I`` and ``W`` one unit each, ``B`` two), and wants, on every pipeline of
  :data:`CASES`, a step at most as long as ZB-H1's (a third of 1F1B's bubble) while no rank
  keeps more than ``pp`` micro-batches' activations: 1F1B's memory. The lists must be the
  learner's own: a module that calls one of edu3d's schedule generators fails.
"""

from __future__ import annotations

import ast

import torch

from edu3d.config.layout import Layout
from edu3d.course import grading, unscaled_loss
from edu3d.course.ch05_pipeline_parallel import pipeline_args
from edu3d.course.targets import Cost, Target, meet
from edu3d.distributed.mesh import Mesh
from edu3d.model.gpt import GPT, config_from
from edu3d.schedules import Action, Costs, build, check, simulate, with_comms
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import train_step
from edu3d.train.optim import make_optimizer
from edu3d.train.trainer import Trainer


def small_model(layers: int, seed: int = 0):
    config = config_from("tiny", layers=layers, heads=2, d_model=32, seq=16, vocab=64)
    return config, SyntheticCorpus(config.vocab_size, config.seq_len, seed=seed)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def schedule_parity(mesh, compute: list[list[str]], m: int, layers: int = 4) -> dict:
    """Run per-rank compute lists (strings like ``"0F1"``) for one step; return this rank's
    worst relative gradient error against the serial GPT and its peak in-flight count."""
    config, corpus = small_model(layers)
    model, ref = GPT(config, seed=0), GPT(config, seed=0)
    trainer = Trainer(model, mesh, pipeline_args("1f1b", m), compute=compute)
    x, y = corpus.batch(1, m * 2)
    trainer.forward_backward(x, y)
    ref(x, y)[1].backward()
    mine = {id(p) for p in trainer.par.module.parameters()}
    refs = dict(ref.named_parameters())
    err = max(relative_error(p.grad, refs[n].grad) for n, p in model.named_parameters() if id(p) in mine)
    return {"grad_err": err, "peak_in_flight": trainer.engine.peak_in_flight}


def local_mesh():
    """A one-rank mesh for runs inside the notebook's own process (no messages needed)."""
    return Mesh(Layout(), 0, {})


def gradients(m: int = 4, microbatch_loss=None, scale_loss: bool = True, layers: int = 2,
              chunks: int = 2) -> tuple[dict, dict]:
    """``(pipeline_grads, serial_grads)`` by parameter name after one step on one batch.

    Runs in this process: one rank holding ``chunks`` stages, ``m`` micro-batches."""
    config, corpus = small_model(layers)
    model, ref = GPT(config, seed=0), GPT(config, seed=0)
    trainer = Trainer(model, local_mesh(), pipeline_args("interleaved", m, chunks),
                      microbatch_loss=microbatch_loss or (None if scale_loss else unscaled_loss))
    x, y = corpus.batch(1, m * 2)
    trainer.forward_backward(x, y)
    ref(x, y)[1].backward()
    return ({n: p.grad.clone() for n, p in model.named_parameters()},
            {n: p.grad.clone() for n, p in ref.named_parameters()})


def loss_curves(steps: int = 30, m: int = 4, optimizer: str = "adamw", scale_loss: bool = True,
                microbatch_loss=None, layers: int = 2, lr: float = 3e-3) -> dict:
    """Losses of the serial model and of a one-rank pipeline, step by step, same data.

    Uses the defaults of ``edu3d train`` (clipping at 1.0, weight decay 0.1)."""
    config, corpus = small_model(layers)
    args = pipeline_args("interleaved", m, 2, lr=lr, optimizer=optimizer)
    model, ref = GPT(config, seed=0), GPT(config, seed=0)
    trainer = Trainer(model, local_mesh(), args,
                      microbatch_loss=microbatch_loss or (None if scale_loss else unscaled_loss))
    opt = make_optimizer(ref, args)
    out = {"serial": [], "pipeline": []}
    for step in range(1, steps + 1):
        x, y = corpus.batch(step, m * 2)
        out["pipeline"].append(trainer.step(x, y, step)["loss"])
        out["serial"].append(train_step(ref, opt, x, y, step, args)["loss"])
    return out


# ---- the design: a schedule that beats 1F1B's bubble at 1F1B's memory ---------------------------
CASES = ((4, 8), (2, 4), (3, 6))  # (pp, m)
GENERATORS = ("gpipe", "one_f_one_b", "interleaved", "zb_h1", "zbv", "dualpipev", "build",
              "compute_order")
UNIT = Costs(F=1.0, B=2.0, I=1.0, W=1.0)


def own_work(module: str = "pp_schedule") -> None:
    """``AssertionError`` if the learner's module imports one of edu3d's schedule generators
    (the design is to write one, not to call one)."""
    tree = ast.parse(grading.source(module).read_text())
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) and (
            node.module or "").startswith("edu3d.schedules") else []
        if isinstance(node, ast.Attribute) and node.attr in GENERATORS and isinstance(
                node.value, ast.Name) and node.value.id in ("schedules", "actions"):
            names = [node.attr]
        used = [n for n in names if n in GENERATORS]
        assert not used, f"faster_schedule must be your own: your module uses edu3d's " \
                         f"{used[0]} (write the lists yourself)"


def cost(pp: int, m: int, lists) -> Cost:
    """Simulated units of one step, and the most micro-batches one rank keeps in flight."""
    assert isinstance(lists, (list, tuple)) and len(lists) == pp, \
        f"pp={pp}, m={m}: faster_schedule must return {pp} lists, one per rank"
    actions = [[Action.parse(a) if isinstance(a, str) else a for a in ops] for ops in lists]
    try:
        compute = with_comms(actions, pp)
        check(compute, pp, m)
        timeline = simulate(compute, pp, UNIT)
    except ValueError as err:
        raise AssertionError(f"pp={pp}, m={m}: {err}") from None
    return Cost(time=timeline.makespan, memory=max(timeline.peak_in_flight))


def target(pp: int, m: int) -> Target:
    """ZB-H1's step (edu3d's, simulated the same way) at 1F1B's memory (pp micro-batches)."""
    return Target(time=simulate(build("zb-h1", pp, m), pp, UNIT).makespan * (1 + 1e-9),
                  memory=pp)


def one_f_one_b_units(pp: int, m: int) -> float:
    return simulate(build("1f1b", pp, m), pp, UNIT).makespan


def check_design(ex) -> None:
    own_work()
    for pp, m in CASES:
        got = cost(pp, m, ex.faster_schedule(pp, m))
        assert got.memory <= pp, f"pp={pp}, m={m}: a rank keeps {got.memory:g} micro-batches " \
            f"in flight, more than 1F1B's {pp}"
        meet(f"pp={pp}, m={m} (1F1B: {one_f_one_b_units(pp, m):g} units)", got,
             target(pp, m), fmt=lambda t: f"{t:g} units")


def describe(ex, pp: int = 4, m: int = 8) -> str:
    try:
        c = cost(pp, m, ex.faster_schedule(pp, m))
    except AssertionError as why:
        return str(why)
    t = target(pp, m)
    return (f"pp={pp}, m={m}: your step {c.time:g} units (1F1B {one_f_one_b_units(pp, m):g}, "
            f"target {t.time:.0f}), at most {c.memory:g} micro-batches in flight (at most "
            f"{t.memory:g})")
