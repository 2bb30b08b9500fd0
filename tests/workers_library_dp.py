"""Rank functions for tests/test_library_dp.py: edu3d's DataParallel used as a library in an
ordinary PyTorch loop, beside torch's own DistributedDataParallel on the same awkward models
(BatchNorm and a random buffer, an unused branch, mixed dtypes, a module tree that is not
edu3d's GPT). Every case returns tensors (small models) so the test compares them; a case
that raises returns ``{"error": ...}`` instead, so one launch runs every case."""

from __future__ import annotations

import contextlib
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from edu3d.distributed import trace
from edu3d.parallel.dp.data_parallel import IMPLS, DataParallel

STEPS = 3
PLACEMENTS = ("before", "before_keep", "after", "after_keep", "model", "never", "dp")


class Plain(nn.Module):
    """A two-layer MLP: no buffers, no batch statistics, so the serial run is comparable."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.body(x)


class Net(nn.Module):
    """A non-GPT tree: BatchNorm (running statistics), a random buffer that differs per
    rank until broadcast, and two branches of which ``forward`` uses those it is told."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.branch = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)})
        self.head = nn.Linear(8, 3)
        self.register_buffer("noise", 0.1 * torch.randn(8))

    def forward(self, x, branches=("a",)):
        h = torch.relu(self.bn(self.stem(x))) + self.noise
        return self.head(sum(self.branch[k](h) for k in branches))


class Mixed(nn.Module):
    """fp32, fp64 and bf16 layers in one model (parameters of three dtypes)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8).double()
        self.c = nn.Linear(8, 3).to(torch.bfloat16)

    def forward(self, x):
        h = torch.tanh(self.b(self.a(x).double()))
        return self.c(h.to(torch.bfloat16)).float()


MODELS = {"plain": Plain, "net": Net, "mixed": Mixed}


def make(kind: str) -> nn.Module:
    torch.manual_seed(100 + dist.get_rank())  # ranks differ until the wrapper broadcasts
    return MODELS[kind]()


def batch(step: int, mb: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * mb + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def train(who: str, kind: str, group, impl: str = "bucketed", placement: str = "before",
          micro: int = 1, optim: str = "sgd", unused: bool = False, branches=None,
          eval_between: bool = False, **wrap) -> dict:
    """``STEPS`` steps of an ordinary loop with ``who`` ("edu3d", "torch" or "serial") doing
    data parallelism; ``placement`` says where (and how) gradients are zeroed."""
    rank = dist.get_rank()
    model = make(kind)
    dp, net = None, model
    if who == "torch":
        net = DistributedDataParallel(model, process_group=group, **wrap)
    elif who == "edu3d":
        dp = DataParallel(model, group, impl, bucket_mb=1e-4, first_bucket_mb=None, **wrap)
    else:  # serial: rank 0's initial weights, every rank's rows
        torch.manual_seed(100)
        model = net = MODELS[kind]()
    if optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    world = range(dist.get_world_size())
    out = {"grads": [], "buffers": []}
    for step in range(STEPS):
        if placement in ("before", "model", "dp"):
            if placement == "model":
                model.zero_grad()
            elif placement == "dp" and dp is not None:
                dp.zero_grad()
            else:
                opt.zero_grad(set_to_none=placement != "dp")
        elif placement == "before_keep":
            opt.zero_grad(set_to_none=False)
        for mb in range(micro):
            if who == "serial":
                x, y = (torch.cat(t) for t in zip(*(batch(step, mb, r) for r in world)))
            else:
                x, y = batch(step, mb, rank)
            kw = {} if branches is None else {"branches": branches(rank)}
            quiet = (dp.no_sync() if dp else net.no_sync()) if (
                mb < micro - 1 and who != "serial") else contextlib.nullcontext()
            with quiet:
                loss = nn.functional.mse_loss(net(x, **kw), y) / micro
                loss.backward()
        if dp is not None:
            dp.finish()
        out["grads"].append({n: None if p.grad is None else p.grad.detach().clone()
                             for n, p in model.named_parameters()})
        opt.step()
        if placement in ("after", "after_keep"):
            opt.zero_grad(set_to_none=placement == "after")
        if eval_between:  # a forward without gradients: torch syncs buffers before it too
            with torch.no_grad():
                net(batch(step, 9, rank)[0], **kw)
        out["buffers"].append({n: b.clone() for n, b in model.named_buffers()})
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["state"] = sorted(n for n, p in model.named_parameters() if opt.state.get(p))
    return out


def guarded(fn, *args, **kwargs) -> dict:
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (old code raised symmetrically on every rank)
        return {"error": f"{type(e).__name__}: {e}",
                "where": traceback.format_exc(limit=-2)}


def zero_grad_cases(group) -> dict:
    """Every impl x every placement of zero_grad, beside torch DDP and the serial run; with
    two micro-batches (no_sync on the first) for the usual 'zero before forward' loop."""
    out = {}
    for placement in PLACEMENTS:
        for micro in (1, 2):
            if micro == 2 and placement not in ("before", "dp"):
                continue
            key = f"{placement}/k{micro}"
            out[f"torch/{key}"] = train("torch", "plain", group, placement=placement,
                                        micro=micro)
            out[f"serial/{key}"] = train("serial", "plain", group, placement=placement,
                                         micro=micro)
            for impl in IMPLS:
                out[f"{impl}/{key}"] = guarded(train, "edu3d", "plain", group, impl,
                                               placement, micro)
    return out


def mixed_dtype_cases(group) -> dict:
    out = {"torch": train("torch", "mixed", group)}
    for impl in IMPLS:
        out[impl] = guarded(train, "edu3d", "mixed", group, impl)
    return out


def unused_cases(group) -> dict:
    """An unused branch with AdamW (weight decay 0.5): globally unused ('b' on no rank),
    and unused on one rank only ('b' on rank 0 alone), with find_unused_parameters; and
    without it (an error naming the parameter)."""
    out = {}
    shapes = {"global": lambda r: ("a",), "one_rank": lambda r: ("a", "b") if r == 0 else ("a",)}
    for name, branches in shapes.items():
        for placement in ("before", "before_keep"):
            key = f"{name}/{placement}"
            out[f"torch/{key}"] = train("torch", "net", group, placement=placement,
                                        optim="adamw", branches=branches,
                                        find_unused_parameters=True)
            for impl in IMPLS:
                out[f"{impl}/{key}"] = guarded(
                    train, "edu3d", "net", group, impl, placement, optim="adamw",
                    branches=branches, find_unused_parameters=True)
    for impl in IMPLS:
        out[f"{impl}/strict"] = guarded(train, "edu3d", "net", group, impl,
                                        branches=shapes["global"])
    return out


def buffer_cases(group) -> dict:
    """BatchNorm statistics and a per-rank random buffer, with no_sync micro-batches and a
    no-grad forward between steps: buffers as torch DDP leaves them, on every rank."""
    out, both = {}, lambda r: ("a", "b")
    for flag in (True, False):
        common = dict(micro=2, eval_between=True, branches=both, broadcast_buffers=flag)
        out[f"torch/{flag}"] = train("torch", "net", group, **common)
        for impl in IMPLS:
            out[f"{impl}/{flag}"] = guarded(train, "edu3d", "net", group, impl, **common)
    with trace.use(trace.Recorder(dist.get_rank())) as rec:
        guarded(train, "edu3d", "net", group, "bucketed", micro=2, eval_between=True,
                branches=both)
    out["broadcasts"] = [(e["op"], e["group"], e["bytes"]) for e in rec.events
                         if e["op"] == "broadcast"]
    out["n_params"] = len(list(Net().parameters()))
    return out


def all_cases(mesh) -> dict:
    group = mesh.group("dp")
    return {"zero_grad": zero_grad_cases(group), "mixed": mixed_dtype_cases(group),
            "unused": unused_cases(group), "buffers": buffer_cases(group)}
