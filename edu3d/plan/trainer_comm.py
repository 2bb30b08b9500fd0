"""The collectives edu3d's own Trainer issues around the layers, counted as it issues them.

After reading this file you should understand why the *number* of collectives matters as
much as their bytes where each one has a long latency (gloo on a CPU: 0.15-0.35 ms a step
of a ring, against NCCL's microseconds):

* **ZeRO-1/2 reduce unit by unit** (:func:`zero_reduce`): edu3d's ZeRO keeps one flat buffer
  per unit (a block, the embedding, the final norm: :func:`edu3d.plan.inventory.units`) and
  reduce-scatters the gradients and all-gathers the updated weights one unit at a time, each
  a collective of its own; ZeRO-2 with ``grad_reduce="per-microbatch"`` (the default)
  reduce-scatters every unit after *every* micro-batch's backward, synchronously in its
  hooks. A tiny model on 2 ranks: 6 reduce-scatters and 6 all-gathers a step, not one each;
* **tensor parallelism around the layers** (:func:`layer_extra`, :func:`embedding_comms`,
  :func:`head_comms`): :func:`edu3d.plan.kernels.layer_comms` counts a layer's f/g pairs (the
  textbook's 4 per layer); edu3d's sequence parallelism also re-gathers each column layer's
  input in backward (its weight gradient needs every token; only this rank's were kept), the
  embedding's output is reduce-scattered (all-reduced without SP) and the head's input
  gathered, and the vocabulary-parallel loss all-reduces two numbers per token. A tiny model
  at tp=2 with SP: 28 all-gathers and 18 reduce-scatters a micro-batch, not 16 and 16;
* **the step's bookkeeping** (:func:`step_comms`, :func:`bookkeeping`): every parallel step
  all-reduces the loss over every rank; the squared gradient norm is all-reduced over every
  rank under ZeRO or EP, over the tp x pp ranks otherwise (none for plain data parallelism,
  whose replicas hold equal gradients); under SP the norms' and row biases' partial
  gradients are summed over tp once a step;
* **ZeRO-3's other units** (:func:`zero3_units`): the layers' gathers and scatters are timed
  in :func:`edu3d.plan.step.zero3_cost`; the embedding's and the final norm's units are
  gathered twice (forward, backward) and scattered once per micro-batch as well.

:func:`count` lists them all for one rank and step, as a traced run records them (the
test holds it to one). No torch here.
"""

from __future__ import annotations

import math
from collections import Counter

from edu3d.config.sections import Run
from edu3d.model.shapes import ModelSpec
from edu3d.plan import links
from edu3d.plan.hardware import Profile
from edu3d.plan.inventory import units
from edu3d.plan.kernels import Comm, Cut, layer_comms


def unit_elements(spec: ModelSpec, run: Run, pp_rank: int, experts: bool) -> list[int]:
    """Trainable elements of each ZeRO unit pipeline rank ``pp_rank`` holds (one tp rank's)."""
    return [sum(k for k, _ in tensors) for _, tensors in units(spec, run, pp_rank, experts)]


def zero_reduce(spec: ModelSpec, run: Run, pp_rank: int, experts: bool, reduce_bytes: int,
                gather_bytes: int, n: int, link: links.Link) -> tuple[float, float]:
    """Seconds of ZeRO-1/2's gradient reduce-scatters in a step (every micro-batch's, for
    ZeRO-2 per micro-batch) and of its weight all-gathers, unit by unit; values of
    ``reduce_bytes`` and ``gather_bytes`` (a course model's are fp32 whatever the autocast:
    4 each)."""
    if spec.course:
        reduce_bytes = gather_bytes = 4
    sizes = [k for k in unit_elements(spec, run, pp_rank, experts) if k]
    times = 1
    if run.parallel.zero == 2 and run.parallel.grad_reduce == "per-microbatch":
        times = run.microbatches
    reduce = times * sum(links.collective_time("reduce_scatter", reduce_bytes * k, n, link)
                         for k in sizes)
    gather = sum(links.collective_time("all_gather", gather_bytes * k, n, link) for k in sizes)
    return reduce, gather


# ---- tensor parallelism beyond the layers' f and g ---------------------------------------------------
def layer_extra(c: Cut, comms) -> list[Comm]:
    """SP: each all-gather before a column layer runs again in backward (phase ``W``), so the
    weight gradient sees every token."""
    return [Comm("tp", "all_gather", m.nbytes, "W") for m in comms
            if c.sp and m.axis == "tp" and m.kind == "all_gather" and m.phase == "F"]


def embedding_comms(c: Cut, learned_pos: bool) -> list[Comm]:
    """The first stage's tensor-parallel collectives per micro-batch: the vocabulary-parallel
    lookup's partial rows summed (SP: reduce-scattered over the sequence, gathered back in
    backward), and under SP the position table's gradient gathered (``s·h``)."""
    if c.tp == 1:
        return []
    x = c.act * c.tokens * c.h
    if not c.sp:
        return [Comm("tp", "all_reduce", x, "F")]
    return [Comm("tp", "reduce_scatter", x, "F"), Comm("tp", "all_gather", x, "I")] + (
        [Comm("tp", "all_gather", c.act * c.seq * c.h, "W")] if learned_pos else [])


def head_comms(c: Cut) -> list[Comm]:
    """The last stage's per micro-batch: the head's input gathered (SP; and again for its
    weight gradient, its gradient reduce-scattered back), or its input gradient all-reduced;
    the vocabulary-parallel cross entropy's two all-reduces per token (max, sum of exps)."""
    if c.tp == 1:
        return []
    x = c.act * c.tokens * c.h
    loss = [Comm("tp", "all_reduce", 4 * c.tokens, "F"), Comm("tp", "all_reduce", 8 * c.tokens,
                                                              "F")]
    if not c.sp:
        return [Comm("tp", "all_reduce", x, "I")] + loss
    return [Comm("tp", "all_gather", x, "F"), Comm("tp", "reduce_scatter", x, "I"),
            Comm("tp", "all_gather", x, "W")] + loss


# ---- once a step --------------------------------------------------------------------------------
def step_comms(spec: ModelSpec, run: Run) -> list[tuple[str, str, float, int]]:
    """``(group, kind, bytes, ranks)`` of the collectives a rank issues once a step outside
    the layers: the loss (``"loss"``: edu3d leaves it out of the trace), the gradient norm,
    SP's partial gradients (norm gains and biases, row biases: ``(6L/pp + 2)·h`` values)."""
    lay, par = run.layout, run.parallel
    n = run.world_size
    if n == 1:
        return []
    out = [("loss", "all_reduce", 4, n)]
    if par.zero or lay.ep > 1:
        out.append(("world", "all_reduce", 8, n))
    elif lay.tp * lay.pp > 1:
        out.append(("mp", "all_reduce", 8, lay.tp * lay.pp))
    if par.sp and lay.tp > 1:
        out.append(("tp", "all_reduce", 4 * spec.d_model * (6 * spec.n_layers // lay.pp + 2),
                    lay.tp))
    return out


def bookkeeping(spec: ModelSpec, run: Run, profile: Profile) -> float:
    """Seconds of :func:`step_comms` (0 for one rank)."""
    n = run.world_size
    link = links.link_for(profile, 1 if n <= profile.gpus_per_node else 2, n)
    return sum(links.collective_time(kind, nbytes, ranks, link)
               for _, kind, nbytes, ranks in step_comms(spec, run))


def zero3_units(spec: ModelSpec, run: Run, pp_rank: int, gather_bytes: int, reduce_bytes: int,
                n: int, link: links.Link) -> float:
    """Seconds a step of ZeRO-3 spends on the units that are not blocks (embedding, final
    norm, tied matrix): gathered before forward and backward, scattered after, per
    micro-batch (exposed: nothing computes beside them)."""
    return run.microbatches * sum(
        2 * links.collective_time("all_gather", gather_bytes * k, n, link)
        + links.collective_time("reduce_scatter", reduce_bytes * k, n, link)
        for k in other_units(spec, run, pp_rank))


def other_units(spec: ModelSpec, run: Run, pp_rank: int) -> list[int]:
    """Elements of each ZeRO unit of pipeline rank ``pp_rank`` that is not a block."""
    return [k for name, tensors in units(spec, run, pp_rank, False)
            if not name.startswith("block") for k in [sum(e for e, _ in tensors)] if k]


# ---- every collective of a step, counted -----------------------------------------------------------
def count(spec: ModelSpec, run: Run, c: Cut, pp_rank: int, layers: int, first: bool,
          last: bool) -> Counter:
    """``{(group, kind): calls}`` that pipeline rank ``pp_rank`` (``layers`` dense layers of
    cut ``c``; the ``first`` and ``last`` stage's pieces) issues in one step of a dense model,
    as its trace records them: tensor parallelism, data parallelism and ZeRO, the gradient
    norm and SP's partial gradients (the loss's all-reduce is left out of the trace, and the
    pipeline's sends are the schedule's: :mod:`edu3d.schedules`)."""
    lay, par, m = run.layout, run.parallel, run.microbatches
    out: Counter = Counter()
    comms = list(layer_comms(c, recompute=run.memory.recompute))
    per_mb = layers * (comms + layer_extra(c, comms))
    per_mb += (embedding_comms(c, spec.learned_pos) if first else []) + (
        head_comms(c) if last else [])
    for comm in per_mb:
        out[(comm.axis, comm.kind)] += m * comm.steps
    dp = lay.dp * lay.cp
    if dp > 1:
        sizes = unit_elements(spec, run, pp_rank, False)
        if par.zero == 0:
            out[("dp", "all_reduce")] += max(1, math.ceil(4 * sum(sizes)
                                                          / (par.bucket_mb * 2**20)))
        elif par.zero in (1, 2):
            times = m if par.zero == 2 and par.grad_reduce == "per-microbatch" else 1
            out[("dp", "reduce_scatter")] += times * len(sizes)
            out[("dp", "all_gather")] += len(sizes)
        else:
            out[("dp", "all_gather")] += 2 * m * len(sizes)
            out[("dp", "reduce_scatter")] += m * len(sizes)
    for group, kind, _, _ in step_comms(spec, run):
        if group != "loss":
            out[(group, kind)] += 1
    return out
