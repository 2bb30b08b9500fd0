"""One training step, simulated on each rank's compute and communication streams.

After reading this file you should understand how a step's time is put together, and why
"FLOPs over peak" is not it:

1. **a layer, per micro-batch** (:func:`stage_costs`): its kernels (:mod:`edu3d.plan.ops`)
   timed on the roofline (:mod:`edu3d.plan.roofline`), forward ``F``, recomputation ``R``,
   input gradient ``I`` and weight gradient ``W``; and its collectives (:mod:`edu3d.plan.links`)
   on a second stream. A tensor-parallel all-gather must finish before the matmul that needs
   it, so it is *exposed* (added to the layer's time) unless the layout overlaps it
   (``tp_overlap``, AsyncTP): then only what the matmul beside it does not hide is. A ring
   of context parallelism hides each K/V hop behind that step's block of attention;
2. **ZeRO-3 / FSDP** (:func:`overlapped`): each layer's weights are all-gathered before its
   forward and again before its backward, its gradients reduce-scattered after; with
   prefetch the next layer's all-gather runs while this one computes, so a layer costs the
   slower of its compute and its communication, plus the first gather and the last scatter;
3. **the pipeline**: each stage's ``F``, ``B`` (or ``I`` and ``W``) per micro-batch go into the
   schedule's own action lists (:mod:`edu3d.schedules`), replayed with a send's latency and
   bandwidth between stages (:func:`edu3d.schedules.simulate.simulate`): the bubble and the
   cost of crossing nodes at small micro-batches come out of the replay, not a formula;
4. **data parallelism** (:func:`reduce_tail`): the gradients of the last micro-batch's
   backward are reduced in buckets, each as soon as its layers are done, on the
   communication stream; only what outlasts the backward is exposed. Then the optimizer
   (memory-bound: it reads and writes every state byte once) and, for ZeRO-1/2, the weight
   all-gather (hidden behind the next forward where the framework overlaps it).

The step is the slowest pipeline rank's, and its **parts** add up to it: ``compute`` (kernels),
``overhead`` (launches the kernels did not hide), ``bubble`` (idle waiting for other stages),
the exposed communication of each axis (``tp pp dp edp cp ep``) and ``optimizer``. Tokens/s
and MFU are outputs: MFU counts the model's FLOPs, ``6N`` (non-embedding parameters a token
uses, plus the LM head's ``h·V``) and ``12·L·h·s`` for attention (PaLM's count), against the
precision's peak. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from edu3d.config.sections import Run
from edu3d.model.shapes import ModelSpec
from edu3d.plan import cpu, links, recipes, roofline, trainer_comm
from edu3d.plan.formulas import as_moe, routed_per_token
from edu3d.plan.hardware import Profile, load_profile
from edu3d.plan.ops import Cut, embedding_ops, head_ops, layer
from edu3d.schedules.actions import build, chunks
from edu3d.schedules.partition import uniform
from edu3d.schedules.simulate import Costs, simulate

PARTS = ("compute", "overhead", "bubble", "tp", "pp", "dp", "edp", "cp", "ep", "optimizer")
REPLAY = 2  # a pipeline is replayed with up to REPLAY x pp micro-batches, then extrapolated


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


def cut_of(spec: ModelSpec, run: Run, rec: recipes.Recipe) -> Cut:
    """The shapes one rank computes per micro-batch."""
    lay, par = run.layout, run.parallel
    t, sp = lay.tp, par.sp and lay.tp > 1
    tokens = run.micro_batch * spec.seq_len // lay.cp
    kv = spec.kv_heads // t if spec.kv_heads >= t else 1
    course_fp32 = run.precision.dtype == "fp32"
    return Cut(tokens=tokens, norm_tokens=tokens // t if sp else tokens, seq=spec.seq_len,
               b=run.micro_batch, h=spec.d_model, head_dim=spec.d_model // spec.n_heads,
               heads=spec.n_heads // t, kv_heads=kv, ff=spec.ff // t,
               vocab=spec.vocab_rows(t), tp=t, cp=lay.cp, sp=sp, act=4 if course_fp32 else 2,
               mlp=spec.mlp, norm=spec.norm, rope=not spec.learned_pos,
               flash=run.precision.attn != "explicit", fused=rec.fused or run.precision.compile,
               fused_norm=rec.fused_norm,
               fp8=run.precision.dtype == "fp8", cp_impl=par.cp_impl)


def moe_args(spec: ModelSpec, run: Run) -> tuple:
    moe = as_moe(spec)
    return (moe.experts, routed_per_token(moe), run.layout.ep, moe.e_ff, moe.shared_experts)


# ---- 1. a stage's work per micro-batch ----------------------------------------------------------
def phase_time(ops, comms, phase: str, profile: Profile, run: Run, ranks_per_core: float,
               exposed: dict, framework: float = 0.0) -> float:
    """Seconds of one phase of a layer: its kernels, plus each collective's exposed part
    (added to ``exposed`` by axis)."""
    mine = [o for o in ops if o.phase == phase]
    dtype = run.precision.dtype
    busy = roofline.stretch_time(mine, profile, dtype, ranks_per_core, framework)
    by_name = {}
    for o in mine:
        by_name[o.name] = by_name.get(o.name, 0.0) + roofline.op_time(o, profile, dtype)
    out = busy
    for c in (c for c in comms if c.phase == phase):
        link, n = links.group_link(profile, run.layout, c.axis)
        each = links.collective_time(c.kind, c.nbytes, n if c.kind != "send" else 2, link)
        hidden = 0.0
        overlap = c.axis == "cp" or (c.axis == "tp" and run.parallel.tp_overlap)
        if c.hides and overlap:
            hidden = by_name.get(c.hides, 0.0) / (c.steps if c.axis == "cp" else 1)
        lost = c.steps * max(0.0, each - hidden)
        exposed[c.axis] = exposed.get(c.axis, 0.0) + lost
        out += lost
    return out


@lru_cache(maxsize=2048)
def stage_costs(spec: ModelSpec, run: Run, profile: Profile, rec: recipes.Recipe) -> tuple:
    """Per global stage: ``{"F", "R", "I", "W"}`` seconds per micro-batch, ``"exposed"`` by
    axis, ``"kernels"`` (pure device time) and ``"flops"`` of its matmuls."""
    lay, par = run.layout, run.parallel
    c = cut_of(spec, run, rec)
    moe = as_moe(spec)
    recompute = run.memory.recompute
    parts = uniform(spec.n_layers, lay.pp * chunks(par.schedule, lay.vpp))
    per_core = run.world_size / profile.cores if profile.cores else 1.0
    out = []
    for s, (lo, hi) in enumerate(parts):
        kinds: dict = {}
        for i in range(lo, hi):
            key = moe_args(spec, run) if moe.is_moe(i) else None
            kinds[key] = kinds.get(key, 0) + 1
        pieces = [(layer(c, recompute, key), n) for key, n in kinds.items()]
        if s == 0:
            pieces.append(((tuple(embedding_ops(c)), ()), 1))
        if s == len(parts) - 1:
            pieces.append(((tuple(head_ops(c, rec.fused_loss)), ()), 1))
        row = {"F": 0.0, "R": 0.0, "I": 0.0, "W": 0.0, "exposed": {}, "kernels": 0.0,
               "flops": 0.0, "matmul_time": 0.0}
        for (ops, comms), n in pieces:
            for phase in ("F", "R", "I", "W"):
                exposed: dict = {}
                row[phase] += n * phase_time(ops, comms, phase, profile, run, per_core, exposed,
                                             rec.host)
                for axis, v in exposed.items():
                    row["exposed"][axis] = row["exposed"].get(axis, 0.0) + n * v
            row["kernels"] += n * sum(roofline.op_time(o, profile, run.precision.dtype)
                                      for o in ops) * max(1.0, per_core)
            mats = [o for o in ops if o.kind == "matmul"]
            row["flops"] += n * sum(o.flops for o in mats)
            row["matmul_time"] += n * sum(roofline.op_time(o, profile, run.precision.dtype)
                                          for o in mats)
        row["W"] += (cpu.microbatch_overhead(spec, run, profile, s % lay.pp)  # CPU: DP hooks
                     / chunks(par.schedule, lay.vpp))
        out.append(row)
    return tuple(out)


# ---- 2. ZeRO-3: layer by layer, two streams --------------------------------------------------
def overlapped(compute: list[float], comm: list[float], prefetch: bool) -> float:
    """Two streams over a stage's layers: layer ``i`` computes once its communication
    ``comm[i]`` is done; with ``prefetch`` the communication of layer ``i+1`` starts while
    layer ``i`` computes (FSDP's default), without it only after. Returns the end time."""
    comm_free = compute_free = 0.0
    for i, (work, talk) in enumerate(zip(compute, comm)):
        start_talk = comm_free if prefetch else max(comm_free, compute_free)
        comm_free = start_talk + talk
        compute_free = max(compute_free, comm_free) + work
    return compute_free


def zero3_cost(spec: ModelSpec, run: Run, profile: Profile, rec: recipes.Recipe,
               stage: dict, layers: int) -> tuple[float, float]:
    """Exposed seconds per micro-batch of a stage's ZeRO-3 traffic, forward and backward:
    an all-gather of each layer's weights before its forward (and again before its
    backward), a reduce-scatter of its gradients after, on the dp·cp group."""
    if run.parallel.zero < 3 or run.layout.dp * run.layout.cp == 1 or not layers:
        return 0.0, 0.0
    link, n = links.group_link(profile, run.layout, "dpcp")
    psi = sum(k for _, k, _ in as_moe(spec).block_tensors(0, run.layout.tp))
    gather = links.collective_time("all_gather", rec.gather * psi, n, link)
    scatter = links.collective_time("reduce_scatter", rec.reduce * psi, n, link)
    if run.parallel.grad_reduce == "per-step" or run.layout.pp > 1:  # once per step: spread
        gather, scatter = gather / run.microbatches, scatter / run.microbatches
    prefetch = rec.prefetch or run.parallel.prefetch
    f, b = stage["F"] / layers, (stage["R"] + stage["I"] + stage["W"]) / layers
    fwd = overlapped([f] * layers, [gather] * layers, prefetch) - f * layers
    bwd = overlapped([b] * layers, [gather + scatter] * layers, prefetch) - b * layers
    return fwd, bwd + scatter  # the last layer's scatter waits for nothing after it


# ---- 4. data parallelism after the last backward -------------------------------------------------
def reduce_tail(spec: ModelSpec, run: Run, profile: Profile, rec: recipes.Recipe,
                pp_rank: int, backward: float) -> dict[str, float]:
    """Exposed seconds of the gradient reduction (``dp``, ``edp``) after a rank's last
    backward of ``backward`` seconds, and its weight all-gather (ZeRO-1/2)."""
    lay, par = run.layout, run.parallel
    out = {"dp": 0.0, "edp": 0.0}
    for axis, experts in (("dp", False), ("edp", True)):
        link, n = links.group_link(profile, lay, "dpcp" if axis == "dp" else "edp")
        psi = recipes.held(spec, run, pp_rank, experts)
        if n == 1 or not psi:
            continue
        per_micro = par.zero >= 2 and par.grad_reduce == "per-microbatch" and lay.pp == 1
        if par.zero >= 3 or (per_micro and par.zero == 2):
            reduce = 0.0  # reduce-scattered layer by layer inside each micro-batch
        elif par.zero == 0:
            reduce = links.collective_time("all_reduce", rec.reduce * psi, n, link)
        else:
            reduce = links.collective_time("reduce_scatter", rec.reduce * psi, n, link)
        overlap = rec.overlap_dp or par.dp_impl == "overlap"
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
        out[axis] = tail + gather
    return out


def optimizer_time(spec: ModelSpec, run: Run, profile: Profile, rec: recipes.Recipe,
                   pp_rank: int) -> float:
    """AdamW and the gradient clip over this rank's shard: memory-bound, reading the
    gradient, master copy and moments and writing all but the gradient back (plus the
    16-bit weight copy), and reading the gradient again for its norm."""
    lay, zero = run.layout, run.parallel.zero
    psi = (recipes.held(spec, run, pp_rank) / (lay.dp * lay.cp if zero else 1)
           + recipes.held(spec, run, pp_rank, True) / (lay.edp if zero else 1))
    state = rec.master + rec.moments + (4 if rec.name == "edu3d" else 0)
    per_param = 2 * state + 2 * rec.grad + (rec.weight if rec.master else 0)
    seconds = psi * per_param / (profile.mem_bandwidth * profile.mem_efficiency)
    return (seconds * (run.world_size / profile.cores if profile.cores else 1.0)
            + cpu.step_overhead(spec, run, profile, pp_rank)  # CPU: loops over tensors
            + (trainer_comm.bookkeeping(run, profile) if rec.name == "edu3d" else 0.0))


# ---- 3. the pipeline, and the step --------------------------------------------------------------
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
        stages = run.layout.pp * chunks(par.schedule, run.layout.vpp)
        if stages > spec.n_layers:
            raise ValueError(f"pp*vpp = {stages} stages for {spec.n_layers} layers")
        run = run.replace(precision="bf16" if dtype == "fp8" else dtype, vpp=1,
                          recompute="selective" if mode == "op" else mode,
                          schedule="1f1b" if par.schedule == "interleaved" else par.schedule)
    elif mode == "op" or dtype == "fp8":
        raise ValueError(f"{'fp8' if dtype == 'fp8' else 'op-level recomputation'} is not "
                         "something edu3d runs; weigh it with a framework recipe "
                         "(--recipe torchtitan)")
    recipes.edu3d_estimate.validate(spec, run)


def replayed(run: Run, v: int) -> int:
    """Micro-batches to replay: all of them, or ``REPLAY·pp`` (a multiple of pp, as the
    interleaved schedule needs): beyond, every extra micro-batch adds the same time."""
    m, pp = run.microbatches, run.layout.pp
    return m if m <= REPLAY * pp else REPLAY * pp


def pipeline(run: Run, costs: list[dict], p2p: float, m: int) -> tuple:
    """Replay ``m`` micro-batches of the run's schedule with per-stage costs; returns the
    simulator's timeline."""
    lay, par = run.layout, run.parallel
    v = chunks(par.schedule, lay.vpp)
    measured = {}
    for s, c in enumerate(costs):
        for mb in range(m):
            measured.update({(s, "F", mb): c["F"], (s, "B", mb): c["R"] + c["I"] + c["W"],
                             (s, "I", mb): c["R"] + c["I"], (s, "W", mb): c["W"]})
    return simulate(build(par.schedule, lay.pp, m, v), lay.pp, Costs(p2p=p2p, measured=measured))


def predict(spec: ModelSpec, run: Run, profile: Profile | str, recipe: str = "edu3d",
            timeline: bool = False) -> Prediction:
    """Step time, throughput, MFU, the parts of the step and the fullest rank's memory of
    ``run`` training ``spec`` on ``profile`` (a :class:`~edu3d.plan.hardware.Profile`, a
    shipped name or a file), with ``recipe``'s choices (:data:`edu3d.plan.recipes.RECIPES`).
    ``timeline``: also the step's events (every micro-batch replayed; slower)."""
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    rec = recipes.recipe_of(recipe) if isinstance(recipe, str) else recipe
    check(spec, run, rec)
    lay, par = run.layout, run.parallel
    v = chunks(par.schedule, lay.vpp)
    parts = uniform(spec.n_layers, lay.pp * v)
    costs = []
    for (lo, hi), st in zip(parts, stage_costs(spec, run, prof, rec)):
        fwd, bwd = zero3_cost(spec, run, prof, rec, st, hi - lo)
        costs.append(dict(st, F=st["F"] + fwd, I=st["I"] + bwd, zero3=fwd + bwd))
    c = cut_of(spec, run, rec)
    link = links.pp_link(prof, lay)
    msg = c.act * c.tokens * c.h / (lay.tp if c.sp else 1)
    p2p = links.collective_time("send", msg, 2, link) if lay.pp > 1 else 0.0
    m = run.microbatches
    m_sim = m if timeline else replayed(run, v)
    tl = pipeline(run, costs, p2p, m_sim)
    flat = pipeline(run, costs, 0.0, m_sim).makespan if lay.pp > 1 else tl.makespan
    per_mb = [sum(costs[k * lay.pp + r]["F"] + costs[k * lay.pp + r]["R"] + costs[k * lay.pp + r]
                  ["I"] + costs[k * lay.pp + r]["W"] for k in range(v)) for r in range(lay.pp)]
    extra = (m - m_sim) * max(per_mb)
    ends = [max((e["t1"] for e in tl.events if e["rank"] == r and e["lane"] == "compute"),
                default=0.0) + extra for r in range(lay.pp)]
    totals = []
    for r in range(lay.pp):
        last_b = sum(costs[k * lay.pp + r]["R"] + costs[k * lay.pp + r]["I"]
                     + costs[k * lay.pp + r]["W"] for k in range(v))
        tail = reduce_tail(spec, run, prof, rec, r, last_b)
        totals.append((ends[r] + tail["dp"] + tail["edp"] + optimizer_time(spec, run, prof,
                                                                            rec, r), r, tail))
    step, crit, tail = max(totals, key=lambda x: x[0])
    mine = [costs[k * lay.pp + crit] for k in range(v)]
    out = {p: 0.0 for p in PARTS}
    busy = m * per_mb[crit]
    out["compute"] = m * sum(s["kernels"] for s in mine)
    for s in mine:
        for axis, t in s["exposed"].items():
            out[axis] += m * t
        out["dp"] += m * s["zero3"]
    out["overhead"] = max(0.0, busy - sum(out.values()))
    out["pp"] = max(0.0, (tl.makespan - flat))
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
    events = [dict(e, t0=e["t0"] * 1e6, t1=e["t1"] * 1e6) for e in tl.events] if timeline else []
    return Prediction(
        step_time=step, tokens_per_s=tokens / step, tokens_per_s_per_gpu=tokens / step /
        run.world_size, mfu=fpt * tokens / (step * run.world_size * peak),
        model_flops_per_token=fpt, parts=out, matmul_efficiency=eff,
        memory=recipes.memory(spec, run, rec, prof),
        stages=[{k: s[k] for k in ("F", "R", "I", "W")} for s in costs], profile=prof.name,
        recipe=rec.name, events=events)
