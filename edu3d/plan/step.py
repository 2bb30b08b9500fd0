"""One training step, simulated on each rank's compute and communication streams.

After reading this file you should understand how a step's time is put together, and why
"FLOPs over peak" is not it:

1. **each pipeline stage's work per micro-batch** (:mod:`edu3d.plan.stage_costs`): its
   kernels on the roofline with the host's launches, its exposed tensor-, context- and
   expert-parallel collectives, ZeRO-3's gathers and scatters behind the layers' compute;
2. **the pipeline**: each stage's ``F``, ``B`` (or ``I`` and ``W``) per micro-batch go into the
   schedule's own action lists (:mod:`edu3d.schedules`), replayed with a send's latency and
   bandwidth between stages (:func:`edu3d.schedules.simulate.simulate`): the bubble and the
   cost of crossing nodes at small micro-batches come out of the replay, not a formula. From
   ``pp`` micro-batches on a schedule is in its steady state, so a long step is replayed
   with ``pp`` of them and every further one adds the slowest rank's ``F + B``; longer
   pipelines than ``REPLAY_LIMIT`` (a search: ``SEARCH_REPLAY``) take that closed form whole;
3. **data parallelism** (:func:`reduce_tail`): the gradients of the last micro-batch's
   backward are reduced in buckets on the communication stream while the backward runs;
   only what outlasts it is exposed (under HSDP inside a replica group, then the shard's
   all-reduce across the groups). Then the optimizer (memory-bound: it reads and writes
   every state byte once) and, for ZeRO-1/2, the weight all-gather (hidden behind the next
   forward where the framework overlaps it).

The step is the slowest pipeline rank's, and its **parts** add up to it: ``compute`` (kernels),
``overhead`` (launches the kernels did not hide), ``bubble`` (idle waiting for other stages),
the exposed communication of each axis (``tp pp dp edp cp ep``) and ``optimizer``. Tokens/s
and MFU are outputs: MFU counts the model's FLOPs, ``6N`` (non-embedding parameters a token
uses, plus the LM head's ``h·V``) and ``12·L·h·s`` for attention (PaLM's count), against the
precision's peak. :func:`predict` is the one entry point (``edu3d plan``, its search,
``edu3d tune``, the course). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from edu3d.config.sections import Run
from edu3d.model.shapes import ModelSpec
from edu3d.plan import cpu, links, recipes, roofline, trainer_comm
from edu3d.plan.formulas import as_moe
from edu3d.plan.hardware import Profile, load_profile
from edu3d.plan.stage_costs import cut_of, stage_costs, zero3_cost
from edu3d.schedules.actions import build, chunks, placement, stages_of
from edu3d.schedules.partition import planner_cut
from edu3d.schedules.simulate import Costs, simulate

PARTS = ("compute", "overhead", "bubble", "tp", "pp", "dp", "edp", "cp", "ep", "optimizer")
REPLAY = 1  # a pipeline is replayed with up to REPLAY x pp micro-batches, then extrapolated
REPLAY_LIMIT = 4096  # pp x chunks x micro-batches replayed at most (every published run's fit)
SEARCH_REPLAY = 128  # a search replays fewer: its thousands of layouts take the closed form
RAMP = {"zb-h1": 1 / 3, "zbv": 1 / 3, "dualpipev": 1 / 3}  # the ramp left beyond 1F1B's:
# ZB-H1 a third (DESIGN.md); a V idles p-1 of its 6m chunk-thirds (simulate.bubble_formula)


@dataclass
class Prediction:
    """What :func:`predict` returns (seconds, tokens, bytes)."""

    step_time: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    model_flops_per_token: float
    parts: dict[str, float]
    matmul_efficiency: float  # FLOP-weighted fraction of peak the matmuls reach
    memory: dict[str, float]
    stages: list[dict]  # per global stage: seconds of F, R, I, W per micro-batch
    profile: str
    recipe: str
    events: list[dict] = field(default_factory=list)  # the timeline, "sim": true


def model_flops_per_token(spec: ModelSpec) -> float:
    """``6·(N + h·V) + 12·L·h·s``: the non-embedding parameters a token uses (MoE: its ``k``
    experts), the LM head, and attention's score and value matmuls (PaLM, not halved)."""
    moe = as_moe(spec)
    return (6 * (moe.layer_params(active=True) + spec.d_model * spec.vocab_size)
            + 12 * spec.n_layers * spec.d_model * spec.seq_len)


# ---- 3. data parallelism after the last backward -------------------------------------------------
def reduce_tail(spec: ModelSpec, run: Run, profile: Profile, rec: recipes.Recipe,
                pp_rank: int, backward: float) -> dict[str, float]:
    """Exposed seconds of the gradient reduction (``dp``, ``edp``) after a rank's last
    backward of ``backward`` seconds, and its weight all-gather (ZeRO-1/2)."""
    lay, par = run.layout, run.parallel
    out = {"dp": 0.0, "edp": 0.0}
    for axis, experts in (("dp", False), ("edp", True)):
        link, n, across = links.zero_links(profile, lay, "dpcp" if axis == "dp" else "edp",
                                           par.hsdp)
        psi = recipes.held(spec, run, pp_rank, experts)
        if (n == 1 and not across) or not psi:
            continue
        per_micro = par.zero >= 2 and par.grad_reduce == "per-microbatch" and lay.pp == 1
        if par.zero >= 3 or (per_micro and par.zero == 2):
            reduce = 0.0  # reduce-scattered layer by layer inside each micro-batch
        elif par.zero == 0:
            reduce = links.collective_time("all_reduce", rec.reduce * psi, n, link)
        else:
            reduce = links.collective_time("reduce_scatter", rec.reduce * psi, n, link)
        if par.dp_impl == "naive" and rec.name == "edu3d":  # one all-reduce per tensor
            reduce += (cpu.tensors_held(spec, run, pp_rank) - 1) * links.collective_time(
                "all_reduce", 4, n, link)
        # edu3d's overlap and bucketed modes both launch during backward (parallel/dp)
        overlap = rec.overlap_dp or par.dp_impl in ("overlap", "bucketed")
        tail = max(0.0, reduce - backward) if overlap else reduce
        if overlap and reduce:  # the last bucket cannot start before the backward ends
            buckets = max(1.0, rec.reduce * psi / (par.bucket_mb * 2**20))
            tail = max(tail, reduce / buckets)
        gather = 0.0
        if par.zero in (1, 2):
            gather = links.collective_time("all_gather", rec.gather * psi, n, link)
            if rec.overlap_gather:
                gather = max(0.0, gather - backward / 2)  # behind the next step's forward
        if par.zero in (1, 2) and rec.name == "edu3d":  # unit by unit, in series
            tail, gather = trainer_comm.zero_reduce(spec, run, pp_rank, experts, rec.reduce,
                                                    rec.gather, n, link)
        if par.zero >= 3 and rec.name == "edu3d" and not experts:  # its other units, exposed
            size = 4 if spec.course else rec.gather
            tail += trainer_comm.zero3_units(spec, run, pp_rank, size, size, n, link)
        # HSDP: the gradient shard all-reduced across the replica groups, after its scatter
        out[axis] = tail + gather + (links.collective_time(
            "all_reduce", rec.reduce * psi / n, par.hsdp, across) if across else 0.0)
    return out


def optimizer_time(spec: ModelSpec, run: Run, profile: Profile, rec: recipes.Recipe,
                   pp_rank: int) -> float:
    """AdamW and the gradient clip over this rank's shard: memory-bound, reading the
    gradient, master copy and moments and writing all but the gradient back (plus the
    16-bit weight copy), and reading the gradient again for its norm."""
    lay, zero = run.layout, run.parallel.zero
    hsdp = run.parallel.hsdp  # ZeRO shards within a replica group
    psi = (recipes.held(spec, run, pp_rank) / (lay.dp * lay.cp // hsdp if zero else 1)
           + recipes.held(spec, run, pp_rank, True) / (lay.edp // hsdp if zero else 1))
    state = rec.master + rec.moments + (4 if rec.name == "edu3d" else 0)
    per_param = 2 * state + 2 * rec.grad + (rec.weight if rec.master else 0)
    seconds = psi * per_param / (profile.mem_bandwidth * profile.mem_efficiency)
    return (seconds * cpu.ranks_per_core(profile, run.world_size)
            + cpu.step_overhead(spec, run, profile, pp_rank)  # CPU: loops over tensors
            + cpu.sync_overhead(spec, run, profile, pp_rank)  # CPU: data parallelism's step
            + (trainer_comm.bookkeeping(spec, run, profile) if rec.name == "edu3d" else 0.0))


# ---- 2. the pipeline, and the step --------------------------------------------------------------
def check(spec: ModelSpec, run: Run, rec: recipes.Recipe) -> None:
    """Refuse (``ValueError``, one line) a run the model cannot weigh: the planner's checks
    (:func:`edu3d.plan.estimate.validate`). The framework recipes also take fp8 and op-level
    recomputation (they run them; edu3d does not) and interleaved pipelines too long for
    the edu3d estimate's replay (their memory replays fewer micro-batches)."""
    dtype, mode, par = run.precision.dtype, run.memory.recompute, run.parallel
    if rec.name != "edu3d":
        if dtype not in ("fp32", "bf16", "fp16", "fp8"):
            raise ValueError(f"precision={dtype!r}: choose fp32, bf16, fp16 or fp8")
        if par.schedule == "interleaved" and run.microbatches % run.layout.pp:
            raise ValueError(f"interleaved: microbatches={run.microbatches} must be a "
                             f"multiple of pp={run.layout.pp}")
        planner_cut(spec.n_layers, run.layout, par)  # more stages than the cut has pieces
        run = run.replace(precision="bf16" if dtype == "fp8" else dtype, vpp=1,
                          recompute="selective" if mode == "op" else mode,
                          schedule="1f1b" if par.schedule == "interleaved" else par.schedule)
    elif mode == "op":  # fp8 edu3d runs (--precision fp8: the blocks' linears, edu3d.parallel.fp8)
        raise ValueError("op-level recomputation is not something edu3d runs; weigh it with "
                         "a framework recipe (--recipe torchtitan)")
    recipes.edu3d_estimate.validate(spec, run)


def replayed(run: Run, v: int) -> int:
    """Micro-batches to replay: all of them, or ``REPLAY·pp`` (a multiple of pp, as the
    interleaved schedule needs): from ``pp`` on a schedule is in its steady state, where
    every extra micro-batch adds the slowest rank's forward and backward (a V's two chunks:
    from ``2·pp``, as DualPipeV needs and ZBV's full V fills)."""
    m, pp = run.microbatches, run.layout.pp
    pp *= 2 if placement(run.parallel.schedule) == "v" else 1
    return m if m <= REPLAY * pp else REPLAY * pp


def pipeline(run: Run, costs: list[dict], p2p: float, m: int):
    """Replay ``m`` micro-batches of the run's schedule with per-stage costs; returns the
    simulator's timeline."""
    lay, par = run.layout, run.parallel
    phases = tuple((c["F"], c["R"] + c["I"] + c["W"], c["R"] + c["I"], c["W"]) for c in costs)
    return replay(par.schedule, lay.pp, chunks(par.schedule, lay.vpp), m, phases, p2p)


@lru_cache(maxsize=512)
def replay(schedule: str, pp: int, v: int, m: int, phases: tuple, p2p: float):
    """The cached replay (a search's layouts that differ only in ZeRO share it)."""
    measured = {}
    for s, (f, b, i, w) in enumerate(phases):
        for mb in range(m):
            measured.update({(s, "F", mb): f, (s, "B", mb): b, (s, "I", mb): i, (s, "W", mb): w})
    return simulate(build(schedule, pp, m, v), pp, Costs(p2p=p2p, measured=measured))


def predict(spec: ModelSpec, run: Run, profile: Profile | str, recipe: str = "edu3d",
            timeline: bool = False, memory: bool = True,
            replay_limit: int | None = REPLAY_LIMIT) -> Prediction:
    """Step time, throughput, MFU, the parts of the step and the fullest rank's memory of
    ``run`` training ``spec`` on ``profile`` (a :class:`~edu3d.plan.hardware.Profile`, a
    shipped name or a file), with ``recipe``'s choices (:data:`edu3d.plan.recipes.RECIPES`).
    ``timeline``: also the step's events (every micro-batch replayed; slower); ``memory=False``
    leaves the memory out (a search that has its estimate already); ``replay_limit``: replay
    a pipeline of at most that many ``pp x chunks x micro-batches``, take its closed form
    beyond (bounded work; ``None``: always replay)."""
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    rec = recipes.recipe_of(recipe) if isinstance(recipe, str) else recipe
    check(spec, run, rec)
    lay, par = run.layout, run.parallel
    v = chunks(par.schedule, lay.vpp)
    parts = planner_cut(spec.n_layers, lay, par)
    costs = []
    for (lo, hi), st in zip(parts, stage_costs(spec, run, prof, rec)):
        fwd, bwd = zero3_cost(spec, run, prof, rec, st, hi - lo)
        costs.append(dict(st, F=st["F"] + fwd, I=st["I"] + bwd, zero3=fwd + bwd))
    c = cut_of(spec, run, rec)
    link = links.pp_link(prof, lay)
    msg = c.act * c.tokens * c.h / (lay.tp if c.sp else 1)
    p2p = links.collective_time("send", msg, 2, link) if lay.pp > 1 else 0.0
    m = run.microbatches
    held = [stages_of(r, lay.pp, lay.pp * v, placement(par.schedule)) for r in range(lay.pp)]
    per_mb = [sum(costs[s]["F"] + costs[s]["R"] + costs[s]["I"] + costs[s]["W"] for s in held[r])
              for r in range(lay.pp)]
    m_sim = m if timeline else replayed(run, v)
    if timeline or replay_limit is None or lay.pp * v * m_sim <= replay_limit:
        tl = pipeline(run, costs, p2p, m_sim)
        extra = (m - m_sim) * max(per_mb)
        flat = extra + (pipeline(run, costs, 0.0, m_sim).makespan if lay.pp > 1 else tl.makespan)
        ends = [extra] * lay.pp
        for e in tl.events:
            if e["lane"] == "compute":
                ends[e["rank"]] = max(ends[e["rank"]], e["t1"] + extra)
        makespan, events = tl.makespan + extra, tl.events
    else:  # too long to replay in a search: the replay's own steady state and ramp
        flat = m * max(per_mb) + (lay.pp - 1) * sum(per_mb) / lay.pp / v * RAMP.get(
            par.schedule, 1.0)
        makespan = flat + 2 * (lay.pp - 1) * p2p
        ends, events = [makespan] * lay.pp, []
    totals = []
    for r in range(lay.pp):
        last_b = sum(costs[s]["R"] + costs[s]["I"] + costs[s]["W"] for s in held[r])
        tail = reduce_tail(spec, run, prof, rec, r, last_b)
        totals.append((ends[r] + tail["dp"] + tail["edp"] + optimizer_time(spec, run, prof,
                                                                            rec, r), r, tail))
    step, crit, tail = max(totals, key=lambda x: x[0])
    mine = [costs[s] for s in held[crit]]
    out = {p: 0.0 for p in PARTS}
    busy = m * per_mb[crit]
    out["compute"] = m * sum(s["kernels"] for s in mine)
    for s in mine:
        for axis, t in s["exposed"].items():
            out[axis] += m * t
        out["dp"] += m * s["zero3"]
    out["overhead"] = max(0.0, busy - sum(out.values()))
    out["pp"] = max(0.0, makespan - flat)
    out["bubble"] = max(0.0, ends[crit] - busy - out["pp"])
    out["dp"] += tail["dp"]
    out["edp"] += tail["edp"]
    out["optimizer"] = optimizer_time(spec, run, prof, rec, crit)
    step = sum(out.values())
    tokens = run.batch.global_batch * spec.seq_len
    fpt = model_flops_per_token(spec)
    flops = sum(s["flops"] for s in costs)
    mm_time = sum(s["matmul_time"] for s in costs)
    eff = flops / mm_time / roofline.peak(prof, run.precision.dtype) if mm_time else 0.0
    peak = roofline.peak(prof, run.precision.dtype)
    events = [dict(e, t0=e["t0"] * 1e6, t1=e["t1"] * 1e6) for e in events] if timeline else []
    return Prediction(
        step_time=step, tokens_per_s=tokens / step, tokens_per_s_per_gpu=tokens / step /
        run.world_size, mfu=fpt * tokens / (step * run.world_size * peak),
        model_flops_per_token=fpt, parts=out, matmul_efficiency=eff,
        memory=recipes.memory(spec, run, rec, prof) if memory else {},
        stages=[{k: s[k] for k in ("F", "R", "I", "W")} for s in costs], profile=prof.name,
        recipe=rec.name, events=events)
