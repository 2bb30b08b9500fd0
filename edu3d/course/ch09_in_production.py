"""Chapter 09 "In production": edu3d's strategies beside PyTorch's, Accelerate's and
DeepSpeed's, measured.

After reading this file you should know, for each strategy, which edu3d class does it, which
PyTorch API does the same, and which knobs correspond (:data:`STRATEGIES`); and how the
chapter measures both sides in one launch per world size (:func:`side_by_side`): the same
model, seed and batches through edu3d's :class:`~edu3d.train.trainer.Trainer` and through
:class:`~edu3d.production.torch_impl.TorchTrainer` (``edu3d train --impl torch``), with each
side's losses, median step time, the bytes of parameters, gradients and optimizer state a
rank holds at rest (the same count, :func:`edu3d.distributed.meter.measure`, on both sides: local
shards of DTensors) and, for edu3d, the bytes its collectives moved in the last step.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from edu3d.distributed import meter, trace
from edu3d.config.layout import Layout
from edu3d.distributed.mesh import Mesh
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.production.compare import world_size
from edu3d.production.torch_impl import TorchTrainer
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import worker
from edu3d.config.sections import Run, from_flags
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer

#: strategy -> edu3d's code, PyTorch's API, the layout both run, and the knobs that map
STRATEGIES = {
    "DP": {
        "argv": "--dp 2", "edu3d": "edu3d.parallel.dp.data_parallel.DataParallel (--dp-impl bucketed)",
        "torch": "torch.nn.parallel.DistributedDataParallel",
        "accelerate": "Accelerator.prepare(model) -> DistributedDataParallel",
        "deepspeed": '"zero_optimization": {"stage": 0}',
        "knobs": [("--bucket-mb 25", "DDP(bucket_cap_mb=25)",
                   "DistributedDataParallelKwargs(bucket_cap_mb=25); DeepSpeed reduce_bucket_size"),
                  ("--microbatches m (no_sync)", "with ddp.no_sync(): ...",
                   "Accelerator(gradient_accumulation_steps=m); accelerator.accumulate(model)"),
                  ("--clip 1.0", "clip_grad_norm_(params, 1.0)",
                   'accelerator.clip_grad_norm_; DeepSpeed "gradient_clipping": 1.0')],
    },
    "ZeRO-1": {
        "argv": "--dp 2 --zero 1", "edu3d": "edu3d.parallel.zero.sharding.Zero(stage=1)",
        "torch": "torch.distributed.optim.ZeroRedundancyOptimizer over DDP",
        "accelerate": "DeepSpeedPlugin(zero_stage=1)",
        "deepspeed": '"zero_optimization": {"stage": 1}',
        "knobs": [("--zero 1", "ZeroRedundancyOptimizer(params, optimizer_class=AdamW)",
                   'DeepSpeed "stage": 1; FSDP1 has no optimizer-only mode'),
                  ("--offload", "(none for ZeRO-1 in torch)",
                   'DeepSpeed "offload_optimizer": {"device": "cpu"}')],
    },
    "ZeRO-2": {
        "argv": "--dp 2 --zero 2", "edu3d": "edu3d.parallel.zero.sharding.Zero(stage=2)",
        "torch": "fully_shard(module, reshard_after_forward=False)  (FSDP2)",
        "accelerate": "FullyShardedDataParallelPlugin(sharding_strategy=SHARD_GRAD_OP)",
        "deepspeed": '"zero_optimization": {"stage": 2}',
        "knobs": [("--zero 2", "fully_shard(reshard_after_forward=False)",
                   "FSDP1 ShardingStrategy.SHARD_GRAD_OP; DeepSpeed stage 2"),
                  ("--bucket-mb", "(FSDP2 reduce-scatters one unit = one block at a time)",
                   "DeepSpeed reduce_bucket_size, allgather_bucket_size")],
    },
    "ZeRO-3": {
        "argv": "--dp 2 --zero 3", "edu3d": "edu3d.parallel.zero.sharding.Zero(stage=3) (+ --prefetch)",
        "torch": "fully_shard(module, reshard_after_forward=True)  (FSDP2)",
        "accelerate": "FullyShardedDataParallelPlugin(sharding_strategy=FULL_SHARD)",
        "deepspeed": '"zero_optimization": {"stage": 3}',
        "knobs": [("--zero 3", "fully_shard(reshard_after_forward=True)",
                   "FSDP1 ShardingStrategy.FULL_SHARD; DeepSpeed stage 3"),
                  ("--prefetch", "FSDP2 prefetches the next unit itself "
                                 "(module.set_modules_to_forward_prefetch)",
                   "FSDP1 forward_prefetch / backward_prefetch=BACKWARD_PRE; DeepSpeed "
                   "stage3_prefetch_bucket_size"),
                  ("--offload", "fully_shard(offload_policy=CPUOffloadPolicy())",
                   "FSDP1 CPUOffload(offload_params=True); DeepSpeed offload_param + "
                   "offload_optimizer")],
    },
    "TP/SP": {
        "argv": "--tp 2 --sp", "edu3d": "edu3d.parallel.tp.apply_tp (Column/RowParallelLinear)",
        "torch": "parallelize_module(..., ColwiseParallel / RowwiseParallel / "
                 "SequenceParallel), loss_parallel()",
        "accelerate": "ParallelismConfig(tp_size=2) (transformers models only)",
        "deepspeed": '"tensor_parallel": {"autotp_size": 2} (AutoTP)',
        "knobs": [("--tp 2", 'init_device_mesh(..., ("tp",)) + ColwiseParallel / '
                             "RowwiseParallel", "Megatron --tensor-model-parallel-size 2"),
                  ("--sp", "SequenceParallel() on LayerNorms, "
                           "ColwiseParallel(input_layouts=Shard(1))",
                   "Megatron --sequence-parallel")],
    },
    "PP": {
        "argv": "--pp 2 --schedule 1f1b --microbatches 4",
        "edu3d": "edu3d.schedules (schedules as data) + edu3d.parallel.pp (engine)",
        "torch": "torch.distributed.pipelining: PipelineStage + Schedule1F1B",
        "accelerate": "(none: Accelerate's prepare_pippy is inference only)",
        "deepspeed": "deepspeed.pipe.PipelineModule(layers, num_stages=2)",
        "knobs": [("--schedule gpipe | 1f1b | interleaved | zb-h1",
                   "ScheduleGPipe | Schedule1F1B | ScheduleInterleaved1F1B | "
                   "ScheduleInterleavedZeroBubble", "DeepSpeed: 1F1B only (TrainSchedule)"),
                  ("--microbatches 4", "Schedule1F1B(stage, n_microbatches=4)",
                   'DeepSpeed "gradient_accumulation_steps": 4'),
                  ("--vpp 2", "two PipelineStage objects per rank (stage = rank + k*pp)",
                   "Megatron --num-layers-per-virtual-pipeline-stage")],
    },
}

def strategy_rows(name: str) -> list[tuple[str, str, str]]:
    """(edu3d, PyTorch, Accelerate/DeepSpeed/FSDP1) rows of one strategy: what does it,
    then every knob."""
    s = STRATEGIES[name]
    return [(s["edu3d"], s["torch"], f"{s['accelerate']}; DeepSpeed {s['deepspeed']}"),
            *s["knobs"]]


# ---- the live runs (every rank calls) ------------------------------------------------------
def _held(params, grads, states) -> dict:
    """Bytes of the tensors this rank holds (DTensors: their local shard)."""
    local = lambda ts: [t.to_local() if isinstance(t, DTensor) else t for t in ts]  # noqa: E731
    return meter.measure({"params": local(params), "grads": local(grads),
                           "optimizer": local(states)})


def torch_held(trainer) -> dict:
    """What a :class:`TorchTrainer` rank holds: its parameters (FSDP2: shards), their
    gradients, and the optimizer state (ZeroRedundancyOptimizer: this rank's partition)."""
    opt = getattr(trainer.optimizer, "optim", trainer.optimizer)
    states = [v for s in opt.state.values() for v in s.values()
              if torch.is_tensor(v)]
    return _held(trainer.params, [p.grad for p in trainer.params if p.grad is not None], states)


def _fullest(held: dict) -> dict:
    """The rank with the largest total (every rank calls)."""
    keys = ("params", "grads", "optimizer")
    row = torch.tensor([float(held[k]) for k in keys], dtype=torch.float64)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    best = max(rows, key=lambda r: float(r.sum()))
    return {k: int(v) for k, v in zip(keys, best.tolist())}


def _slowest(seconds: list[float]) -> float:
    t = torch.tensor([statistics.median(seconds[1:] or seconds)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _steps(trainer, corpus, args, steps: int) -> tuple[list[float], list[float]]:
    losses, secs = [], []
    for s in range(1, steps + 1):
        x, y = corpus.batch(s, args.batch.global_batch)
        t0 = time.perf_counter()
        losses.append(trainer.step(x, y, s)["loss"])
        secs.append(time.perf_counter() - t0)
    return losses, secs


def side_by_side(mesh, names: list[str], steps: int = 4) -> list[dict]:
    """Each named strategy (:data:`STRATEGIES`, one world size) on edu3d and on torch."""
    out = []
    folder = Path(tempfile.mkdtemp(prefix="edu3d-prod-"))
    for name in names:
        argv = [*STRATEGIES[name]["argv"].split(), "--steps", str(steps)]
        row = {"name": name, "argv": " ".join(argv)}
        for impl in ("edu3d", "torch"):
            args = from_flags([*argv, "--impl", impl])
            config, _ = check_args(args)
            layout = args.layout
            m = Mesh.build(layout)
            corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
            model = GPT(model_config(args), seed=args.training.seed)
            path = folder / f"{name.replace('/', '_')}-{impl}-{m.rank}.jsonl"
            with trace.use(trace.Recorder(m.rank, path)):
                trainer = (Trainer if impl == "edu3d" else TorchTrainer)(model, m, args)
                losses, secs = _steps(trainer, corpus, args, steps)
                trace.current().flush()
            if impl == "edu3d":
                mem = trainer.stats()["mem_bytes"]
                held = {k: mem[k] for k in ("params", "grads", "optimizer")}
                evs = [json.loads(line) for line in path.read_text().splitlines()]
                row["edu3d_wire_bytes"] = sum(trace.wire_bytes(e) for e in evs
                                              if e.get("lane") == "comm" and e.get("step") == steps)
            else:
                held = _fullest(torch_held(trainer))
            row[f"{impl}_losses"] = losses
            row[f"{impl}_step_s"] = _slowest(secs)
            row[f"{impl}_mem"] = held
            m.release()
        row["worst_rel"] = max(abs(a - b) / abs(b) for a, b in
                               zip(row["torch_losses"], row["edu3d_losses"]))
        out.append(row)
    return out


def measure(names: list[str] | None = None, steps: int = 4, timeout: float = 300) -> dict:
    """:func:`side_by_side` for the named strategies, one launch per world size."""
    names = list(names or STRATEGIES)
    by_ws: dict[int, list[str]] = {}
    for n in names:
        by_ws.setdefault(world_size(STRATEGIES[n]["argv"].split()), []).append(n)
    out = {}
    for ws, group in sorted(by_ws.items()):
        run = launch(side_by_side, ws, args=(group, steps), timeout=timeout, name="production",
                     echo=False)
        out.update({r["name"]: r for r in run.results[0]})
    return {n: out[n] for n in names}


def edu3d_dp2(steps: int = 5, timeout: float = 300) -> list[dict]:
    """``edu3d train --dp 2`` (bucketed DDP-like all-reduce), its records: what Accelerate's
    run is compared with."""
    options = Run.of(dp=2, steps=steps, json=True).flat()
    run = launch(worker, 2, args=(options,), layout=Layout(dp=2), timeout=timeout,
                 name="dp2", echo=False)
    return run.results[0]


def loss_table(accelerate_records: list[dict], edu3d_records: list[dict]) -> tuple[str, float]:
    """Both runs' losses per step and the worst relative difference."""
    rows = [f"{'step':>4} {'edu3d dp2':>10} {'Accelerate':>10} {'rel diff':>9}"]
    worst = 0.0
    for a, e in zip(accelerate_records, edu3d_records):
        rel = abs(a["loss"] - e["loss"]) / abs(e["loss"])
        worst = max(worst, rel)
        rows.append(f"{e['step']:>4} {e['loss']:>10.6f} {a['loss']:>10.6f} {rel:>9.1e}")
    return "\n".join(rows), worst


def offload(mesh, steps: int = 4) -> dict:
    """edu3d ZeRO-1 over dp with and without ``--offload`` (every rank calls): the bytes the
    optimizer's host copy holds and moves each step, and the step times."""
    out = {}
    for off in (False, True):
        args = Run.of(dp=mesh.layout.dp, zero=1, offload=off, steps=steps)
        config = model_config(args)
        corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
        trainer = Trainer(GPT(config, seed=args.training.seed), mesh, args)
        losses, secs = _steps(trainer, corpus, args, steps)
        held = meter.measure(trainer.tensors())  # this rank; offloaded state under "host"
        shard = sum(u.shard_numel for u in trainer.par.zero.units) * 4
        out["offload" if off else "device"] = {
            "losses": losses, "step_s": _slowest(secs), "mem": held, "shard_bytes": shard,
            "host_bytes": held.get("host", 0),
            # per step: the gradient shard to the host, the updated parameter shard back
            "moved_bytes": 2 * shard if off else 0}
    return out


def chapter_runs(mesh, names: list[str], steps: int = 4) -> dict:
    """Everything chapter 09 measures on 2 ranks, in one launch: each strategy on edu3d and
    torch (:func:`side_by_side`) and edu3d's ZeRO-1 with and without offload."""
    return {"strategies": side_by_side(mesh, names, steps), "offload": offload(mesh, steps)}


def measure_chapter(steps: int = 4, timeout: float = 300) -> dict:
    """:func:`chapter_runs` on 2 ranks: ``{"strategies": {name: row}, "offload": {...}}``."""
    names = list(STRATEGIES)
    run = launch(chapter_runs, 2, args=(names, steps), layout=Layout(dp=2), timeout=timeout,
                 name="production", echo=False)
    out = run.results[0]
    return {"strategies": {r["name"]: r for r in out["strategies"]}, "offload": out["offload"]}
