"""A pipeline stage's work per micro-batch: each layer's kernels and exposed collectives.

After reading this file you should be able to say what one stage costs per micro-batch, and
why a collective costs a stage only what its compute does not hide:

* **the cut** (:func:`cut_of`): the shapes one rank computes (tokens ``b·s/cp``, heads and
  widths ``/tp``, norms ``/tp`` more under sequence parallelism) and the recipe's kernel
  choices (FlashAttention, fused elementwise code, fp8);
* **a layer per phase** (:func:`phase_time`): its kernels (:mod:`edu3d.plan.kernels`) timed
  on the roofline with the host's launches (:mod:`edu3d.plan.roofline`), forward ``F``,
  recomputation ``R``, input gradient ``I``, weight gradient ``W``; and its collectives on
  their links (:mod:`edu3d.plan.links`). A tensor-parallel all-gather must finish before the
  matmul that needs it, so it is *exposed* unless the layout overlaps it (``tp_overlap``,
  AsyncTP): then only what the matmul beside it does not hide is. A context-parallel ring
  hides each K/V hop behind that step's block of attention;
* **a stage** (:func:`stage_costs`): its layers (dense, MoE, partly frozen: each kind costed
  once), the first stage's embedding and the last stage's head and loss;
* **ZeRO-3 / FSDP** (:func:`overlapped`, :func:`zero3_cost`): each layer's weights are
  all-gathered before its forward and again before its backward, its gradients
  reduce-scattered after; with prefetch the next layer's all-gather runs while this one
  computes, so a layer costs the slower of its compute and its communication, plus the
  first gather and the last scatter;
* **a stage's bytes per step** (:func:`stage_bytes`): what one rank of a stage sends on each
  axis of a course run (fp32, no sequence parallelism), the numbers chapter 06 holds to a
  traced run.

:mod:`edu3d.plan.step` puts the stages into the pipeline schedule and adds data
parallelism and the optimizer. No torch.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from edu3d.config.layout import Layout
from edu3d.config.sections import Batch, Run
from edu3d.model.shapes import ModelSpec
from edu3d.plan import cpu, links, recipes, roofline, trainer_comm
from edu3d.plan.formulas import as_moe, routed_per_token
from edu3d.plan.hardware import Profile
from edu3d.plan.inventory import frozen_share
from edu3d.plan.kernels import Cut, embedding_ops, head_ops, layer
from edu3d.schedules.actions import chunks, placement, stage_rank
from edu3d.schedules.partition import planner_cut


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


def phase_time(ops, comms, phase: str, profile: Profile, mesh: Layout, tp_overlap: bool,
               dtype: str, ranks_per_core: float, exposed: dict, framework: float = 0.0) -> float:
    """Seconds of one phase of a layer: its kernels, plus each collective's exposed part
    (added to ``exposed`` by axis); ``mesh`` places the tp, cp and ep groups."""
    mine = [o for o in ops if o.phase == phase]
    busy = roofline.stretch_time(mine, profile, dtype, ranks_per_core, framework)
    by_name: dict = {}
    for o in mine:
        by_name[o.name] = by_name.get(o.name, 0.0) + roofline.op_time(o, profile, dtype)
    out = busy
    for c in (c for c in comms if c.phase == phase):
        link, n = links.group_link(profile, mesh, c.axis)
        each = links.collective_time(c.kind, c.nbytes, n if c.kind != "send" else 2, link)
        hidden = 0.0
        if c.hides and (c.axis == "cp" or (c.axis == "tp" and tp_overlap)):
            hidden = by_name.get(c.hides, 0.0) / (c.steps if c.axis == "cp" else 1)
        lost = c.steps * max(0.0, each - hidden)
        exposed[c.axis] = exposed.get(c.axis, 0.0) + lost
        out += lost
    return out


@lru_cache(maxsize=8192)
def piece_cost(c: Cut, what: tuple, recompute: str, profile: Profile, mesh: Layout,
               tp_overlap: bool, dtype: str, per_core: float, framework: float,
               trainer: bool = False) -> dict:
    """One piece of a stage per micro-batch (``what``: ``("layer", moe, frozen)``,
    ``("embedding", learned_pos)`` or ``("head", fused_loss)``): phase seconds, exposed
    communication by axis, pure device time, matmul FLOPs and their time; ``trainer``: with
    the collectives edu3d's Trainer issues beyond the textbook's (:mod:`.trainer_comm`).
    Cached: a search's layouts share their layers."""
    if what[0] == "layer":
        ops, comms = layer(c, recompute, *what[1:])
        comms = comms + tuple(trainer_comm.layer_extra(c, comms) if trainer else ())
    elif what[0] == "embedding":
        ops, comms = embedding_ops(c), tuple(
            trainer_comm.embedding_comms(c, what[1]) if trainer else ())
    else:
        ops, comms = head_ops(c, what[1]), tuple(trainer_comm.head_comms(c) if trainer else ())
    row = {"exposed": {}}
    for phase in ("F", "R", "I", "W"):
        row[phase] = phase_time(ops, comms, phase, profile, mesh, tp_overlap, dtype, per_core,
                                row["exposed"], framework)
    mats = [o for o in ops if o.kind == "matmul"]
    row["kernels"] = sum(roofline.op_time(o, profile, dtype) for o in ops) * max(1.0, per_core)
    row["flops"] = sum(o.flops for o in mats)
    row["matmul_time"] = sum(roofline.op_time(o, profile, dtype) for o in mats)
    return row


def stage_costs(spec: ModelSpec, run: Run, profile: Profile, rec: recipes.Recipe) -> tuple:
    """Per global stage: ``{"F", "R", "I", "W"}`` seconds per micro-batch, ``"exposed"`` by
    axis, ``"kernels"`` (pure device time) and ``"flops"`` of its matmuls. They do not depend
    on the data-parallel side of the run (ZeRO, its reduction, the micro-batch count), which
    the cache key leaves out: a search's variants of one layout share them."""
    par = dataclasses.replace(run.parallel, zero=0, grad_reduce="per-microbatch",
                              dp_impl="bucketed", bucket_mb=25.0, prefetch=False)
    key = Run(model=run.model, layout=run.layout, parallel=par, precision=run.precision,
              memory=run.memory, batch=Batch(global_batch=run.layout.dp * run.micro_batch,
                                             microbatches=1))
    return _stage_costs(spec, key, profile, rec)


@lru_cache(maxsize=2048)
def _stage_costs(spec: ModelSpec, run: Run, profile: Profile, rec: recipes.Recipe) -> tuple:
    lay, par = run.layout, run.parallel
    c = cut_of(spec, run, rec)
    moe = as_moe(spec)
    recompute = run.memory.recompute
    parts = planner_cut(spec.n_layers, lay, par)
    per_core = cpu.ranks_per_core(profile, run.world_size)
    mesh = Layout(dp=lay.ep, tp=lay.tp, cp=lay.cp, ep=lay.ep)  # what the layer's groups need
    out = []
    for s, (lo, hi) in enumerate(parts):
        kinds: dict = {}
        for i in range(lo, hi):
            key = (moe_args(spec, run) if moe.is_moe(i) else None,
                   frozen_share(spec, run.memory.freeze, i))
            kinds[key] = kinds.get(key, 0) + 1
        pieces = [(("layer",) + key, n) for key, n in kinds.items()]
        pieces += [(("embedding", spec.learned_pos), 1)] if s == 0 else []
        pieces += [(("head", rec.fused_loss), 1)] if s == len(parts) - 1 else []
        row = {"F": 0.0, "R": 0.0, "I": 0.0, "W": 0.0, "exposed": {}, "kernels": 0.0,
               "flops": 0.0, "matmul_time": 0.0}
        for what, n in pieces:
            cost = piece_cost(c, what, recompute, profile, mesh, par.tp_overlap,
                              run.precision.dtype, per_core, rec.host, rec.name == "edu3d")
            for k in ("F", "R", "I", "W", "kernels", "flops", "matmul_time"):
                row[k] += n * cost[k]
            for axis, v in cost["exposed"].items():
                row["exposed"][axis] = row["exposed"].get(axis, 0.0) + n * v
        row["R"] += (hi - lo) * cpu.checkpoint_overhead(profile, recompute, run.world_size)
        rank = stage_rank(s, lay.pp, placement(par.schedule))
        row["W"] += (cpu.microbatch_overhead(spec, run, profile, rank)  # CPU: DP hooks
                     / chunks(par.schedule, lay.vpp))
        out.append(row)
    return tuple(out)


# ---- ZeRO-3: layer by layer, two streams ------------------------------------------------------
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
    backward), a reduce-scatter of its gradients after, on the dp·cp group (HSDP: a replica
    group's)."""
    if run.parallel.zero < 3 or run.layout.dp * run.layout.cp == 1 or not layers:
        return 0.0, 0.0
    link, n, _ = links.zero_links(profile, run.layout, "dpcp", run.parallel.hsdp)
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


# ---- a stage's bytes on the wire -----------------------------------------------------------------
def stage_bytes(spec: ModelSpec, layout: Layout, m: int, stage: int, rank_params: int,
                global_batch: int = 8, dtype_bytes: int = 4) -> dict[str, float]:
    """Bytes one rank of pipeline ``stage`` sends per step on each axis (``tp pp dp``), for a
    course run: ``m`` micro-batches, ``rank_params`` the parameters the rank holds (its
    stage's, cut by tp), values of ``dtype_bytes``.

    * TP (no sequence parallelism): per layer and micro-batch 2 all-reduces forward and 2
      backward of the activation ``b·s·h``; the first stage adds the vocabulary-parallel
      embedding's forward all-reduce, the last the LM head's backward one (the loss's
      all-reduces of ``b·s`` numbers are left out);
    * PP: per micro-batch an activation forward and a gradient back across each boundary;
    * DP, ZeRO-1: the gradients reduce-scattered and the parameters all-gathered once."""
    b = global_batch // layout.dp // m
    act = b * spec.seq_len * spec.d_model * dtype_bytes
    calls = 4 * spec.n_layers / layout.pp + (stage == 0) + (stage == layout.pp - 1)
    boundaries = (stage > 0) + (stage < layout.pp - 1)
    dp = rank_params * dtype_bytes
    return {"tp": calls * m * links.wire_bytes("all_reduce", act, layout.tp),
            "pp": m * act * boundaries if layout.pp > 1 else 0.0,
            "dp": (links.wire_bytes("reduce_scatter", dp, layout.dp)
                   + links.wire_bytes("all_gather", dp, layout.dp))}
