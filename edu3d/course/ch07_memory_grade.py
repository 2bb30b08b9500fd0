"""The grader of exercise 07 (``exercises/rank_memory.py``): the bytes one rank holds,
against the planner, against real ranks, then a memory plan of the learner's own.

After reading this file you should know how the exercise is checked:

* ``check_counts``, ``check_state`` and ``check_in_flight`` hold the learner's parameter
  count, state bytes and in-flight micro-batches against the planner
  (:mod:`edu3d.plan.estimate`), over many layouts, a vocabulary that tp pads included;
* :func:`check_measured` holds all three against what every rank of three real runs held
  (:func:`measured_run`, one launch of 2 ranks through
  :func:`edu3d.course.ch07_memory_plan.measure_many`).

Each raises ``AssertionError`` with one line saying what differs.

The design: ``memory_plan(job)`` picks the ZeRO stage, the micro-batch size and whether to
recompute activations for a data-parallel job of :data:`JOBS` (plain gradient
accumulation, fp32 AdamW's 16 bytes per parameter). :func:`cost` prices it as chapter 07
teaches: the state ZeRO leaves on a rank plus one micro-batch's activations (a recomputed
block keeps only its input), against the step's compute (a third more with recompute, a
fixed overhead per micro-batch) and its exposed communication (ZeRO-0/1 all-reduce the
gradients once a step; ZeRO-2 reduce-scatters them every micro-batch and all-gathers the
weights once; ZeRO-3 all-gathers the weights twice and reduce-scatters every micro-batch).
The target: it fits the GPU, and the step is within 2 % of the best plan (every plan is
listed).
"""

from __future__ import annotations

from dataclasses import dataclass

from edu3d.course.ch07_memory_plan import STATE, measure_many, options
from edu3d.course.targets import Cost, Target, meet, plan_line, step_line, target_of
from edu3d.launch import launch
from edu3d.model.shapes import spec_from
from edu3d.plan import estimate as plan_memory

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


# ---- the design: ZeRO stage, micro-batch and recompute under a memory cap -----------------------
@dataclass(frozen=True)
class Job:
    params: float  # parameters of the model (every rank holds all of them before ZeRO)
    dp: int
    batch: int  # samples per rank per step
    gpu_gb: float
    act_gb: float  # activations of one sample, every tensor saved
    act_recompute_gb: float  # the same with recompute: each block keeps only its input


SAMPLE_S, MICRO_S, RECOMPUTE = 0.1, 0.02, 4 / 3  # compute per sample, per micro-batch; x with recompute
LINK_GBS = 100.0  # each rank's share of the ring, GB/s
JOBS = {"a": Job(params=1.5e9, dp=8, batch=32, gpu_gb=40, act_gb=3.0, act_recompute_gb=0.5),
        "b": Job(params=1.5e9, dp=8, batch=32, gpu_gb=16, act_gb=3.0, act_recompute_gb=0.5)}
SLACK = 1.02


def _plan(job: str, plan) -> tuple[int, int, bool]:
    j = JOBS[job]
    assert isinstance(plan, dict) and {"zero", "micro_batch", "recompute"} <= set(plan), \
        f"job {job}: memory_plan must return a dict with zero, micro_batch and recompute"
    zero, b, rc = int(plan["zero"]), int(plan["micro_batch"]), bool(plan["recompute"])
    assert zero in (0, 1, 2, 3), f"job {job}: ZeRO stage {zero}: choose 0, 1, 2 or 3"
    assert b >= 1 and j.batch % b == 0, \
        f"job {job}: a micro-batch of {b} does not divide the {j.batch} samples of a rank"
    return zero, b, rc


def cost(job: str, plan) -> Cost:
    """Seconds of one step and the fullest rank's bytes for ``plan``."""
    j = JOBS[job]
    zero, b, rc = _plan(job, plan)
    m, psi, n = j.batch // b, j.params, j.dp
    state = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n,
             3: 16 * psi / n}[zero]
    act = b * (j.act_recompute_gb if rc else j.act_gb) * 1e9
    move = (n - 1) / n * 4 * psi / (LINK_GBS * 1e9)  # one reduce-scatter or all-gather, fp32
    comm = {0: 2 * move, 1: 2 * move, 2: m * move + move, 3: 3 * m * move}[zero]
    compute = j.batch * SAMPLE_S * (RECOMPUTE if rc else 1) + m * MICRO_S
    return Cost(time=compute + comm, memory=state + act)


def plans(job: str):
    """Every plan: ZeRO 0-3, each micro-batch size that divides the batch, recompute or not."""
    for zero in range(4):
        for b in range(1, JOBS[job].batch + 1):
            if JOBS[job].batch % b == 0:
                for rc in (False, True):
                    yield {"zero": zero, "micro_batch": b, "recompute": rc}


def target(job: str) -> Target:
    return target_of(plans(job), lambda p: cost(job, p), JOBS[job].gpu_gb * 1e9, SLACK)


def check_design(ex, job: str) -> None:
    plan = ex.memory_plan(job)
    meet(f"job {job}: {plan}", cost(job, plan), target(job))


def describe(job: str, plan) -> str:
    """What ``plan`` costs next to the target, or why it is no plan."""
    return plan_line(lambda: cost(job, plan), lambda: target(job),
                     lambda c, t: step_line(f"job {job}: {plan}", c, t, "{} per rank"))
