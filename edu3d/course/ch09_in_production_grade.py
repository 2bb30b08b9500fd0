"""The grader of exercise 09 (``exercises/torch_wrap.py``): the learner's wrapping of edu3d's
GPT in PyTorch's own classes, trained beside edu3d's own ZeRO.

After reading this file you can tell what each check of the exercise measures. :func:`grade`
is a launch target on 2 data-parallel ranks (:func:`run` launches it). Every rank builds the
same tiny GPT (3 blocks) and, for ZeRO-3, ZeRO-2 and ZeRO-1 in turn:

* edu3d's :class:`~edu3d.train.trainer.Trainer` (``--dp 2 --zero N``) takes three AdamW steps
  on three global batches: the reference losses;
* the learner's wrapping (``fsdp2(model, mesh, zero)``, or ``ddp_zero1``) takes the same three
  steps, each rank on its half of each batch, with AdamW over edu3d's parameter groups
  (FSDP2: built here over the sharded parameters; ZeRO-1: the learner's optimizer);
* while the first step runs, hooks note which blocks hold their whole weights: when each
  block starts its forward (one unit per block gathers only that block) and after the
  forward (ZeRO-3 has freed every block again, ZeRO-2 keeps them for backward);
* after the steps, what the rank holds: which parameters are sharded over the 2 ranks, and
  the bytes of AdamW's state (ZeRO-1: this rank's partition).

Each verdict is a reason string (``None``: passed), the same on every rank: a learner's
error (an unfinished stub, a wrong call) becomes a reason on the rank that raised it and is
shared with the others, never a rank left waiting in a collective it skipped.

The design: ``fsdp_plan(job)`` picks how many blocks one FSDP unit holds and whether units
reshard after forward, for a 32-block model on 32 GPUs (:data:`JOBS`). :func:`fsdp_cost`
prices it as chapter 09 teaches: every collective pays a fixed latency plus its bytes over
the link; each unit's all-gather overlaps the previous unit's compute (the first is
exposed); in backward a resharded unit is gathered again beside its reduce-scatter; the
memory is the sharded state, the activations, two units' whole weights and gradients
(prefetch), and with no reshard every block's weights whole from forward to backward. The
target: it fits, and the step is within 2 % of the best plan (every plan is listed).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from edu3d.course import grading, lesson_args
from edu3d.config.layout import Layout
from edu3d.course.targets import Cost, Target, fmt_time, meet, plan_line, step_line, target_of
from edu3d.launch import launch
from edu3d.model.gpt import GPT, config_from
from edu3d.train.cut import shard_rows
from edu3d.train.data import SyntheticCorpus
from edu3d.train.optim import lr_at, optimizer_for, param_groups, set_lr
from edu3d.train.trainer import Trainer

STEPS, BATCH, TOLERANCE = 3, 4, 1e-5
CHECKS = ("sharded", "units", "reshard", "fsdp_losses", "zero1_losses", "zero1_state")


def config():
    """The graded model: 3 blocks, small enough for three steps in about a second."""
    return config_from("tiny", layers=3, d_model=32, heads=4, vocab=64, seq=16)


def _args(zero: int):
    return lesson_args(dp=2, zero=zero, steps=STEPS, clip=0.0, global_batch=BATCH)


def _edu3d_losses(mesh, zero: int, corpus) -> list[float]:
    trainer = Trainer(GPT(config(), seed=0), mesh, _args(zero))
    return [trainer.step(*corpus.batch(s, BATCH), s)["loss"] for s in range(1, STEPS + 1)]


def _whole(model) -> list[int]:
    """The blocks whose weights are whole right now (FSDP2 swaps a gathered unit's sharded
    DTensors for plain tensors until it frees them)."""
    return [i for i, b in enumerate(model.blocks)
            if not all(isinstance(p, DTensor) for p in b.parameters(recurse=True))]


def _train(step_model, optimizer, mesh, corpus, args, after_forward=None) -> list[float]:
    """Three steps, each rank on its rows; the global batch's mean loss per step."""
    losses, dp_i = [], mesh.index("dp")
    for s in range(1, STEPS + 1):
        x, y = corpus.batch(s, BATCH)
        optimizer.zero_grad(set_to_none=True)
        _, loss = step_model(shard_rows(x, dp_i, 2), shard_rows(y, dp_i, 2))
        if after_forward is not None and s == 1:
            after_forward()
        loss.backward()
        set_lr(optimizer, lr_at(s, args))
        optimizer.step()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(float(total) / 2)
    return losses


def _error(name: str, err: Exception) -> str:
    """One line: what the learner's ``name`` raised, and the line of their file."""
    mine = Path(grading.source("torch_wrap")).resolve()
    lines = [f for f in traceback.extract_tb(err.__traceback__)
             if Path(f.filename).resolve() == mine]
    where = f" ({mine.parent.name}/{mine.name}, line {lines[-1].lineno})" if lines else ""
    text = " ".join(str(err).split())[:200]
    return f"{name} raised {type(err).__name__}{': ' + text if text else ''}{where}"


def _compare(mine: list[float], ref: list[float], what: str) -> str | None:
    worst = max(abs(a - b) / abs(b) for a, b in zip(mine, ref))
    if worst <= TOLERANCE:
        return None
    step = max(range(STEPS), key=lambda i: abs(mine[i] - ref[i]))
    return (f"{what}: step {step + 1} loss {mine[step]:.6f}, edu3d's {ref[step]:.6f} (relative "
            f"difference {worst:.1e}, allowed {TOLERANCE:.0e})")


def _sharding(model) -> str | None:
    """Every parameter a DTensor sharded on its first dimension over the 2 ranks?"""
    whole = [n for n, p in model.named_parameters()
             if not (isinstance(p, DTensor) and p.device_mesh.size() == 2
                     and tuple(p.placements) == (Shard(0),))]
    if not whole:
        return None
    held = sum(p.numel() for n, p in model.named_parameters() if n in whole)
    total = sum(p.numel() for p in model.parameters())
    shown = ", ".join(whole[:4]) + (f" and {len(whole) - 4} more" if len(whole) > 4 else "")
    return (f"{len(whole)} parameters are whole on every rank ({held:,} of {total:,} numbers): "
            f"{shown}")


def _fsdp(mod, mesh, dmesh, corpus) -> dict:
    """The learner's FSDP2 at ZeRO-3 and ZeRO-2: losses, the gathered blocks, the shards."""
    out = {}
    for zero in (3, 2):
        model = GPT(config(), seed=0)
        seen: dict = {"at_forward": [], "after_forward": None}
        try:
            wrapped = mod.fsdp2(model, dmesh, zero)
            wrapped = model if wrapped is None else wrapped
            for i, block in enumerate(model.blocks):
                block.register_forward_pre_hook(
                    lambda m, a, i=i: seen["at_forward"].append((i, _whole(model))))
            sharding = _sharding(model)
            args = _args(zero)
            opt = optimizer_for(param_groups(model.parameters(), args.training.weight_decay), args)
            losses = _train(wrapped, opt, mesh, corpus, args,
                            lambda: seen.update(after_forward=_whole(model)))
        except Exception as err:  # noqa: BLE001 - a learner's error is a verdict, on one rank
            out[zero] = {"error": _error(f"fsdp2(zero={zero})", err)}
            continue
        out[zero] = {"losses": losses, "sharding": sharding,
                     "at_forward": seen["at_forward"][:len(model.blocks)],
                     "after_forward": seen["after_forward"]}
    return out


def _state_bytes(optimizer) -> int:
    """Bytes of the optimizer state this rank holds (ZeroRedundancyOptimizer: its partition)."""
    inner = getattr(optimizer, "optim", optimizer)
    return sum((v.to_local() if isinstance(v, DTensor) else v).nbytes
               for state in inner.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _zero1(mod, mesh, dmesh, corpus) -> dict:
    model = GPT(config(), seed=0)
    args = _args(1)
    try:
        step_model, opt = mod.ddp_zero1(model, dmesh.get_group(),
                                        param_groups(model.parameters(), args.training.weight_decay),
                                        lr=args.training.lr, betas=(0.9, 0.95))
        losses = _train(step_model, opt, mesh, corpus, args)
    except Exception as err:  # noqa: BLE001
        return {"error": _error("ddp_zero1", err)}
    full = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # exp_avg, exp_avg_sq
    return {"losses": losses, "state": _state_bytes(opt), "full_state": full}


def _verdicts(fsdp: dict, zero1: dict, ref: dict, states: list[int]) -> dict:
    """Each check's reason (None: passed) from this rank's runs and every rank's state."""
    out = dict.fromkeys(CHECKS)
    three, two = fsdp[3], fsdp[2]
    for key in ("sharded", "units", "reshard", "fsdp_losses"):
        err = three.get("error") or (two.get("error") if key in ("reshard", "fsdp_losses")
                                     else None)
        out[key] = err
    if not three.get("error"):
        out["sharded"] = three["sharding"]
        crowded = [(i, whole) for i, whole in three["at_forward"] if whole != [i]]
        if len(three["at_forward"]) < 3:
            out["units"] = "the blocks' forward did not run through your wrapped model"
        elif crowded:
            i, whole = crowded[0]
            why = ("they were gathered together, as one unit" if any(j > i for j in whole)
                   else "the earlier ones were not freed after their forward (zero=3 frees "
                   "them)" if len(whole) > 1 else "its weights were never gathered")
            out["units"] = f"while block {i} ran its forward, blocks {whole} were whole: {why}"
    if not (three.get("error") or two.get("error")):
        if three["after_forward"] != [] or two["after_forward"] != [0, 1, 2]:
            out["reshard"] = (f"after the forward, whole blocks: zero=3 {three['after_forward']} "
                              f"(should be none), zero=2 {two['after_forward']} (should be "
                              "all three)")
        out["fsdp_losses"] = (_compare(three["losses"], ref[3], "zero=3")
                              or _compare(two["losses"], ref[2], "zero=2"))
    if zero1.get("error"):
        out["zero1_losses"] = out["zero1_state"] = zero1["error"]
    else:
        out["zero1_losses"] = _compare(zero1["losses"], ref[1], "ZeRO-1")
        full = zero1["full_state"]
        kb = lambda b: f"{b / 1024:.0f} KB"  # noqa: E731
        if max(states) > 0.75 * full:
            out["zero1_state"] = (f"the fullest rank holds {kb(max(states))} of AdamW's "
                                  f"{kb(full)} of state: every rank keeps all of it")
        elif sum(states) != full:
            out["zero1_state"] = (f"the ranks hold {kb(sum(states))} of state together, "
                                  f"AdamW needs {kb(full)}: each parameter's state exactly once")
    return out


def grade(mesh) -> dict:
    """Grade ``torch_wrap`` on this rank of a 2-rank data-parallel launch (every rank calls):
    ``{"verdicts": {check: reason or None}, "edu3d": {zero: losses}, "yours": {...},
    "state": [bytes per rank], "full_state": bytes}``, the same on every rank."""
    mod = grading.load("torch_wrap")
    corpus = SyntheticCorpus(config().vocab_size, config().seq_len, seed=0)
    dmesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ref = {zero: _edu3d_losses(mesh, zero, corpus) for zero in (3, 2, 1)}
    fsdp = _fsdp(mod, mesh, dmesh, corpus)
    zero1 = _zero1(mod, mesh, dmesh, corpus)
    states = [None, None]
    dist.all_gather_object(states, zero1.get("state", 0))
    mine = _verdicts(fsdp, zero1, ref, states)
    every = [None, None]
    dist.all_gather_object(every, mine)  # a reason on any rank fails the check everywhere
    verdicts = {k: next((v[k] for v in every if v[k]), None) for k in CHECKS}
    return {"verdicts": verdicts, "edu3d": ref,
            "yours": {"ZeRO-3": fsdp[3].get("losses"), "ZeRO-2": fsdp[2].get("losses"),
                      "ZeRO-1": zero1.get("losses")},
            "state": states, "full_state": zero1.get("full_state")}


def table(results: dict) -> str:
    """The losses of each step, edu3d's beside yours, and the AdamW state per rank."""
    mine, ref = results["yours"], results["edu3d"]
    pairs = [("ZeRO-3: FSDP2", ref[3], mine["ZeRO-3"]), ("ZeRO-2: FSDP2", ref[2], mine["ZeRO-2"]),
             ("ZeRO-1: DDP+ZeRO", ref[1], mine["ZeRO-1"])]
    num = lambda v, s: f"{v[s]:>10.6f}" if v else f"{'-':>10}"  # noqa: E731
    lines = ["    " + "".join(f"{name:>20}" for name, _, _ in pairs),
             "step" + f"{'edu3d':>10}{'yours':>10}" * len(pairs)]
    for s in range(STEPS):
        lines.append(f"{s + 1:>4}" + "".join(num(r, s) + num(m, s) for _, r, m in pairs))
    if results["full_state"]:
        kb = ", ".join(f"rank {r} {b / 1024:.0f} KB" for r, b in enumerate(results["state"]))
        lines.append(f"AdamW state under your ddp_zero1: {kb} (unsharded: "
                     f"{results['full_state'] / 1024:.0f} KB)")
    return "\n".join(lines)


def run(timeout: float = 180) -> dict:
    """Launch :func:`grade` on 2 ranks quietly; rank 0's report."""
    res = launch(grade, 2, layout=Layout(dp=2), echo=False, progress=False, timeout=timeout,
                 name="grade_production")
    return res.results[0]


def verdict(results: dict, check: str) -> None:
    """Raise with the reason if ``check`` failed (for :func:`edu3d.course.grading.check`)."""
    reason = results["verdicts"][check]
    if reason:
        raise AssertionError(reason)


# ---- the design: FSDP units and when they reshard ------------------------------------------------
@dataclass(frozen=True)
class Job:
    gpu_gb: float
    act_gb: float  # the activations of one step's micro-batch


BLOCKS, GPUS, BLOCK_PARAMS = 32, 32, 0.4e9
LATENCY_S, LINK_GBS = 5e-3, 60.0  # per collective; each rank's share of the ring
FORWARD_S, BACKWARD_S = 10e-3, 20e-3  # one block's compute
JOBS = {"a": Job(gpu_gb=48, act_gb=20), "b": Job(gpu_gb=80, act_gb=20)}
SLACK = 1.02


def fsdp_cost(job: str, plan) -> Cost:
    """One step's seconds and a rank's peak bytes for ``plan``."""
    assert isinstance(plan, dict) and {"blocks_per_unit", "reshard"} <= set(plan), \
        f"job {job}: fsdp_plan must return a dict with blocks_per_unit and reshard"
    k, reshard = int(plan["blocks_per_unit"]), bool(plan["reshard"])
    assert k >= 1 and BLOCKS % k == 0, \
        f"job {job}: units of {k} blocks do not divide the {BLOCKS} blocks"
    whole = 2 * BLOCK_PARAMS * k  # one unit's bf16 weights (or gradients), whole
    move = LATENCY_S + whole * (GPUS - 1) / GPUS / (LINK_GBS * 1e9)  # gather or scatter
    units = BLOCKS // k
    forward = move + (units - 1) * max(0.0, move - FORWARD_S * k)
    backward = units * max(0.0, (2 if reshard else 1) * move - BACKWARD_S * k) + move
    time = BLOCKS * (FORWARD_S + BACKWARD_S) + forward + backward
    state = 16 * BLOCK_PARAMS * BLOCKS / GPUS  # fp32 weights, gradients and Adam, sharded
    held = 2 * whole + (2 * whole if reshard else 2 * BLOCK_PARAMS * BLOCKS)
    return Cost(time=time, memory=state + JOBS[job].act_gb * 1e9 + held)


def fsdp_plans(job: str):
    for k in range(1, BLOCKS + 1):
        if BLOCKS % k == 0:
            for reshard in (True, False):
                yield {"blocks_per_unit": k, "reshard": reshard}


def target(job: str) -> Target:
    return target_of(fsdp_plans(job), lambda p: fsdp_cost(job, p), JOBS[job].gpu_gb * 1e9, SLACK)


def check_design(ex, job: str) -> None:
    plan = ex.fsdp_plan(job)
    meet(f"job {job}: {plan}", fsdp_cost(job, plan), target(job))


def describe(job: str, plan) -> str:
    """What ``plan`` costs next to the target, or why it is no plan."""
    alone = f", compute alone {fmt_time(BLOCKS * (FORWARD_S + BACKWARD_S))}"
    return plan_line(lambda: fsdp_cost(job, plan), lambda: target(job),
                     lambda c, t: step_line(f"job {job}: {plan}", c, t, "peak {}", alone))
