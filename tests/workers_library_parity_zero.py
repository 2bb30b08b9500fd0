"""Rank functions for tests/test_library_parity.py (issue 36): edu3d's ``Zero`` in a plain
training loop at every stage, beside one process on the same rows and beside torch's own
classes behind the same loop (ZeRO-1: DDP + ``ZeroRedundancyOptimizer``; ZeRO-2/3: FSDP2's
``fully_shard``, without and with resharding after forward); then the misuses that must be
clear errors, the 0-dim parameter through a world-2 save and a world-1 resume, and ZeRO-3's
``state_dict`` called by rank 0 alone. :func:`all_cases` runs these and the
``DataParallel`` cases of tests/workers_library_parity.py in one 2-rank launch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from edu3d.parallel.zero.sharding import Zero
from edu3d.parallel.zero.zero_state import to_torch
from tests.workers_library_parity import (STEPS, Net, dp_cases, full, guarded, loss_of,
                                          maxdiff, param_groups, params_only, state)

OPTIMIZERS = {"adamw": (torch.optim.AdamW, {}), "sgd": (torch.optim.SGD, {"momentum": 0.9}),
              "adafactor": (torch.optim.Adafactor, {"lr": 0.01})}


def build(who: str, stage: int, group, opt: str, net_kw=None, zero_kw=None, mp=False,
          torch_ref="native"):
    """``(model, stepper, optimizer)``: ``stepper`` is the Zero, or the torch wrapper.
    ``torch_ref``: ``"native"`` (ZeRO-1 and whole-tensor optimizers: DDP +
    ``ZeroRedundancyOptimizer``; ZeRO-2/3: FSDP2) or ``"ddp"`` (DDP + the plain optimizer:
    buffers, unused parameters, mixed dtypes)."""
    rank = dist.get_group_rank(group, dist.get_rank())
    cls, kw = OPTIMIZERS[opt]
    model = Net(100 + (rank if who == "edu3d" else 0), **(net_kw or {}))
    if who == "edu3d":
        zero = Zero(model, group, stage, optimizer_class=cls, params=param_groups(model),
                    **kw, **(zero_kw or {}))
        return model, zero, zero.optimizer
    if who == "serial":
        return model, model, cls(param_groups(model), **kw)
    if torch_ref == "ddp":
        net = DDP(model, process_group=group,
                  find_unused_parameters=bool((zero_kw or {}).get("find_unused_parameters")))
        return model, net, cls(param_groups(model), **kw)
    if stage == 1 or opt == "adafactor":  # ZeroRedundancyOptimizer: whole tensors per rank
        net = DDP(model, process_group=group)
        return model, net, ZeroRedundancyOptimizer(param_groups(model), optimizer_class=cls,
                                                   process_group=group, **kw)
    mesh = DeviceMesh.from_group(group, "cpu")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mp else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=stage == 3, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3, mp_policy=policy)
    return model, model, cls(param_groups(model), **kw)


def zero_run(who: str, stage: int, group, opt="adamw", sched=False, clip=None, micro=1,
             per_step=False, autocast=False, finish_between=False, mp=False, net_kw=None,
             zero_kw=None, torch_ref="native") -> dict:
    """``STEPS`` steps of the loop; ``finish_between``: backward, finish, backward, finish."""
    rank, world = dist.get_group_rank(group, dist.get_rank()), dist.get_world_size(group)
    zkw = dict(zero_kw or {}, **({"grad_reduce": "per-step"} if per_step else {}),
               **({"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if mp else {}))
    model, net, optimizer = build(who, stage, group, opt, net_kw, zkw, mp, torch_ref)
    zero = net if who == "edu3d" else None
    fsdp = who == "torch" and not isinstance(net, DDP) and net is model
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.7 ** s) if sched else None
    norms = []
    for step in range(STEPS):
        (zero or optimizer).zero_grad()
        for mb in range(micro):
            hold = per_step and mb < micro - 1  # accumulate locally, reduce once
            quiet = contextlib.nullcontext()
            if fsdp:
                model.set_requires_gradient_sync(not hold)
            elif hold and who != "serial":
                quiet = net.no_sync()
            with quiet:
                loss_of(model if zero else net, step, mb, rank, who == "serial", world, micro,
                        autocast).backward()
            if zero is not None and (finish_between or mb == micro - 1):
                zero.finish()
        if clip is not None:
            norm = zero.clip_grad_norm_(clip) if zero is not None else \
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(float(full(norm)))
        (zero or optimizer).step()
        if scheduler is not None:
            scheduler.step()
    sd = model.state_dict()  # ZeRO-3 and mixed precision: gathered, collective
    return {"state": state(model, sd), "params": params_only(sd, model), "norms": norms,
            "numel": zero.numel() if zero is not None else None}


def zero_compare(group_of, stage: int, torch_ref="native", **kw) -> dict:
    runs = {who: guarded(zero_run, who, stage, group_of(), torch_ref=torch_ref, **kw)
            for who in ("edu3d", "torch", "serial") if who != "torch" or torch_ref}
    if "error" in runs["edu3d"]:
        return runs["edu3d"]
    got, ref = runs["edu3d"], runs["serial"]
    keys = [k for k in got["params"]]
    out = {"serial": maxdiff(got["state"], ref["state"], keys),
           "numel_ok": got["numel"] == sum(p.numel() for p in Net(0, **(kw.get("net_kw") or {}))
                                            .parameters())}
    if torch_ref:
        if "error" in runs["torch"]:
            return {"error": "torch reference: " + runs["torch"]["error"]}
        both = keys + [k for k in got["state"] if k.startswith("bn.running")]
        out["torch"] = maxdiff(got["state"], runs["torch"]["state"], both)
    if got["norms"]:
        out["norm_vs_serial"] = max(abs(a - b) for a, b in zip(got["norms"], ref["norms"]))
        out["clipped"] = min(got["norms"]) > kw["clip"]
    return out


def mixed_precision(group_of, stage: int) -> dict:
    """param_dtype=bf16, reduce_dtype=fp32 against FSDP2's MixedPrecisionPolicy."""
    got = guarded(zero_run, "edu3d", stage, group_of(), mp=True)
    if "error" in got:
        return got
    ref = zero_run("torch", max(stage, 2), group_of(), mp=True)  # ZeRO-1 ~ FSDP2 unresharded
    fp32 = zero_run("serial", stage, group_of())
    return {"torch": maxdiff(got["state"], ref["state"], got["params"]),
            "fp32_serial_gap": maxdiff(got["state"], fp32["state"], got["params"]),
            "fp32_dtypes": all(v.dtype == torch.float64 for v in got["state"].values())}


def gradients(group, stage: int) -> dict:
    """What ``p.grad`` holds after ``finish()``: ZeRO-1 the full average (the one process's
    gradient); ZeRO-2/3 a placeholder that torch's clip_grad_norm_ cannot read."""
    rank = dist.get_group_rank(group, dist.get_rank())
    model, zero, _ = build("edu3d", stage, group, "adamw")
    loss_of(model, 0, 0, rank, False, 2, 1).backward()
    zero.finish()
    if stage > 1:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return {"clipped_with_torch": True}
    serial = Net(100)
    loss_of(serial, 0, 0, rank, True, 2, 1).backward()
    want = dict(serial.named_parameters())
    return {"serial": max(float((p.grad - want[n].grad).abs().max())
                          for n, p in model.named_parameters() if p.requires_grad)}


def misuse(group, stage: int, what: str) -> dict:
    rank = dist.get_rank()
    model, zero, _ = build("edu3d", stage, group, "adamw")
    own = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss_of(model, 0, 0, rank, False, 2, 1).backward()
    if what == "no_finish":
        zero.step()
    elif what == "own_optimizer":  # FSDP2's habit: an optimizer over model.parameters()
        zero.finish()
        own.step()
    elif what == "inner_step":
        zero.finish()
        zero.optimizer.step()
    elif what == "step_lr":
        zero.finish()
        zero.step(0.5)
    return {"stepped": True}


def resume_at_world_one(group, singles, stage: int, opt: str) -> dict:
    """A 0-dim temperature: 2 steps at world 2, saved (model + full optimizer state), then
    steps 3.. at world 1 in a 1-rank Zero and in plain torch; against one process."""
    rank = dist.get_rank()
    half = 2
    cls, kw = OPTIMIZERS[opt]
    model, zero, _ = build("edu3d", stage, group, opt, {"temp": True})
    for step in range(half):
        zero.zero_grad()
        loss_of(model, step, 0, rank, False, 2, 1).backward()
        zero.finish()
        zero.step()
    saved = {"model": model.state_dict(), "full": zero.state_dict(full=True)}
    one = Net(7, temp=True)
    solo = Zero(one, singles[rank], stage, optimizer_class=cls, params=param_groups(one), **kw)
    one.load_state_dict(saved["model"])
    solo.load_state_dict(saved["full"])
    plain = Net(8, temp=True)
    plain.load_state_dict(saved["model"])
    plain_opt = cls(param_groups(plain), **kw)
    plain_opt.load_state_dict(to_torch(saved["full"], plain))
    ref = Net(100, temp=True)
    ref_opt = cls(param_groups(ref), **kw)
    for step in range(STEPS + 1):
        if step >= half:
            solo.zero_grad()
            loss_of(one, step, 0, rank, True, 2, 1).backward()
            solo.finish()
            solo.step()
            plain_opt.zero_grad()
            loss_of(plain, step, 0, rank, True, 2, 1).backward()
            plain_opt.step()
        ref_opt.zero_grad()
        loss_of(ref, step, 0, rank, True, 2, 1).backward()
        ref_opt.step()
    keys = [n for n, _ in ref.named_parameters()]
    return {"serial": maxdiff(state(one), state(ref), keys),
            "plain_torch_vs_serial": maxdiff(state(plain), state(ref), keys)}


def state_dict_on_rank0_only(group) -> dict:
    """The DDP idiom ``if rank == 0: torch.save(model.state_dict(), f)`` under ZeRO-3."""
    model, zero, _ = build("edu3d", 3, group, "adamw")
    zero.collective_wait_s = 3.0
    if dist.get_rank() == 0:
        model.state_dict()
    return {"saved": True}


ZERO_CASES = {  # name -> zero_compare's arguments, at each stage
    "adamw_groups_scheduler": {"sched": True},
    "sgd_clip": {"opt": "sgd", "clip": 0.05},
    "no_sync_k2": {"micro": 2, "per_step": True},
    "finish_backward_finish": {"micro": 2, "finish_between": True},
    "bf16_autocast": {"autocast": True},
    "batchnorm_broadcast_buffers": {"net_kw": {"bn": True}, "torch_ref": "ddp", "micro": 2,
                                    "zero_kw": {"broadcast_buffers": True}},
    "unused_find_unused": {"net_kw": {"unused": True}, "torch_ref": "ddp",
                           "zero_kw": {"find_unused_parameters": True}},
    "mixed_dtypes": {"net_kw": {"mixed": True}, "torch_ref": "ddp"},
    "adafactor": {"opt": "adafactor"},
}
MISUSES = ("no_finish", "own_optimizer", "inner_step", "step_lr")


def zero_cases(new_group) -> dict:
    out = {}
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    for s in (1, 2, 3):
        for name, kw in ZERO_CASES.items():
            out[f"zero{s}/{name}"] = guarded(zero_compare, new_group, s, **kw)
        out[f"zero{s}/adafactor_world1"] = guarded(
            zero_compare, lambda: singles[dist.get_rank()], s, None, opt="adafactor")
        out[f"zero{s}/grad_after_finish"] = guarded(gradients, new_group(), s)
        for what in MISUSES:
            out[f"zero{s}/misuse_{what}"] = guarded(misuse, new_group(), s, what)
        for opt in ("adamw", "adafactor"):  # sharded by elements; by whole tensors
            out[f"zero{s}/resume_at_world1_0dim_{opt}"] = guarded(
                resume_at_world_one, new_group(), singles, s, opt)
        out[f"zero{s}/mixed_precision_vs_fsdp2"] = guarded(mixed_precision, new_group, s)
    out["zero3/state_dict_on_rank0_only"] = guarded(state_dict_on_rank0_only, new_group())
    dist.barrier()
    return out


def all_cases(mesh) -> dict:
    """Every case of both files, each on a fresh 2-rank process group."""
    world = list(range(dist.get_world_size()))

    def new_group():
        return dist.new_group(world)

    return {**dp_cases(new_group), **zero_cases(new_group)}
