"""Which layout for G GPUs? Every valid choice, ranked by an estimated step time.

After reading this file you should understand the practitioners' decision tree as numbers:

* **tensor parallelism inside a node**: TP talks four times per layer and micro-batch (two
  all-reduces forward, two backward), so it stays on the fast links (NVLink); beyond one
  node it pays the slow ones for every layer;
* **pipeline parallelism for depth**: when the model's state still does not fit after TP,
  cut its layers into stages; it sends only one activation per micro-batch and stage
  boundary, so it crosses nodes cheaply, but it idles ``(p-1)/(m+p-1)`` of the step (the
  bubble), which more micro-batches shrink;
* **data parallelism for the rest**, with the ZeRO stage chosen by memory: ZeRO-1 shards
  the 12 bytes per parameter of optimizer state at no extra traffic; ZeRO-2/3 save more but
  are not combined with pipelines (DeepSpeed refuses). They reduce-scatter every micro-batch
  (``grad_reduce="per-microbatch"``: their saving kept, ``m`` reduce-scatters a step; ZeRO-3
  also ``2m`` all-gathers) or once per step (``"per-step"``: full gradients held, one
  reduce-scatter); the search weighs both, and the model's overlap decides;
* **recomputation** trades compute for activation memory: selective (the attention core) is
  almost free, full costs a third more compute;
* **the micro-batch**: a bigger one makes bigger matmuls (closer to the GPU's peak) and fewer
  kernel launches and messages per token, but holds more activations, and with a pipeline
  fewer micro-batches mean a bigger bubble.

The cost model (:func:`step_time`) is the performance model's (:func:`edu3d.plan.step.predict`
on the cluster's hardware profile): each op's time from its shape on a roofline, each
collective on its link with latency and bandwidth, the pipeline schedule replayed, gradient
buckets overlapped with the backward. Its parts, in seconds on the slowest pipeline rank:

``compute``   the kernels (matmuls at the efficiency their size reaches, attention,
              memory-bound ops), recomputation included;
``overhead``  host launches the kernels did not hide;
``bubble``    idle time waiting for other pipeline stages;
``tp``        tensor parallelism's exposed collectives (all of them, unless ``tp_overlap``);
``pp``        what the sends between stages add to the pipeline (latency and bandwidth);
``dp``        the gradient reduction (and ZeRO's gathers) the backward did not hide;
``edp`` ``ep`` ``cp``  the experts' reduction, expert parallelism's all-to-alls, context
              parallelism's K/V exchanges, exposed;
``optimizer`` AdamW over this rank's shard (memory-bound).

A layout fits when its fullest rank's peak (:func:`edu3d.plan.estimate.estimate`, or the
cluster's recipe, :mod:`edu3d.plan.recipes`) is at most ``usable`` of the GPU's memory (the
rest: CUDA context, allocator fragmentation). ``traffic`` gives the bytes each axis sends.
"""

from __future__ import annotations

import itertools
import math

from edu3d.plan.fit import gb
from edu3d.plan import formulas as memory
from edu3d.plan import zero_modes
from edu3d.config.sections import Run
from edu3d.plan.estimate import MAX_GPUS, estimate, held, setup
from edu3d.plan.formulas import as_moe, divisors
from edu3d.plan.cluster import GB, Cluster, profile_of
from edu3d.plan.recipes import memory as recipe_memory
from edu3d.plan.inventory import frozen_active
from edu3d.plan.roofline import peak
from edu3d.plan.step import SEARCH_REPLAY, model_flops_per_token, predict
from edu3d.model.shapes import ModelSpec

AXES = ("compute", "bubble", "tp", "pp", "dp")  # printed even when zero
CP_MIN_TOKENS = 4096  # below this many tokens a rank, the search tries no context parallelism
MAX_WORK = 2_500_000  # layouts x layers x (1 + experts/64) one search weighs: a few seconds
KEEP = 8  # the fastest layouts a search predicts exactly (branch and bound below them)
PREDICT_WORK = 100_000  # predictions x layers x (1 + experts/64): a prediction is ~0.1 ms a
# layer, so a search predicts in a few seconds at most (from the lowest floors up)


def traffic(spec: ModelSpec, run: Run) -> dict[str, float]:
    """Bytes one rank sends per step, by axis, in 16-bit values; per-block terms times the
    blocks of a pipeline rank on average (``L/p``) and the ``m`` micro-batches:

    ``tp``  ring all-reduces of ``b·(s/cp)·h``, ``2(t-1)/t`` of it each: attention 2 and a
            dense MLP 2 (forward and backward), one more each under full recomputation; a
            MoE half none (it runs whole on every tp rank);
    ``pp``  per micro-batch an activation forward and a gradient back, ``b·(s/cp)·h``
            (``/t`` with SP);
    ``dp``  :func:`~edu3d.plan.zero_modes.dp_wire_bytes` of the rank's dense 16-bit
            weights and gradients, ``N = dp·cp``, for its ZeRO stage, ``grad_reduce`` and
            ``m``; ``edp``: the routed experts' over ``dp·cp/ep``; under HSDP (``--hsdp R``)
            both within a replica group, and ``dp_replicate``/``edp_replicate`` the
            all-reduce of the gradient shard across the groups
            (:func:`~edu3d.plan.zero_modes.hsdp_traffic`);
    ``ep``  :func:`~edu3d.plan.formulas.ep_bytes` per MoE block (x1.5 with full
            recomputation: its forward runs again);
    ``cp``  :func:`~edu3d.plan.formulas.cp_bytes` per block (x(4cp-3)/(3cp-2) ring, x3/2
            others with full recomputation: the forward's exchanges run again)."""
    lay, par = run.layout, run.parallel
    spec = as_moe(spec)
    L, h, s, b, t, p, m = (spec.n_layers, spec.d_model, spec.seq_len, run.micro_batch, lay.tp,
                           lay.pp, run.microbatches)
    full = run.memory.recompute == "full"
    msg = 2 * b * s * h / lay.cp
    calls = (3 if full else 2) * (2 * L - spec.moe_layers)
    out = {"tp": calls * 2 * (t - 1) / t * msg / p * m if t > 1 else 0.0,
           "pp": 2 * m * msg / (t if par.sp else 1) if p > 1 else 0.0}
    for axis, n, experts in (("dp", lay.dp * lay.cp, False), ("edp", lay.edp, True)):
        psi = max(held(spec, run, r, experts) for r in range(p))
        out[axis] = zero_modes.dp_wire_bytes(psi, n, par.zero, par.grad_reduce, m)
    if par.hsdp > 1:  # ZeRO within a replica group, one all-reduce of the shard across them
        by = zero_modes.hsdp_traffic(spec, run)
        out.update({f"{e}dp": by.get(f"{e}shard", 0.0) for e in ("", "e")},
                   dp_replicate=by["replicate"], edp_replicate=by.get("ereplicate", 0.0))
    k = memory.routed_per_token(spec)
    out["ep"] = (memory.ep_bytes(b * s // lay.cp, k, h, lay.ep) * (1.5 if full else 1)
                 * spec.moe_layers / p * m)
    c = lay.cp
    redo = ((4 * c - 3) / (3 * c - 2) if par.cp_impl == "ring" else 1.5) if full else 1
    out["cp"] = (memory.cp_bytes(par.cp_impl, s, b, h, lay.cp, h * spec.kv_heads // spec.n_heads,
                                 t) * redo * L / p * m if lay.cp > 1 else 0.0)
    return out


def step_time(spec: ModelSpec, run: Run, cl: Cluster, prediction: bool = False) -> dict:
    """Seconds per step by part (:data:`edu3d.plan.step.PARTS`: ``compute``, ``overhead``,
    ``bubble`` and each axis's exposed communication, ``optimizer``) and ``total``, from
    :func:`edu3d.plan.step.predict` on the cluster's profile and recipe (``prediction``:
    also the :class:`~edu3d.plan.step.Prediction` itself, as ``"prediction"``)."""
    pred = predict(spec, run, profile_of(cl), cl.recipe, memory=False,
                   replay_limit=SEARCH_REPLAY)
    out: dict = dict(pred.parts, total=pred.step_time)
    if prediction:
        out["prediction"] = pred
    return out


def candidates(spec: ModelSpec, cl: Cluster, global_batch: int, precision: str = "bf16",
               schedule: str = "1f1b", micro_batches=(1, 2, 4, 8), cp_impl: str = "ring",
               freeze: tuple = ()):
    """Every (dp, cp, ep, tp, pp, zero, grad-reduce, recompute, micro-batch) choice the model
    and batch allow. Cheaply: ``cp > 1`` only while each rank keeps at least
    ``CP_MIN_TOKENS`` of a sequence, ``ep > 1`` only for a mixture of experts (every ``ep``
    dividing both ``E`` and ``dp·cp``), ``per-step`` only where it differs (ZeRO-2/3 with
    several micro-batches), op-level recomputation only with a framework's recipe."""
    experts = as_moe(spec).experts
    modes = ("none", "selective", "full") + (("op",) if cl.recipe != "edu3d" else ())
    for tp in divisors(cl.gpus):
        if spec.n_heads % tp:
            continue
        for pp in divisors(cl.gpus // tp):
            if pp > spec.n_layers:
                continue
            for cp in divisors(cl.gpus // (tp * pp)):
                if cp > 1 and (spec.seq_len % cp or spec.seq_len // cp < CP_MIN_TOKENS or
                               cp_impl == "ulysses" and spec.n_heads % (cp * tp)):
                    continue
                dp = cl.gpus // (tp * pp * cp)
                eps = [e for e in divisors(dp * cp) if experts % e == 0] if experts else [1]
                for ep, b in ((e, b) for e in eps for b in micro_batches):
                    if global_batch % (dp * b):
                        continue
                    m = global_batch // (dp * b)
                    for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)) if dp * cp > 1 else (0,):
                        reduce = ("per-microbatch", "per-step") if zero >= 2 and m > 1 else (
                            "per-microbatch",)
                        for rec, mode in itertools.product(modes, reduce):
                            yield setup(dp=dp, tp=tp, pp=pp, zero=zero, microbatches=m,
                                        micro_batch=b, schedule=schedule, sp=tp > 1,
                                        recompute=rec, precision=precision, ep=ep, cp=cp,
                                        cp_impl=cp_impl, freeze=freeze, grad_reduce=mode)


def memory_of(spec: ModelSpec, run: Run, cl: Cluster) -> dict:
    """The fullest rank's bytes as :func:`~edu3d.plan.estimate.estimate` gives them (its
    ``*_bytes`` keys), from the cluster's recipe: edu3d's own estimate, or a framework's
    (:func:`edu3d.plan.recipes.memory`: ``total_bytes`` is then what the device must hold)."""
    if cl.recipe == "edu3d":
        return estimate(spec, run)
    mem = recipe_memory(spec, run, cl.recipe, profile_of(cl))
    out = {f"{c}_bytes": mem[c] for c in ("params", "grads", "optimizer", "activations",
                                          "comm", "transient")}
    out.update(total_bytes=mem["device"], state_bytes=mem["params"] + mem["grads"] +
               mem["optimizer"])
    return out


def search(spec: ModelSpec, cl: Cluster, global_batch: int | None = None,
           precision: str = "bf16", schedule: str = "1f1b", cp_impl: str = "ring",
           freeze: tuple = ()) -> list[dict]:
    """Every candidate with its peak memory and step time, those that fit first, fastest
    first: ``{"setup", "memory", "time", "fits", "prediction"}``; ``freeze``: the globs of
    ``--freeze``, the same in every candidate (:mod:`edu3d.plan.inventory`). Every layout
    is predicted (:func:`step_time`), unless there are more than ``PREDICT_WORK`` / layers:
    then the fastest ``KEEP`` that fit are, found by branch and bound over their floors (at
    most that many predictions, lowest floors first, so a search of a huge cluster stays
    bounded and its top is the best of those). A row left out (or that does not fit) has
    ``"prediction": None``, ``time["total"]`` infinite and only its :func:`floor` as
    ``time["floor"]``, and sorts after them (:func:`timed` predicts it on demand)."""
    if not 1 <= cl.gpus <= MAX_GPUS:
        raise ValueError(f"{cl.gpus} GPUs: the search takes 1 to {MAX_GPUS}")
    gb = global_batch or spec.global_batch
    # an estimate costs about a microsecond per layer, and per 64 experts of a layer
    most = int(MAX_WORK / (spec.n_layers * (1 + as_moe(spec).experts / 64)))
    every = list(itertools.islice(candidates(spec, cl, gb, precision, schedule,
                                             cp_impl=cp_impl, freeze=freeze), most + 1))
    if len(every) > most:
        raise ValueError(f"{cl.gpus} GPUs allow more than {most} layouts of {spec.name} (the "
                         f"search weighs at most {MAX_WORK:,} layouts x layers x (1 + "
                         "experts/64)); give one layout (--dp --tp --pp) to weigh it alone, "
                         "or fewer GPUs")
    rows = []
    for run in every:
        try:
            mem = memory_of(spec, run, cl)
        except ValueError:
            continue
        rows.append({"setup": run, "memory": mem, "prediction": None,
                     "time": {"total": math.inf, "floor": floor(spec, run, cl)},
                     "fits": mem["total_bytes"] <= cl.usable * cl.gpu_mem_gb * GB})
    # more fitting layouts than a search may predict: branch and bound, from the lowest
    # floor up, until no floor left can enter the KEEP fastest (an exact top KEEP)
    fitting = sorted((r for r in rows if r["fits"]), key=lambda r: r["time"]["floor"])
    best: list[float] = []
    limit = max(KEEP, int(PREDICT_WORK / (spec.n_layers * (1 + as_moe(spec).experts / 64))))
    bound = len(rows) > limit  # a small search predicts every layout, fitting or not
    for count, row in enumerate(fitting if bound else rows):
        if bound and (count >= limit or len(best) >= KEEP and row["time"]["floor"] >
                      best[KEEP - 1]):
            break
        try:
            timed(spec, row, cl)
        except ValueError:
            row["fits"] = False
            continue
        if not row["fits"]:
            continue
        best = sorted(best + [row["time"]["total"]])[:KEEP]
    rows.sort(key=lambda r: (not r["fits"], r["time"]["total"], r["memory"]["total_bytes"]))
    return rows


def floor(spec: ModelSpec, run: Run, cl: Cluster) -> float:
    """A lower bound of a layout's step time: the matmul FLOPs each rank must do (``6N`` per
    token, the head included, recomputation's extra forward) at the best matmul rate, the
    causal attention core at FlashAttention's rate, stretched by the pipeline's ramp
    (``(p-1)/(v·m)``, a third of it for ZB-H1). The search's branch and bound predicts no
    layout whose floor is above the ones it keeps."""
    prof = profile_of(cl)
    moe, lay, mode = as_moe(spec), run.layout, run.memory.recompute
    n = moe.layer_params(active=True) - frozen_active(spec, tuple(run.memory.freeze)) / 3
    mats = 6 * (n + spec.d_model * spec.vocab_size) + {"op": 1, "full": 2}.get(mode, 0) * n
    attn = 2 * spec.n_layers * spec.d_model * spec.seq_len * (
        3.5 + (mode in ("selective", "full")))  # causal forward, 2.5x backward, recomputed
    tokens = run.batch.global_batch * spec.seq_len / run.world_size
    rate = peak(prof, run.precision.dtype) * prof.sustained
    busy = tokens * (mats / (rate * prof.matmul_efficiency) + attn / (
        rate * prof.attention_efficiency))
    v = lay.vpp if run.parallel.schedule == "interleaved" else 1
    ramp = (lay.pp - 1) / (v * run.microbatches) * (1 / 3 if run.parallel.schedule == "zb-h1"
                                                     else 1)
    return busy * (1 + ramp)


def timed(spec: ModelSpec, row: dict, cl: Cluster) -> dict:
    """``row`` with its predicted ``time`` and ``prediction`` (predicted now if not yet)."""
    if row["prediction"] is None:
        time = step_time(spec, row["setup"], cl, prediction=True)
        row["prediction"] = time.pop("prediction")
        row["time"] = dict(time, floor=row["time"]["floor"])
    return row


def reasons(spec: ModelSpec, cl: Cluster, rows: list[dict]) -> list[str]:
    """The recommended layout (``rows[0]``) explained in words, against its neighbours."""
    best = rows[0]
    run, mem, tm = best["setup"], best["memory"], best["time"]
    lay, par, recompute = run.layout, run.parallel, run.memory.recompute
    budget = cl.usable * cl.gpu_mem_gb * GB
    by_key = {r["setup"]: r for r in rows}
    state16 = 16 * spec.num_params()

    def other(**change):
        row = by_key.get(run.replace(**change))
        return timed(spec, row, cl) if row is not None else None

    out = [f"the model has {spec.num_params() / 1e9:.2f} B parameters: {gb(state16)} of "
           f"weights, gradients and Adam state at 16 bytes each, against {gb(budget)} usable "
           "per GPU, so its state must be cut"]
    inside = lay.tp <= cl.gpus_per_node
    out.append(f"tp={lay.tp}: tensor parallelism {'inside one node' if inside else 'across nodes'}"
               f" ({'NVLink' if inside else 'InfiniBand'}): it all-reduces "
               f"4 times per layer and micro-batch, {tm['tp']:.2f} s per step; with sequence "
               "parallelism the activations are split too" if lay.tp > 1 else
               "tp=1: the layers are small enough not to need tensor parallelism")
    if lay.pp > 1:
        q, r = divmod(spec.n_layers, lay.pp)
        cut = f"{q} layers per stage" if not r else \
            f"{r} stages of {q + 1} layers and {lay.pp - r} of {q}"
        out.append(f"pp={lay.pp}: {cut} bring the fullest "
                   f"rank to {gb(mem['total_bytes'])} (weights {gb(mem['params_bytes'])}, "
                   f"activations {gb(mem['activations_bytes'])}); the bubble "
                   f"(p-1)/(m+p-1) = {(lay.pp - 1) / (run.microbatches + lay.pp - 1):.1%} with "
                   f"m={run.microbatches} micro-batches of {run.micro_batch}")
    out.append(micro_batch_reason(run, best, other))
    moe = as_moe(spec)
    if moe.experts:
        ep1 = other(ep=1)
        out.append(f"ep={lay.ep}: each GPU holds {moe.experts // lay.ep} of the {moe.experts} "
                   f"experts of each MoE block, " + (
                       f"replicated over {lay.edp} GPUs (ZeRO shards them there)"
                       if lay.edp > 1 else "on no other GPU of its pipeline stage")
                   + f"; its all-to-alls send {traffic(spec, run)['ep'] / 1e9:.1f} GB "
                   f"per step ({tm['ep']:.2f} s)" + ("" if ep1 is None else
                   f"; with every expert on every GPU (ep=1) the fullest rank needs "
                   f"{gb(ep1['memory']['total_bytes'])}"))
    if lay.cp > 1:
        out.append(f"cp={lay.cp} ({par.cp_impl}): each GPU keeps {spec.seq_len // lay.cp} "
                   f"tokens of a sequence, activations /{lay.cp}, for {tm['cp']:.2f} s of K/V "
                   "exchange")
    whom = "every GPU holds" if lay.tp * lay.pp == 1 else "the remaining GPUs hold"
    every = "every micro-batch" if par.zero >= 2 and run.microbatches > 1 else "once per step"
    out.append(f"dp={lay.dp}: {whom} a replica of the model; gradients are reduced "
               f"{every} ({tm['dp']:.2f} s)" if lay.dp > 1 else
               "dp=1: every GPU is needed to hold one copy of the model")
    if lay.dp > 1:
        z0 = other(zero=0)
        if par.zero == 0:
            out.append("ZeRO-0: the state fits replicated; no sharding needed")
        else:
            saved = z0["memory"]["total_bytes"] - mem["total_bytes"] if z0 else 0.0
            out.append(
                f"ZeRO-{par.zero}: shards the optimizer state"
                + (" and gradients" if par.zero >= 2 else "")
                + (" and weights" if par.zero == 3 else "") +
                f" over dp={lay.dp}, {gb(saved)} less per GPU"
                + ("" if z0 is None or z0["fits"] else " (without it: does not fit)")
                + ("; ZeRO-1 moves the same bytes as plain DP (2Ψ)" if par.zero == 1 else "")
                + (f"; reduce-scattering each of the {run.microbatches} micro-batches keeps "
                   f"1/{lay.dp} of the gradients" if par.zero >= 2 else "")
                + ("; ZeRO-2/3 are not combined with pipelines" if lay.pp > 1 else ""))
    rivals = [r for r in rows if r["fits"] and r["setup"].layout.tp != lay.tp]
    if rivals:
        r, rl = timed(spec, rivals[0], cl), rivals[0]["setup"].layout
        out.append(f"the fastest layout with tp={rl.tp} (pp={rl.pp}, dp={rl.dp}) takes "
                   f"{r['time']['total']:.2f} s: its tp traffic is "
                   f"{r['time']['tp']:.2f} s against {tm['tp']:.2f} s, because a GPU's share of "
                   "TP all-reduces grows with the layers and micro-batches it runs")
    none = other(recompute="none")
    if recompute == "none":
        out.append(f"no recomputation: activations ({gb(mem['activations_bytes'])}) fit")
    else:
        gap = (f"without it the fullest rank needs {gb(none['memory']['total_bytes'])}"
               if none else "")
        fits = none is not None and none["fits"]
        out.append(f"{recompute} recomputation: {gap}"
                   + (" (fits, but a larger micro-batch or fewer stages pays more)" if fits
                      else f", more than {gb(budget)}")
                   + (f"; it costs {tm['compute'] / max(none['time']['compute'], 1e-12) - 1:.1%}"
                      " more compute" if none else ""))
    pred = best["prediction"]
    out.append(f"estimated step {tm['total']:.2f} s: " + ", ".join(
        f"{k} {v:.2f}" for k, v in tm.items() if k != "total" and (v or k in AXES))
        + f"; {pred.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {pred.mfu:.0%} "
        f"(predicted, on {cl.hardware})")
    return out


def micro_batch_reason(run: Run, best: dict, other) -> str:
    """Why this micro-batch size, in the model's terms: its matmuls' efficiency, launches
    and bubble against the neighbouring size (``other(**change)`` finds a row)."""
    b, m, pred = run.micro_batch, run.microbatches, best["prediction"]
    bubble = best["time"]["bubble"] / best["time"]["total"]
    if b > 1:
        base = other(microbatches=m * b)
        if base is None:
            return f"micro-batch {b}: matmuls at {pred.matmul_efficiency:.0%} of peak"
        bp, bt = base["prediction"], base["time"]
        return (f"micro-batch {b}: matmuls at {pred.matmul_efficiency:.0%} of peak instead of "
                f"{bp.matmul_efficiency:.0%} at micro-batch 1, {bt['overhead']:.2f} s of "
                f"launches not hidden there; the bubble goes from {bt['bubble'] / bt['total']:.0%}"
                f" to {bubble:.0%} of the step ({bt['total']:.2f} s -> {best['time']['total']:.2f}"
                " s)" + ("" if base["fits"] else "; micro-batch 1 would not even fit"))
    bigger = other(microbatches=m // 2) if m % 2 == 0 else None
    if bigger is None:
        return (f"micro-batch 1: matmuls at {pred.matmul_efficiency:.0%} of peak; no larger "
                "micro-batch divides the batch")
    why = ("does not fit" if not bigger["fits"] else
           f"takes {bigger['time']['total']:.2f} s: its bubble is "
           f"{bigger['time']['bubble'] / bigger['time']['total']:.0%} of the step against "
           f"{bubble:.0%}")
    return (f"micro-batch 1: matmuls at {pred.matmul_efficiency:.0%} of peak; micro-batch 2 "
            f"(matmuls at {bigger['prediction'].matmul_efficiency:.0%}) {why}")
