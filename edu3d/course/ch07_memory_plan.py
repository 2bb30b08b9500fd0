"""Chapter 07's planner glue: measure a layout's bytes per rank, and grade exercise 07.

After reading this file you should know where the chapter's "measured" bars come from and
how the exercise is checked:

* :func:`measure` is a launch target: every rank builds the library's
  :class:`~edu3d.train.trainer.Trainer` for ``edu3d train``'s options, takes one AdamW step, and
  returns what it holds afterwards (weights, gradients, optimizer state, counted by storage:
  :func:`edu3d.distributed.meter.measure`) and the peak of the activations its pipeline engine kept
  during the step, with its mesh coordinates. :func:`run` launches it for one layout;
  :func:`measure_many` measures several layouts of one world size in a single launch;
* :func:`planned` is the planner's prediction for the same ranks
  (:mod:`edu3d.plan.estimate`), so chart and tests compare like with like;
* the ``check_*`` functions grade ``exercises/rank_memory.py``: the learner's parameter
  count, state bytes and in-flight micro-batches against the planner, and then against a
  measured run (:func:`check_measured`). Each raises ``AssertionError`` with one line saying
  what differs.
"""

from __future__ import annotations

from edu3d.distributed import meter
from edu3d.distributed.mesh import Mesh
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.model.shapes import spec_from
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


# ---- exercise 07 --------------------------------------------------------------------------------
LAYOUTS = [(L, t, p) for L in (4, 5) for t in (1, 2, 4) for p in (1, 2, 4) if p <= L]


def _spec(layers: int, tied: bool = False, vocab: int | None = None):
    return spec_from("tiny", n_layers=layers, tied=tied, vocab_size=vocab)


def check_counts(ex) -> None:
    """``rank_params`` against the planner's inventory, every stage of many layouts, with
    the tiny model's vocabulary (256) and one no tp > 1 divides (101: padded to 102 or 104,
    which a count of ``vocab // tp`` rows misses)."""
    for layers, tp, pp in LAYOUTS:
        for tied, vocab in ((False, None), (True, None), (False, 101), (True, 101)):
            spec = _spec(layers, tied, vocab)
            st = plan_memory.setup(tp=tp, pp=pp, microbatches=pp)
            for r in range(pp):
                want = sum(k for _, u in plan_memory.units(spec, st, r) for k, _ in u)
                got = ex.rank_params(layers, spec.d_model, spec.vocab_size, spec.seq_len, tp,
                                     pp, r, tied)
                assert got == want, (f"{layers} layers, vocab {spec.vocab_size}, tp={tp}, "
                                     f"pp={pp}, tied={tied}: pp rank {r} holds {want} "
                                     f"parameters, rank_params says {got}")


def check_state(ex) -> None:
    """``state_bytes`` against the planner's per-rank state, within ZeRO's padding and
    AdamW's step counters (4 bytes per tensor): under 1%."""
    spec = _spec(4)
    for dp in (1, 2, 4):
        for zero in ((0, 1, 2, 3) if dp > 1 else (0,)):
            st = plan_memory.setup(dp=dp, zero=zero)
            want = plan_memory.state_per_rank(spec, st, 0, at="rest")
            got = ex.state_bytes(spec.num_params(), dp, zero)
            for cat in STATE:
                assert abs(got[cat] - want[cat]) <= 0.01 * want[cat], (
                    f"dp={dp} ZeRO-{zero}: {cat} should be about {want[cat]:.0f} bytes, "
                    f"state_bytes says {got[cat]}")


def check_in_flight(ex) -> None:
    """``in_flight`` against the micro-batches the simulated schedule keeps alive."""
    for schedule in ("gpipe", "1f1b"):
        for pp in (1, 2, 3, 4):
            for m in (1, 2, 4, 8):
                want = plan_memory.in_flight(schedule, pp, m)
                for r in range(pp):
                    got = ex.in_flight(schedule, pp, m, r)
                    assert got == want[r], (f"{schedule}, pp={pp}, m={m}: pp rank {r} keeps "
                                            f"{want[r]} micro-batches, in_flight says {got}")


MEASURED = [["--dp", "2", "--zero", "2", "--microbatches", "2"],
            ["--tp", "2", "--tie"],
            ["--pp", "2", "--microbatches", "4"]]


def measured_run(timeout: float = 300) -> dict:
    """The exercise's three layouts (ZeRO-2, TP with a tied head, a 1F1B pipeline), measured
    in one launch of 2 ranks."""
    res = launch(measure_many, 2, args=(MEASURED,), timeout=timeout, echo=False,
                 name="exercise07").results
    return {" ".join(argv): [res[r][i] for r in range(2)] for i, argv in enumerate(MEASURED)}


def check_measured(ex, runs: dict) -> None:
    """The learner's functions against what every rank of the measured runs held."""
    for line, ranks in runs.items():
        args = options(line.split())
        spec, st = plan_memory.spec_of(args), args
        per_mb = plan_memory.stage_activation_bytes(spec, st)
        for res in ranks:
            pp, dp, tp = res["coord"]
            n = ex.rank_params(spec.n_layers, spec.d_model, spec.vocab_size, spec.seq_len,
                               st.layout.tp, st.layout.pp, pp, spec.tied)
            got = ex.state_bytes(n, st.layout.dp, st.parallel.zero)
            for cat in STATE:
                meas = res["bytes"][cat]
                assert abs(got[cat] - meas) <= 0.01 * meas, (
                    f"{line}, rank {res['coord']}: measured {meas} bytes of {cat}, yours "
                    f"{got[cat]}")
            acts = ex.in_flight(st.parallel.schedule, st.layout.pp, st.microbatches, pp) * per_mb[pp]
            meas = res["bytes"]["activations"]
            assert abs(acts / meas - 1) < 1e-3, (
                f"{line}, rank {res['coord']}: measured peak activations {meas} bytes, "
                f"{acts:.0f} from your in-flight count")
