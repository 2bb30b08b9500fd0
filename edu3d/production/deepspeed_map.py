"""DeepSpeed's ZeRO configuration, field by field, on edu3d's options and PyTorch's APIs.

After reading this file you should be able to read a ``ds_config.json`` and say what each
field does in edu3d's terms: :func:`ds_config` writes the configuration that trains the same
run as ``edu3d train --dp N --zero S [--offload]`` (same global batch, AdamW, clipping and
bucket size), and :data:`FIELDS` maps every field it sets onto the ``edu3d train`` option and
the PyTorch API that does the same.

DeepSpeed is not a dependency of the course (it JIT-compiles C++ operations, a compiler and
minutes on a laptop). Where it is installed, this module runs it on CPU ranks over gloo:

    python -m venv /tmp/dsvenv && . /tmp/dsvenv/bin/activate
    pip install torch==2.13.0 && DS_BUILD_OPS=0 pip install deepspeed
    PYTHONPATH=. python -m edu3d.production.deepspeed_map --launch 2 \\
        --out edu3d/production/deepspeed_cpu_2.yaml

``--launch`` starts torchrun's agent with its stores bound to 127.0.0.1 and runs this module
with ``--train`` on every rank: ZeRO stages 0-3 and stages 2-3 with ``offload_optimizer``,
4 steps each; rank 0 writes the losses, the median step time and the bytes a rank holds.

DeepSpeed comes in through imports inside functions: it is an optional library, absent from
a plain edu3d install (``--print`` works without it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import run as torchrun

from edu3d.model.gpt import GPT
from edu3d.production.accelerate_train import loopback_only
from edu3d.train.cut import shard_rows
from edu3d.train.data import SyntheticCorpus
from edu3d.train.optim import param_groups
from edu3d.config.sections import Run
from edu3d.train.preflight import model_config

MEASURED = Path(__file__).with_name("deepspeed_cpu_2.yaml")
SPECS = ("0", "1", "2", "3", "2o", "3o")  # stage, and "o": offload_optimizer to the CPU

#: (ds_config field, edu3d train option, PyTorch API, what it means)
FIELDS = [
    ("train_batch_size", "--global-batch", "(the script's loop)",
     "sequences per optimizer step, over all ranks"),
    ("train_micro_batch_size_per_gpu", "--global-batch / (dp · --microbatches)",
     "the DataLoader's batch_size", "sequences per rank per forward"),
    ("gradient_accumulation_steps", "--microbatches (--grad-accum)",
     "DDP no_sync() / FSDP2 set_requires_gradient_sync(False)",
     "forwards per step; gradients reduced after the last (ZeRO-2/3: after every one, "
     "keeping the shard: edu3d's --grad-reduce per-microbatch)"),
    ("gradient_clipping", "--clip", "clip_grad_norm_ (a DTensor norm when sharded)",
     "max global gradient norm"),
    ("optimizer.type = AdamW, params.betas", "--optimizer adamw (betas 0.9, 0.95)",
     "torch.optim.AdamW", "the update rule"),
    ("optimizer.params.lr", "--lr", "param_group['lr']", "peak learning rate"),
    ("optimizer.params.weight_decay", "--weight-decay", "AdamW(weight_decay=...)",
     "decay; edu3d (and this config, through its parameter groups) spares biases and LayerNorms"),
    ("zero_optimization.stage = 0", "--dp N", "DistributedDataParallel",
     "replicated everything, all-reduce of gradients"),
    ("zero_optimization.stage = 1", "--dp N --zero 1", "ZeroRedundancyOptimizer",
     "optimizer state sharded: 4Ψ + KΨ/N"),
    ("zero_optimization.stage = 2", "--dp N --zero 2",
     "fully_shard(reshard_after_forward=False)", "gradients sharded too: 2Ψ + (2+K)Ψ/N"),
    ("zero_optimization.stage = 3", "--dp N --zero 3",
     "fully_shard(reshard_after_forward=True)", "parameters sharded too: (4+K)Ψ/N, 3Ψ traffic"),
    ("zero_optimization.reduce_bucket_size", "--bucket-mb (in elements: MB·2²⁰/4)",
     "DDP(bucket_cap_mb=...)", "gradient elements reduced per collective"),
    ("zero_optimization.allgather_bucket_size", "--bucket-mb (in elements)",
     "(FSDP2: one unit per all-gather)", "parameter elements gathered per collective"),
    ("zero_optimization.offload_optimizer.device = cpu", "--offload",
     "fully_shard(offload_policy=CPUOffloadPolicy())",
     "optimizer state and its update in host memory"),
    ("zero_optimization.offload_param.device = cpu", "(none: edu3d offloads the optimizer only)",
     "CPUOffloadPolicy (moves parameters and gradients too)",
     "stage 3 only: parameter shards in host memory"),
    ("zero_optimization.stage3_prefetch_bucket_size", "--prefetch",
     "FSDP2 prefetch (set_modules_to_forward_prefetch)", "gather the next unit early"),
    ("zero_force_ds_cpu_optimizer = false", "(edu3d steps torch's AdamW on the host copy)",
     "torch.optim.AdamW", "allow torch's AdamW with offload instead of DeepSpeedCPUAdam"),
]


def ds_config(args, stage: int, offload: bool = False) -> dict:
    """The ``ds_config`` that trains the run of ``args`` (``edu3d train``'s options,
    :class:`~edu3d.train.preflight.Run`) with
    ZeRO ``stage`` over ``args.layout.dp`` ranks."""
    elements = int(args.parallel.bucket_mb * 2**20 / 4)  # fp32: DeepSpeed counts elements, DDP MB
    m = args.microbatches or 1
    zero = {"stage": stage, "reduce_bucket_size": elements, "allgather_bucket_size": elements}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_batch_size": args.batch.global_batch,
        "train_micro_batch_size_per_gpu": args.batch.global_batch // (args.layout.dp * m),
        "gradient_accumulation_steps": m,
        "gradient_clipping": args.training.clip,
        "optimizer": {"type": "AdamW", "params": {
            "lr": args.training.lr, "betas": [0.9, 0.95], "weight_decay": args.training.weight_decay,
            "torch_adam": True}},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
    }


def run(specs=SPECS, steps: int = 4) -> list[dict]:
    """Every rank of a started torchrun: train edu3d's GPT with DeepSpeed for each spec."""
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for spec in specs:
        args = Run.of(dp=world, zero=int(spec[0]), offload=spec.endswith("o"), steps=steps)
        config = model_config(args)
        model = GPT(config, seed=args.training.seed)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model.parameters(), args.training.weight_decay),
            config=ds_config(args, args.parallel.zero, args.memory.offload))
        corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
        losses, secs = [], []
        for step in range(1, steps + 1):
            x, y = corpus.batch(step, args.batch.global_batch)
            t0 = time.perf_counter()
            _, loss = engine(shard_rows(x, rank, world), shard_rows(y, rank, world))
            engine.backward(loss)
            engine.step()
            secs.append(time.perf_counter() - t0)
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        state = sum(v.numel() * v.element_size() for s in inner.state.values()
                    for v in s.values() if torch.is_tensor(v))
        params = sum(getattr(p, "ds_tensor", p).numel() * 4 for p in engine.module.parameters())
        out.append({"spec": spec, "stage": args.parallel.zero, "offload": args.memory.offload,
                    "losses": losses, "step_s": statistics.median(secs[1:]),
                    "param_bytes": params, "optimizer_state_bytes": state,
                    "optimizer": type(engine.optimizer).__name__,
                    "deepspeed": deepspeed.__version__, "torch": torch.__version__})
        dist.barrier()
    return out


def measured() -> list[dict]:
    """The committed record of :func:`run` on 2 CPU ranks (JSON is valid YAML)."""
    return json.loads(MEASURED.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edu3d.production.deepspeed_map",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", type=int, choices=(0, 1, 2, 3), metavar="STAGE",
                        help="print the ds_config of edu3d's defaults with --dp 2 and this stage")
    parser.add_argument("--offload", action="store_true", help="with --print: offload_optimizer")
    parser.add_argument("--train", action="store_true", help="(every rank) run DeepSpeed")
    parser.add_argument("--launch", type=int, metavar="N", help="torchrun N ranks of --train")
    parser.add_argument("--out", default=None, help="rank 0 writes the results here")
    args = parser.parse_args(argv)
    if args.print is not None:
        print(json.dumps(ds_config(Run.of(dp=2), args.print, args.memory.offload), indent=2))
    elif args.launch:
        with loopback_only():
            torchrun.main([f"--nproc-per-node={args.launch}", "--rdzv-backend=c10d",
                           "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1",
                           "-m", "edu3d.production.deepspeed_map", "--train"]
                          + (["--out", args.out] if args.out else []))
    elif args.train:
        results = run()
        if dist.get_rank() == 0:
            text = json.dumps(results, indent=1)
            Path(args.out).write_text(text + "\n") if args.out else print(text)
    else:
        parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
