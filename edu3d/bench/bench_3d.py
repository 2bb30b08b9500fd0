"""``edu3d bench 3d``: one dp2-tp2-pp2 training step, edu3d against PyTorch's composed stack.

After reading this file you should understand what the 3D comparison holds equal, and how
PyTorch's own APIs compose into the same layout (torchtitan's ``parallelize_llama`` and
``pipeline_llama``, shrunk to this GPT):

* **the same model, mesh and data**: both sides build :class:`edu3d.model.gpt.GPT` from the same
  config and seed on every rank, see the same global batch
  (:class:`edu3d.train.data.SyntheticCorpus`), cut it into the same 4 micro-batches per data-parallel
  rank, and run in the same 8 processes (rank order tp-dp-pp on both:
  ``init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))``);
* **PyTorch's side, applied in torchtitan's order** (``edu3d train --impl torch``'s own
  construction, :class:`~edu3d.production.torch_impl.TorchTrainer`):

  1. **TP** (DTensor ``parallelize_module``): ``ColwiseParallel`` on each block's ``qkv`` and
     ``fc``, ``RowwiseParallel`` on the two projections; the token embedding is cut by
     vocabulary rows (``RowwiseParallel`` on an ``nn.Embedding``) and the LM head by vocabulary
     columns with its logits left sharded, so the cross-entropy runs under ``loss_parallel()``
     (the vocabulary-parallel loss, as edu3d's). DTensor cuts ``qkv`` contiguously, which
     would hand a rank half of q and half of k, so PyTorch's copy has its ``qkv`` rows
     reordered head-major ``[q_0 k_0 v_0 | q_1 k_1 v_1]`` first (as ``edu3d bench tp``) and the
     gradients are un-permuted before the comparison. The position embedding and the
     LayerNorms stay plain replicated tensors (no sequence parallelism on either side);
  2. **the pipeline cut** (``torch.distributed.pipelining``): this rank's layers by
     :func:`edu3d.schedules.partition.uniform`, exactly edu3d's cut, in a ``PipelineStage``
     over the pp group, driven by ``Schedule1F1B``;
  3. **DP** last, over the dp dimension: ``replicate`` for plain data parallelism and
     ``fully_shard(reshard_after_forward=False)`` for the ZeRO-1 row. ``replicate`` here is
     ``torch.distributed._composable.replicate_with_fsdp.replicate`` (FSDP2's replicate), not
     the older DDP-based ``torch.distributed._composable.replicate``: the pipeline stage only
     knows how to defer gradient sync to the last micro-batch for FSDP2 modules (and the DDP
     class), and DDP refuses DTensor (TP) parameters. ``fully_shard`` with
     ``reshard_after_forward=False`` under a pipeline gathers parameters once per step and
     reduce-scatters gradients once after the last micro-batch: ZeRO-1's traffic (2Ψ per step,
     DESIGN.md's formulas) and sharded optimizer state; it also keeps gradients sharded (it is
     ZeRO-2 in memory terms), which changes no arithmetic;
  4. the step: the global gradient norm as torchtitan computes it (one norm per DTensor mesh,
     ``full_tensor()``, squares summed over the pp group), ``clip_grads_with_norm_``, AdamW
     with edu3d's betas, learning rate and weight-decay groups;
* **the same gradients first**: after one forward and backward on both sides (no update),
  every full gradient is gathered by serial parameter name and compared; the report carries
  the largest relative difference, and nothing is timed if it is above 1e-4;
* **timing** is :mod:`edu3d.bench.harness`'s: interleaved repetitions of one whole training step
  (forward, backward, gradient sync, norm, clip, AdamW update), the slowest rank's time, the
  median, ``ratio = edu3d_s / reference_s``.

Rows: ``dp2-tp2-pp2 1f1b`` (plain DP) and ``dp2-tp2-pp2 1f1b zero1``.

What limits the ratio on a laptop: 8 ranks share a few cores, so every rank's CPU time per
step becomes wall time for all of them. The model is small, so most of that CPU time is
per-operation overhead, not arithmetic: DTensor's sharding propagation on every op, FSDP2's
hooks and functional collectives on PyTorch's side, plain tensors and direct gloo calls on
edu3d's. On a GPU (or with ``torch.compile``, as torchtitan runs) that overhead shrinks and the
two sides' communication, which is the same by construction, decides.
"""

from __future__ import annotations


import torch

from edu3d.bench.harness import comm_shares, interleaved_medians, layout_name, report, result
from edu3d.config.layout import Layout
from edu3d.launch import launch
from edu3d.model.gpt import GPT, config_from
from edu3d.production.torch_impl import TorchTrainer
from edu3d.train.data import SyntheticCorpus
from edu3d.config.sections import Run
from edu3d.train.trainer import Trainer

LAYOUT = {"dp": 2, "tp": 2, "pp": 2}
MICROBATCHES = 4
GLOBAL_BATCH = 16  # 2 dp ranks x 4 micro-batches x 2 rows
MODEL = {"layers": 4, "heads": 4, "d_model": 128, "seq": 64, "vocab": 256}
MAX_GRAD_REL_DIFF = 1e-4
REFERENCE = ("torch: DTensor parallelize_module + loss_parallel, pipelining Schedule1F1B, "
             "{dp}")


# ---- PyTorch's composed stack: edu3d train --impl torch's own construction -----------------
def torch_trainer(gpt: GPT, mesh, zero: int, model: dict = MODEL,
                  global_batch: int = GLOBAL_BATCH, microbatches: int = MICROBATCHES):
    """PyTorch's dp x tp x pp trainer (:class:`~edu3d.production.torch_impl.TorchTrainer`,
    what ``edu3d train --impl torch`` runs) for the benchmarked layout. Its ZeRO-1 row is
    ``fully_shard(reshard_after_forward=False)`` (``--zero 2``'s construction): under a
    pipeline that is ZeRO-1's traffic, and ``ZeroRedundancyOptimizer`` cannot take TP's
    DTensors."""
    args = train_args(2 if zero else 0, model, global_batch, microbatches)
    return TorchTrainer(gpt, mesh, args.replace(impl="torch"))


def max_rel_diff(ours: dict, theirs: dict) -> float:
    """Largest ``|a - b| / |b|`` (Frobenius norms) over the parameters both dicts name."""
    missing = set(theirs) ^ set(ours)
    if missing:
        raise RuntimeError(f"gradients named on one side only: {sorted(missing)}")
    return max(float((ours[k] - theirs[k]).norm() / theirs[k].norm().clamp_min(1e-12))
               for k in theirs)


# ---- edu3d's side ----------------------------------------------------------------------------
def train_args(zero: int, model: dict = MODEL, global_batch: int = GLOBAL_BATCH,
               microbatches: int = MICROBATCHES) -> Run:
    """``edu3d train``'s options for the benchmarked layout."""
    return Run.of(dp=LAYOUT["dp"], tp=LAYOUT["tp"], pp=LAYOUT["pp"], zero=zero,
                    schedule="1f1b", microbatches=microbatches, global_batch=global_batch,
                    layers=model["layers"], heads=model["heads"], d_model=model["d_model"],
                    seq=model["seq"], vocab=model["vocab"])


# ---- the launched worker ---------------------------------------------------------------------
def torch_matches_serial(mesh, zero: int = 0, model: dict = MODEL,
                         global_batch: int = GLOBAL_BATCH,
                         microbatches: int = MICROBATCHES) -> dict:
    """Launch target (the test's): PyTorch's composed gradients and global gradient norm
    against the serial GPT's on the global batch, as relative differences."""
    config = config_from("tiny", layers=model["layers"], heads=model["heads"],
                         d_model=model["d_model"], seq=model["seq"], vocab=model["vocab"])
    x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0).batch(1, global_batch)
    theirs = torch_trainer(GPT(config, seed=0), mesh, zero, model, global_batch, microbatches)
    theirs.forward_backward(x, y)
    norm = float(theirs.grad_norm())
    serial = GPT(config, seed=0)
    serial(x, y)[1].backward()
    grads = {k: p.grad for k, p in serial.named_parameters()}
    serial_norm = float(torch.stack([g.norm() for g in grads.values()]).norm())
    return {"grad": max_rel_diff(theirs.gather("grad"), grads),
            "grad_norm": abs(norm - serial_norm) / serial_norm}


def worker(mesh, reps: int = 3, warmup: int = 1) -> dict | None:
    """On every rank: per row, build both sides, compare gradients, time; rank 0 reports."""
    rows = []
    for zero in (0, 1):
        args = train_args(zero)
        config = config_from("tiny", layers=MODEL["layers"], heads=MODEL["heads"],
                             d_model=MODEL["d_model"], seq=MODEL["seq"], vocab=MODEL["vocab"])
        x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0).batch(1, GLOBAL_BATCH)
        ours = Trainer(GPT(config, seed=0), mesh, args)
        theirs = torch_trainer(GPT(config, seed=0), mesh, zero)

        ours.forward_backward(x, y)
        theirs.forward_backward(x, y)
        diff = max_rel_diff(ours.gather("grad"), theirs.gather("grad"))
        if diff > MAX_GRAD_REL_DIFF:
            raise RuntimeError(f"edu3d and PyTorch gradients differ by {diff:.2e} (relative) "
                               f"with zero={zero}; not timing")
        mine, its = iter(range(1, 1 << 30)), iter(range(1, 1 << 30))
        times = interleaved_medians({"edu3d": lambda: ours.step(x, y, next(mine)),
                                     "torch": lambda: theirs.step(x, y, next(its))},
                                    reps=reps, warmup=warmup, group=mesh.groups["world"])
        share = comm_shares(lambda: ours.step(x, y, next(mine)))
        dp = "fully_shard(reshard_after_forward=False)" if zero else "replicate (FSDP2)"
        rows.append(result(f"dp2-tp2-pp2 1f1b{' zero1' if zero else ''}", times["edu3d"],
                           REFERENCE.format(dp=dp), times["torch"], tokens=x.numel(),
                           comm_share=share, max_grad_rel_diff=diff,
                           microbatches=MICROBATCHES, global_batch=GLOBAL_BATCH, **MODEL))
    return (report("3d", mesh.layout.world_size, rows, layout_name(**LAYOUT))
            if mesh.rank == 0 else None)


def run_benchmark(nprocs: int = 8, reps: int = 3, json_out: bool = False, **_) -> dict:
    """``edu3d bench 3d``: the dp2-tp2-pp2 step (and its ZeRO-1 variant) on 8 gloo ranks."""
    layout = Layout(**LAYOUT)
    if nprocs != layout.world_size:
        raise ValueError(f"edu3d bench 3d runs dp2-tp2-pp2 on {layout.world_size} ranks, "
                         f"not {nprocs}; drop -n or pass -n {layout.world_size}")
    run = launch(worker, nprocs, kwargs={"reps": reps}, layout=layout, timeout=600,
                 echo=not json_out, name="bench-3d")
    return run.results[0]
