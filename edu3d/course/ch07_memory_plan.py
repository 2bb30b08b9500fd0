"""Chapter 07's planner glue: measure a layout's bytes per rank, and predict them.

After reading this file you should know where the chapter's "measured" bars come from:

* :func:`measure` is a launch target: every rank builds the library's
  :class:`~edu3d.train.trainer.Trainer` for ``edu3d train``'s options, takes one AdamW step, and
  returns what it holds afterwards (weights, gradients, optimizer state, counted by storage:
  :func:`edu3d.distributed.meter.measure`) and the peak of the activations its pipeline engine kept
  during the step, with its mesh coordinates. :func:`run` launches it for one layout;
  :func:`measure_many` measures several layouts of one world size in a single launch;
* :func:`planned` is the planner's prediction for the same ranks
  (:mod:`edu3d.plan.estimate`), so chart and tests compare like with like.

Exercise 07 is graded by :mod:`edu3d.course.ch07_memory_grade`.
"""

from __future__ import annotations

from edu3d.distributed import meter
from edu3d.distributed.mesh import Mesh
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.plan import estimate as plan_memory
from edu3d.train.data import SyntheticCorpus
from edu3d.config.sections import Run, from_flags
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer

STATE = ("params", "grads", "optimizer")


def options(argv: list[str]) -> Run:
    """``edu3d train``'s options from a command line, checked."""
    args = from_flags(argv)
    check_args(args)
    return args


def world_of(argv: list[str]) -> int:
    args = options(argv)
    return args.layout.dp * args.layout.tp * args.layout.pp


def measure(mesh, argv: list[str]) -> dict:
    """One AdamW step of the layout ``argv`` on this rank: ``{"coord": (pp, dp, tp),
    "bytes": {params, grads, optimizer (after the step), activations (the step's peak)},
    "mem_bytes": the fullest rank's, as edu3d train records it}``."""
    args = options(argv)
    layout = args.layout
    if mesh is None or layout != mesh.layout:
        mesh = Mesh.build(layout) if layout.world_size > 1 else None
    config = model_config(args)
    x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed).batch(
        1, args.batch.global_batch)
    trainer = Trainer(GPT(config, seed=args.training.seed), mesh, args)
    trainer.step(x, y, 1)
    held = meter.measure(trainer.tensors())
    held = {c: held[c] for c in STATE}
    held["activations"] = trainer.engine.peak_activation_bytes
    coord = tuple(mesh.coord) if mesh is not None else (0, 0, 0)
    return {"coord": coord, "bytes": held, "mem_bytes": trainer.stats()["mem_bytes"]}


def measure_many(mesh, argvs: list[list[str]]) -> list[dict]:
    """:func:`measure` for several option sets whose layouts have the launch's world size."""
    return [measure(mesh, argv) for argv in argvs]


def run(argv: list[str], timeout: float = 300) -> list[dict]:
    """Launch :func:`measure` for ``argv``'s layout; one result per rank, rank order."""
    n = world_of(argv)
    if n == 1:
        return [measure(None, argv)]
    return launch(measure, n, args=(argv,), timeout=timeout, echo=False,
                  name="memory-plan").results


def planned(argv: list[str], coord: tuple[int, int, int]) -> dict:
    """The planner's bytes for the rank at ``coord`` of ``argv``'s run (state at rest: after
    the step, as :func:`measure` counts it)."""
    st = options(argv)
    spec = plan_memory.spec_of(st)
    pp, dp, _ = coord
    out = plan_memory.state_per_rank(spec, st, pp, dp, at="rest")
    out["activations"] = plan_memory.activations_per_rank(spec, st)[pp]
    return out
