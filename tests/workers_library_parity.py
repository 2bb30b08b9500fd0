"""Rank functions for tests/test_library_parity.py (issue 36): edu3d's ``DataParallel`` in the
loop a PyTorch user writes for ``DistributedDataParallel``, beside DDP itself and beside one
process on the same rows, case by case; the shared model, data and helpers for the ``Zero``
cases of tests/workers_library_parity_zero.py.

The model is seeded per rank (``100 + rank``), as many scripts do, so every case also checks
that the wrapper starts every rank from rank 0's weights, the frozen random projection
included; the one-process reference is built with rank 0's seed. It forwards each rank's
rows separately and averages the losses: what the ranks compute, BatchNorm's per-rank
statistics included. Every case returns the largest absolute difference of the final
parameters from each reference (``{"serial": e, "torch": e}``), or ``{"error": message}``
when it raised (a misuse case expects one); each runs on a process group of its own, so a
case that fails leaves nothing in flight for the next.
"""

from __future__ import annotations

import contextlib
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from edu3d.parallel.dp.data_parallel import DataParallel

D_IN, D_H, D_OUT, B, STEPS = 6, 8, 3, 4, 3


class Net(nn.Module):
    """Blocks in a ModuleList (ZeRO's units), a frozen random projection, and on request
    BatchNorm, a learnable 0-dim temperature, a float64 head, or a module no forward uses."""

    def __init__(self, seed: int, bn=False, temp=False, unused=False, mixed=False):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(D_IN, D_H)
        self.proj = nn.Linear(D_H, D_H).requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Linear(D_H, D_H) for _ in range(2))
        self.head = nn.Linear(D_H, D_OUT)
        self.bn = nn.BatchNorm1d(D_H) if bn else None
        self.temp = nn.Parameter(torch.tensor(0.9)) if temp else None
        self.extra = nn.Linear(D_H, D_H) if unused else None
        if mixed:
            self.head.double()

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + 0.5 * self.proj(h)
        if self.bn is not None:
            h = self.bn(h)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        out = self.head(h.to(self.head.weight.dtype)).float()
        return out * self.temp if self.temp is not None else out


def batch(step: int, mb: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * mb + rank)
    return torch.randn(B, D_IN, generator=g), torch.randn(B, D_OUT, generator=g)


def loss_of(net, step: int, mb: int, rank: int, serial: bool, world: int, micro: int,
            autocast: bool = False):
    """This rank's loss of micro-batch ``mb`` (the one process: the mean over every rank's
    rows, each rank's rows forwarded on their own, in an autocast region of their own, so
    each casts the weights to bf16 itself as a rank does), divided by the micro-batch count."""
    total = 0
    for r in range(world) if serial else [rank]:
        x, y = batch(step, mb, r)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total = total + F.mse_loss(net(x).float(), y)
    return total / (world if serial else 1) / micro


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups with their own learning rate and weight decay (blocks; the rest)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n.startswith("blocks")], "lr": 0.03,
             "weight_decay": 0.1},
            {"params": [p for n, p in named if not n.startswith("blocks")], "lr": 0.01,
             "weight_decay": 0.02}]


def full(t) -> torch.Tensor:
    """A tensor, or a DTensor made whole."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def state(model: nn.Module, sd: dict | None = None) -> dict:
    """Parameters and buffers by name (from ``sd`` when given, e.g. a gathering state_dict)."""
    sd = model.state_dict() if sd is None else sd
    return {k: full(v).double() for k, v in sd.items() if "num_batches" not in k}


def maxdiff(a: dict, b: dict, keys=None) -> float:
    keys = sorted(b) if keys is None else keys
    missing = [k for k in keys if k not in a]
    assert not missing, f"missing {missing}"
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in keys), default=0.0)


def params_only(sd: dict, model: nn.Module) -> list:
    return [n for n, _ in model.named_parameters() if n in sd]


def guarded(fn, *args, **kwargs) -> dict:
    """``fn``'s result, or ``{"error": ...}`` (both ranks raise alike in every case)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(e).__name__}: {e}", "where": traceback.format_exc(limit=-3)}


# ---- DataParallel ----------------------------------------------------------------------------
def dp_run(who: str, group, micro=1, synced_twice=False, placement="before", clip=None,
           autocast=False, sched=False, compiled=False, net_kw=None, wrap_kw=None) -> dict:
    """``STEPS`` steps of DDP's loop with ``who`` ("edu3d", "torch" or "serial") doing data
    parallelism; ``synced_twice``: the micro-batches' backwards all outside ``no_sync``."""
    rank, world = dist.get_group_rank(group, dist.get_rank()), dist.get_world_size(group)
    model = Net(100 + (0 if who == "serial" else rank), **(net_kw or {}))
    wrap = {"edu3d": lambda m: DataParallel(m, group, **(wrap_kw or {})),
            "torch": lambda m: DDP(m, process_group=group, **(wrap_kw or {})),
            "serial": lambda m: m}[who]
    net = wrap(model)
    run = torch.compile(net, backend="aot_eager") if compiled else net
    opt = torch.optim.AdamW(param_groups(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7 ** s) if sched else None
    norms = []
    for step in range(STEPS):
        if placement == "before":
            opt.zero_grad()
        elif placement == "module":
            net.zero_grad()
        for mb in range(micro):
            quiet = net.no_sync() if who != "serial" and mb < micro - 1 and not synced_twice \
                else contextlib.nullcontext()
            with quiet:
                loss_of(run, step, mb, rank, who == "serial", world, micro, autocast).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if placement == "after":
            opt.zero_grad(set_to_none=False)
    return {"state": state(model), "norms": norms, "keys": sorted(net.state_dict())}


def dp_compare(group_of, **kw) -> dict:
    """edu3d against the one process and against torch DDP, behind the same loop."""
    runs = {who: guarded(dp_run, who, group_of(), **kw) for who in ("edu3d", "torch", "serial")}
    if "error" in runs["edu3d"]:
        return runs["edu3d"]
    got = runs["edu3d"]
    params = [k for k in got["state"] if k in runs["serial"]["state"]
              and not k.startswith("bn.running")]
    out = {"torch": maxdiff(got["state"], runs["torch"]["state"]),
           "serial": maxdiff(got["state"], runs["serial"]["state"], params)}
    if got["norms"]:
        out["norm_vs_torch"] = max(abs(a - b) for a, b in zip(got["norms"], runs["torch"]["norms"]))
        out["clipped"] = min(got["norms"]) > kw["clip"]
    out["same_keys"] = got["keys"] == runs["torch"]["keys"]
    return out


def dp_misuse(group, what: str) -> dict:
    """A forgotten average, refused: the last backward inside ``no_sync`` then ``step``; a
    parameter no backward reached, without ``find_unused_parameters``."""
    rank = dist.get_rank()
    model = Net(100 + rank, unused=what == "unused")
    dp = DataParallel(model, group)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    quiet = dp.no_sync() if what == "no_sync" else contextlib.nullcontext()
    with quiet:
        loss_of(dp, 0, 0, rank, False, 2, 1).backward()
    opt.step()
    return {"stepped": True}


def dp_zero_grad_default(group) -> dict:
    dp = DataParallel(Net(100 + dist.get_rank()), group)
    loss_of(dp, 0, 0, dist.get_rank(), False, 2, 1).backward()
    dp.zero_grad()
    return {"all_none": all(p.grad is None for p in dp.parameters()),
            "is_module": isinstance(dp, nn.Module)}


DP_CASES = {  # name -> dp_run's arguments: DDP's loop, each against DDP and one process
    "dp/loop_as_ddp": {},
    "dp/no_sync_k2": {"micro": 2},
    "dp/second_backward_outside_no_sync": {"micro": 2, "synced_twice": True},
    "dp/zero_grad_after_step": {"placement": "after"},
    "dp/zero_grad_module": {"placement": "module", "micro": 2},
    "dp/groups_and_scheduler": {"sched": True},
    "dp/clip_every_step": {"clip": 0.05},
    "dp/bf16_autocast": {"autocast": True},
    "dp/batchnorm_buffers": {"net_kw": {"bn": True}, "micro": 2},
    "dp/unused_find_unused": {"net_kw": {"unused": True},
                              "wrap_kw": {"find_unused_parameters": True}},
    "dp/mixed_dtypes": {"net_kw": {"mixed": True}},
    "dp/compile_after_wrapping": {"compiled": True},
}


def dp_cases(new_group) -> dict:
    out = {name: guarded(dp_compare, new_group, **kw) for name, kw in DP_CASES.items()}
    out["dp/misuse_last_backward_in_no_sync"] = guarded(dp_misuse, new_group(), "no_sync")
    out["dp/misuse_unused_without_flag"] = guarded(dp_misuse, new_group(), "unused")
    out["dp/zero_grad_default_and_module"] = guarded(dp_zero_grad_default, new_group())
    return out
