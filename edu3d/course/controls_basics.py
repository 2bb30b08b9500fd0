"""The simulations and the real runs behind the control panels of chapters 00, 01 and 02.

After reading this file you should know where each panel's pictures come from:

* chapter 01's ring: :func:`ring_sends` replays :func:`edu3d.distributed.algorithms.ring_plan` (the very list
  of transfers the executor walks) with the chunk sizes ``torch.tensor_split`` gives, so its
  bytes are exact; :func:`ring_step_costs` prices each of its ``2(N-1)`` steps with the
  alpha-beta model, ``α + (S/N)·β`` per step; :func:`ring_timed` runs edu3d's real ring and
  :func:`measured_ring_steps` reads the per-step bytes and times back from its trace;
* chapter 02's buckets: :func:`simulate_dp_step` cuts the model's gradients into buckets with
  :func:`edu3d.parallel.dp.data_parallel.make_buckets` itself (on ``meta`` tensors: sizes, no memory), lets
  backward produce them last layer first, launches each bucket's all-reduce when its last
  gradient is ready and every earlier bucket has gone, and prices the all-reduces with the
  same alpha-beta model; :func:`dp_step` runs the real bucketed data-parallel step and
  :func:`step_events` cuts one step out of its trace.

The simulated events use the trace schema with ``"sim": True``, so one renderer draws
theory and measurement on the same lanes.
"""

from __future__ import annotations

from dataclasses import dataclass

# ---- the alpha-beta model ------------------------------------------------------------------------
#: edu3d's ring on this kind of machine (2 shared CPU cores, gloo over loopback), fitted by
#: ``edu3d bench comm`` at 2 ranks: 0.7 to 1.2 ms per step, 0.8 to 1.8 GB/s. A chapter
#: passes the values it fitted itself.
ALPHA_S = 1.0e-3
BETA_S_PER_BYTE = 1 / 1.0e9
#: gloo's own all-reduce (what data parallelism calls) on the same machine, 2 ranks
GLOO_ALPHA_S = 1.5e-4
GLOO_BETA_S_PER_BYTE = 1 / 1.3e9


def ring_all_reduce_s(size_bytes: float, n: int, alpha: float = ALPHA_S,
                      beta: float = BETA_S_PER_BYTE) -> float:
    """``t = 2(N-1)·α + 2(N-1)/N · S · β``: a ring all-reduce of ``size_bytes`` on ``n``."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * size_bytes * beta


# ---- chapter 01: the ring, step by step ----------------------------------------------------------
def chunk_bytes(numel: int, n: int, itemsize: int = 4) -> list[int]:
    """Bytes of each of the ``n`` chunks ``torch.tensor_split`` cuts ``numel`` values into."""
    q, r = divmod(numel, n)
    return [(q + (1 if i < r else 0)) * itemsize for i in range(n)]


def ring_sends(n: int, numel: int, itemsize: int = 4) -> list[dict]:
    """The ``send`` events a ring all-reduce of ``numel`` values on ``n`` ranks makes, from the
    executor's own plan (no times: :func:`ring_replay` adds them)."""
    from edu3d.distributed.algorithms import ring_plan

    sizes = chunk_bytes(numel, n, itemsize)
    return [{"rank": t.src, "lane": "comm", "op": "send", "peer": t.dst, "bytes": sizes[t.chunk],
             "algo": "ring_all_reduce", "phase": t.phase, "ring_step": t.step, "chunk": t.chunk,
             "sim": True} for t in ring_plan(n)]


STEP_KEY = {"reduce_scatter": "RS", "all_gather": "AG"}


def step_label(phase: str, step: int) -> str:
    return f"{STEP_KEY[phase]}{step}"


def ring_step_costs(n: int, numel: int, alpha: float = ALPHA_S, beta: float = BETA_S_PER_BYTE,
                    itemsize: int = 4) -> list[dict]:
    """One row per ring step: ``{"step": "RS0", "bytes" (all ranks together), "bytes_per_rank"
    (the largest chunk a rank sends), "s": α + bytes_per_rank·β}``. The steps' times add up
    to :func:`ring_all_reduce_s` (exactly when ``n`` divides ``numel``)."""
    rows = {}
    for e in ring_sends(n, numel, itemsize):
        key = step_label(e["phase"], e["ring_step"])
        row = rows.setdefault(key, {"step": key, "bytes": 0, "bytes_per_rank": 0})
        row["bytes"] += e["bytes"]
        row["bytes_per_rank"] = max(row["bytes_per_rank"], e["bytes"])
    for row in rows.values():
        row["s"] = alpha + row["bytes_per_rank"] * beta
    return list(rows.values())


def ring_timed(mesh, numel: int = 1 << 16, repeats: int = 3) -> dict:
    """Run edu3d's ring all-reduce ``repeats`` times on ``numel`` float32 values (after one
    untimed warm-up), each traced as ``case=rep{i}``; checked against ``dist.all_reduce``."""
    import torch
    import torch.distributed as dist

    from edu3d.distributed import comm, trace
    from edu3d.distributed.algorithms import ring_all_reduce

    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    want = x.clone()
    dist.all_reduce(want)
    ring_all_reduce(x.clone())  # warm-up: the first exchange also sets up the connections
    equal = True
    for i in range(repeats):
        comm.barrier()
        with trace.current().context(case=f"rep{i}"):
            got = ring_all_reduce(x.clone())
        equal = equal and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5))
    return {"rank": dist.get_rank(), "equal": equal, "repeats": repeats}


def measured_ring_steps(events: list[dict], n: int, repeats: int) -> list[dict]:
    """Per ring step of a :func:`ring_timed` trace: the bytes all ranks sent, and the step's
    time: from the moment the last rank finished the previous step (or the first rank
    started) to the moment the last rank finished this one; median over the repeats."""
    import statistics

    per_rep = []
    for i in range(repeats):
        sends = [e for e in events if e["op"] == "send" and e.get("case") == f"rep{i}"
                 and e.get("algo") == "ring_all_reduce"]
        if not sends:
            continue
        keys = sorted({(e["phase"] != "reduce_scatter", e["ring_step"], e["phase"])
                       for e in sends})
        prev = min(e["t0"] for e in sends)
        rows = []
        for _, step, phase in keys:
            sel = [e for e in sends if e["phase"] == phase and e["ring_step"] == step]
            end = max(e["t1"] for e in sel)
            rows.append({"step": step_label(phase, step), "bytes": sum(e["bytes"] for e in sel),
                         "s": (end - prev) / 1e6})
            prev = end
        per_rep.append(rows)
    if not per_rep:
        return []
    return [{"step": rows[0]["step"], "bytes": rows[0]["bytes"],
             "s": statistics.median(r["s"] for r in rows)}
            for rows in zip(*per_rep)]


# ---- chapter 02: buckets on the backward timeline ------------------------------------------------
@dataclass(frozen=True)
class StepCosts:
    """Compute times of one DP step (the tiny GPT, 4 rows per rank, measured on this machine)
    and gloo's alpha-beta."""

    forward_s: float = 3e-3
    backward_s: float = 9e-3
    alpha: float = GLOO_ALPHA_S
    beta: float = GLOO_BETA_S_PER_BYTE


def backward_sizes(config) -> list[tuple[str, int]]:
    """``(name, numel)`` of every parameter, in registration order (what the buckets cut)."""
    import torch

    from edu3d.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(config)
    return [(name, p.numel()) for name, p in model.named_parameters()]


def _compute_weight(name: str, numel: int) -> float:
    """A gradient's share of backward: proportional to its size (a matmul's backward is
    ``2·tokens·numel`` FLOPs), except the embeddings, whose backward is a cheap scatter."""
    return 0.0 if name.endswith("emb.weight") else float(numel)


def simulate_dp_step(params: list[tuple[str, int]], bucket_mb: float, reverse: bool, n: int,
                     costs: StepCosts = StepCosts()) -> dict:
    """The events of one bucketed DP step on each of ``n`` ranks, as edu3d's
    :class:`~edu3d.parallel.dp.data_parallel.DataParallel` would run it.

    Backward produces the gradients last-registered first; gradient ``p`` is ready after its
    share of ``backward_s``. Buckets come from :func:`edu3d.parallel.dp.data_parallel.make_buckets` (in
    reverse order, or forward order when ``reverse`` is False) and are launched strictly in
    bucket order, each when its last gradient is ready. All-reduces share one link, one after
    the other, each ``2(N-1)α + 2(N-1)/N·S·β``; an all-reduce's event is its time on that
    link (a trace can only show launch to wait, which hides when the bytes moved).
    Returns ``{"events", "buckets" (bytes each), "launch_log", "backward_end_s",
    "step_end_s", "exposed_s"}``.
    """
    import torch

    from edu3d.parallel.dp.data_parallel import make_buckets

    tensors = [torch.empty(numel, device="meta") for _, numel in params]
    index = {id(t): i for i, t in enumerate(tensors)}
    buckets = make_buckets(tensors, bucket_mb, reverse=reverse, first_bucket_mb=1.0)
    members = [[index[id(p)] for p in b.params] for b in buckets]

    weights = [_compute_weight(name, numel) for name, numel in params]
    total = sum(weights) or 1.0
    ready, t = [0.0] * len(params), costs.forward_s
    for i in reversed(range(len(params))):  # backward: last registered first
        t += costs.backward_s * weights[i] / total
        ready[i] = t
    b_end = costs.forward_s + costs.backward_s

    launches, log, link_free = [], [], 0.0
    order = sorted(range(len(params)), key=lambda i: ready[i])
    for k, group in enumerate(members):
        at = max([ready[i] for i in group] + (launches[-1:] or [0.0]))
        launches.append(at)
        log.append((k, sum(1 for i in order if ready[i] <= at)))
    wire, waited = [], b_end
    sizes = [sum(params[i][1] for i in g) * 4 for g in members]
    for at, size in zip(launches, sizes):
        start = max(at, link_free)  # one link: a bucket waits for the one before it
        link_free = start + ring_all_reduce_s(size, n, costs.alpha, costs.beta)
        wire.append((start, link_free))
        waited = max(waited, link_free)
    events = []
    for rank in range(n):
        events.append({"rank": rank, "lane": "compute", "op": "F", "t0": 0.0,
                       "t1": costs.forward_s * 1e6, "sim": True})
        events.append({"rank": rank, "lane": "compute", "op": "B", "t0": costs.forward_s * 1e6,
                       "t1": b_end * 1e6, "sim": True})
        for k, ((start, end), size) in enumerate(zip(wire, sizes)):
            events.append({"rank": rank, "lane": "comm", "op": "all_reduce", "group": "dp",
                           "n": n, "bytes": size, "chunk": k, "t0": start * 1e6,
                           "t1": end * 1e6, "sim": True})
    return {"events": events, "buckets": sizes, "launch_log": log, "grads": len(params),
            "backward_end_s": b_end,
            "step_end_s": waited, "exposed_s": waited - b_end}


def dp_step(mesh, bucket_mb: float = 0.1, reverse: bool = True, steps: int = 2,
            global_batch: int = 8) -> dict:
    """``steps`` steps of the tiny GPT with edu3d's bucketed data parallelism (the trainer of
    ``edu3d train``), traced as ``case="panel"``; the last one is the warm one to draw."""
    import torch.distributed as dist

    from edu3d.distributed import trace
    from edu3d.course import lesson_args
    from edu3d.train.data import SyntheticCorpus
    from edu3d.model.gpt import GPT
    from edu3d.train.options import config_from_args
    from edu3d.train.trainer import Trainer

    args = lesson_args(dp_impl="bucketed", bucket_mb=bucket_mb, reverse_buckets=reverse,
                       global_batch=global_batch)
    config = config_from_args(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.seed)
    trainer = Trainer(GPT(config, seed=args.seed), mesh, args)
    with trace.current().context(case="panel"):
        losses = [trainer.step(*corpus.batch(s, global_batch), s)["loss"]
                  for s in range(1, steps + 1)]
    return {"rank": dist.get_rank(), "losses": losses,
            "buckets": [b.buffer.numel() * 4 for b in trainer.par.dp.buckets],
            "launch_log": list(trainer.par.dp.launch_log)}


def step_events(events: list[dict], step: int, case: str = "panel") -> list[dict]:
    """Forward, backward and all-reduce events of one step (each rank's optimizer step and
    memory samples left out), shifted so the step starts at 0."""
    sel = [e for e in events if e.get("case") == case and e.get("step") == step
           and (e["op"] in ("F", "B", "all_reduce")) and "t1" in e]
    if not sel:
        return []
    t0 = min(e["t0"] for e in sel)
    return [{**e, "t0": e["t0"] - t0, "t1": e["t1"] - t0} for e in sel]


def measured_costs(events: list[dict], costs: StepCosts = StepCosts()) -> StepCosts:
    """The simulation's compute times replaced by the run's (median over ranks), so the
    simulation drawn under a measurement starts from the same forward and backward."""
    import statistics

    def median(op):
        d = [(e["t1"] - e["t0"]) / 1e6 for e in events if e["op"] == op]
        return statistics.median(d) if d else None

    f, b = median("F"), median("B")
    return StepCosts(f if f is not None else costs.forward_s,
                     b if b is not None else costs.backward_s, costs.alpha, costs.beta)
