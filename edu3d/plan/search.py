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
  are not combined with pipelines (DeepSpeed refuses), and reduce-scatter every micro-batch
  (``grad_reduce="per-microbatch"``: their saving kept, ``m`` reduce-scatters a step; ZeRO-3
  also ``2m`` all-gathers). The search leaves ``"per-step"`` out: it keeps ZeRO-1's full
  gradients, so ZeRO-1 (same traffic, ``2Ψ/N`` less) beats ZeRO-2 per-step, and ZeRO-3
  per-step holds more and sends more than ZeRO-1;
* **recomputation** trades compute for activation memory: selective (the attention core) is
  almost free, full costs a third more compute.

The cost model (:func:`step_time`), stated so it can be argued with:

``compute``  tokens per step x (6N + 12·L·h·s) FLOPs (PaLM's count, N without embeddings),
             plus a forward again for recomputation (full: 2N + 4·L·h·s per token;
             selective: the attention core, 4·L·h·s), over G GPUs at ``peak x MFU``;
``bubble``   compute x (p-1)/m (1F1B, GPipe), (p-1)/(v·m) interleaved, a third of 1F1B's
             for ZB-H1;
``tp``       per micro-batch and layer of the stage, 4 ring all-reduces (6 with full
             recomputation) of ``b·s·h`` 16-bit values: ``2(t-1)/t`` of it each, over NVLink
             when the tp group fits in a node, else InfiniBand;
``pp``       per micro-batch, one activation forward and one gradient back, ``b·s·h``
             values (``/t`` with SP), over InfiniBand when stages sit on different nodes;
``dp``       :func:`edu3d.plan.zero_modes.dp_wire_bytes` of the rank's 16-bit weights and
             gradients (Ψ/(t·p)): ``2(N_d-1)/N_d`` of them a step (DDP, ZeRO-1),
             ``(m+1)(N_d-1)/N_d`` (ZeRO-2) or ``3m(N_d-1)/N_d`` (ZeRO-3) reducing every
             micro-batch, over InfiniBand when the dp group spans nodes. Frozen
             parameters (``--freeze``) are neither reduced nor sharded: Ψ is the
             trainable ones (:func:`~edu3d.plan.inventory.held`), and a token computes
             no weight gradient for them: ``2·N_frozen`` fewer FLOPs per token
             (:func:`~edu3d.plan.inventory.frozen_active`; their input gradients are
             still counted, as autograd skips those only for a frozen prefix).

Nothing overlaps in this model (pessimistic for DP, whose buckets overlap backward in
practice). A layout fits when its fullest rank's peak (:func:`edu3d.plan.estimate.estimate`) is
at most ``usable`` of the GPU's memory (the rest: CUDA context, allocator fragmentation).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from edu3d.plan.fit import gb
from edu3d.plan import formulas as memory
from edu3d.plan import zero_modes
from edu3d.config.sections import Run
from edu3d.plan.estimate import MAX_GPUS, estimate, held, setup
from edu3d.plan.formulas import as_moe, divisors
from edu3d.plan.inventory import frozen_active
from edu3d.model.shapes import ModelSpec

GB = 1e9
AXES = ("compute", "bubble", "tp", "pp", "dp")  # printed even when zero
CP_MIN_TOKENS = 4096  # below this many tokens a rank, the search tries no context parallelism
MAX_WORK = 2_500_000  # layouts x layers x (1 + experts/64) one search weighs: a few seconds


@dataclass(frozen=True)
class Cluster:
    """The machine the cost model assumes (defaults: H100 SXM nodes of 8)."""

    gpus: int
    gpu_mem_gb: float = 80.0
    gpus_per_node: int = 8
    peak_tflops: float = 989.0  # H100 SXM dense bf16
    mfu: float = 0.45
    intra_gbps: float = 300.0  # NVLink, per GPU, GB/s of ring bandwidth
    inter_gbps: float = 25.0  # one 200 Gb/s InfiniBand NIC per GPU
    usable: float = 0.9

    def describe(self) -> str:
        return (f"{self.gpus} GPUs of {self.gpu_mem_gb:g} GB ({self.usable:.0%} usable), "
                f"{self.gpus_per_node} per node; {self.peak_tflops:g} TFLOP/s peak at "
                f"{self.mfu:.0%} MFU; NVLink {self.intra_gbps:g} GB/s inside a node, "
                f"InfiniBand {self.inter_gbps:g} GB/s across nodes")


def _flops_per_token(spec: ModelSpec) -> tuple[float, float]:
    """(6N + 12·L·h·s, N): training FLOPs per token and the non-embedding parameters a token
    uses (for a mixture of experts, the active ones: its ``k`` routed experts)."""
    n = as_moe(spec).layer_params(active=True)
    return 6 * n + 12 * spec.n_layers * spec.d_model * spec.seq_len, n


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
    ``cp``  :func:`~edu3d.plan.formulas.cp_bytes` per block (x4/3 ring, x3/2 others with
            full recomputation)."""
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
    redo = (4 / 3 if par.cp_impl == "ring" else 1.5) if full else 1
    out["cp"] = (memory.cp_bytes(par.cp_impl, s, b, h, lay.cp, h * spec.kv_heads // spec.n_heads,
                                 t) * redo * L / p * m if lay.cp > 1 else 0.0)
    return out


def step_time(spec: ModelSpec, run: Run, cl: Cluster) -> dict[str, float]:
    """Seconds per step by part (``compute``, ``bubble``, and each axis of :func:`traffic`
    over its links) and ``total``."""
    lay, par = run.layout, run.parallel
    L, h, s, p, m = spec.n_layers, spec.d_model, spec.seq_len, lay.pp, run.microbatches
    per_token, n = _flops_per_token(spec)
    per_token -= 2 * frozen_active(spec, tuple(run.memory.freeze))  # no weight gradients for them
    attn_fwd = 4 * L * h * s
    extra = {"none": 0, "selective": attn_fwd, "full": 2 * n + attn_fwd}[run.memory.recompute]
    tokens = run.batch.global_batch * s
    compute = tokens * (per_token + extra) / (run.world_size * cl.peak_tflops * 1e12 * cl.mfu)
    v = lay.vpp if par.schedule == "interleaved" else 1
    bubble = compute * (p - 1) / (v * m) / {"zb-h1": 3, "zbv": 6,
                                             "dualpipev": 6}.get(par.schedule, 1)
    node, t, dpc = cl.gpus_per_node, lay.tp, lay.dp * lay.cp
    group = t * dpc // par.hsdp  # HSDP: a replica group is dp*cp/hsdp consecutive dp*cp ranks
    inside = {"tp": t, "pp": t * dpc * p, "dp": group, "edp": group, "ep": t * lay.ep,
              "cp": t * lay.cp, "dp_replicate": t * dpc, "edp_replicate": t * dpc
              }  # ranks ordered pp, dp, cp, tp (tp fastest); ep inside dp*cp
    out = {"compute": compute, "bubble": bubble}
    for axis, sent in traffic(spec, run).items():
        out[axis] = sent / ((cl.intra_gbps if inside[axis] <= node else cl.inter_gbps) * GB)
    out["total"] = sum(out.values())
    return out


def candidates(spec: ModelSpec, cl: Cluster, global_batch: int, precision: str = "bf16",
               schedule: str = "1f1b", micro_batches=(1, 2, 4, 8), cp_impl: str = "ring",
               freeze: tuple = ()):
    """Every (dp, cp, ep, tp, pp, zero, recompute, micro-batch) choice the model and batch
    allow. Cheaply: ``cp > 1`` only while each rank keeps at least ``CP_MIN_TOKENS`` of a
    sequence, and ``ep > 1`` only for a mixture of experts (every ``ep`` dividing both
    ``E`` and ``dp·cp``)."""
    experts = as_moe(spec).experts
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
                        for rec in ("none", "selective", "full"):
                            yield setup(dp=dp, tp=tp, pp=pp, zero=zero, microbatches=m,
                                        micro_batch=b, schedule=schedule, sp=tp > 1,
                                        recompute=rec, precision=precision, ep=ep, cp=cp,
                                        cp_impl=cp_impl, freeze=freeze)


def search(spec: ModelSpec, cl: Cluster, global_batch: int | None = None,
           precision: str = "bf16", schedule: str = "1f1b", cp_impl: str = "ring",
           freeze: tuple = ()) -> list[dict]:
    """Every candidate with its peak memory and step time, those that fit first, fastest
    first: ``{"setup", "memory", "time", "fits"}``; ``freeze``: the globs of ``--freeze``,
    the same in every candidate (:mod:`edu3d.plan.inventory`)."""
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
            mem = estimate(spec, run)
        except ValueError:
            continue
        rows.append({"setup": run, "memory": mem, "time": step_time(spec, run, cl),
                     "fits": mem["total_bytes"] <= cl.usable * cl.gpu_mem_gb * GB})
    rows.sort(key=lambda r: (not r["fits"], r["time"]["total"], r["memory"]["total_bytes"]))
    return rows


def reasons(spec: ModelSpec, cl: Cluster, rows: list[dict]) -> list[str]:
    """The recommended layout (``rows[0]``) explained in words, against its neighbours."""
    best = rows[0]
    run, mem, tm = best["setup"], best["memory"], best["time"]
    lay, par, recompute = run.layout, run.parallel, run.memory.recompute
    budget = cl.usable * cl.gpu_mem_gb * GB
    by_key = {r["setup"]: r for r in rows}
    state16 = 16 * spec.num_params()

    def other(**change):
        return by_key.get(run.replace(**change))

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
        out.append(f"pp={lay.pp}: {spec.n_layers // lay.pp} layers per stage bring the fullest "
                   f"rank to {gb(mem['total_bytes'])} (weights {gb(mem['params_bytes'])}, "
                   f"activations {gb(mem['activations_bytes'])}); the bubble "
                   f"(p-1)/(m+p-1) = {(lay.pp - 1) / (run.microbatches + lay.pp - 1):.1%} with "
                   f"m={run.microbatches} micro-batches of {run.micro_batch}")
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
        r, rl = rivals[0], rivals[0]["setup"].layout
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
    out.append(f"estimated step {tm['total']:.2f} s: " + ", ".join(
        f"{k} {v:.2f}" for k, v in tm.items() if k != "total" and (v or k in AXES)))
    return out
