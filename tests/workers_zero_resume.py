"""Rank workers for tests/test_zero_resume.py: stop a ``Zero`` run, save it, resume it.

The model is tests/workers_library_zero.py's ``LibModel`` (blocks, a float32 head in a float64
model, a root parameter) with AdamW in two param groups. Every case returns the largest
difference of final parameters (``model.state_dict()``, full tensors at every stage), so the
test reads ``0.0`` as bitwise equal.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from edu3d.parallel.zero.sharding import Zero
from edu3d.parallel.zero.zero_state import to_torch
from tests.workers_library_zero import D, OPTIMIZERS, LibModel, batch, groups, max_diff

HALF, ALL = 2, 4  # save after HALF steps, compare after ALL


def build(stage: int, opt: str = "adamw", **kw) -> tuple[LibModel, Zero]:
    model = LibModel()
    cls, defaults = OPTIMIZERS[opt]
    return model, Zero(model, None, stage, optimizer_class=cls, params=groups(model),
                       **defaults, **kw)


def steps(model, zero, first: int, last: int) -> None:
    """Steps ``first..last`` of the plain loop on this rank's half of each batch."""
    rank = dist.get_rank()
    for step in range(first, last + 1):
        zero.zero_grad()
        model(batch(step).chunk(2)[rank]).backward()
        zero.finish()
        zero.step()


def reference_steps(model, optimizer, first: int, last: int) -> None:
    """The same steps on one process: the mean of the two halves' losses."""
    for step in range(first, last + 1):
        optimizer.zero_grad()
        sum(model(half) / 2 for half in batch(step).chunk(2)).backward()
        optimizer.step()


def reference(steps_: int, opt: str = "adamw") -> tuple[LibModel, torch.optim.Optimizer]:
    model = LibModel()
    cls, defaults = OPTIMIZERS[opt]
    optimizer = cls(groups(model), **defaults)
    reference_steps(model, optimizer, 1, steps_)
    return model, optimizer


def roundtrip(obj):
    """Through ``torch.save`` / ``torch.load`` (``weights_only``, torch's safe default)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def freed(zero) -> bool:
    """ZeRO-3: nothing left gathered, every parameter empty."""
    return all(not u.gathered and u.pending is None for u in zero.units) and \
        all(tuple(p.shape) == (0,) for p in zero.model.parameters())


def state_diff(a: dict, b: dict) -> float:
    """Largest difference between two full optimizer states of the same format (keys too)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for name in a:
        assert a[name].keys() == b[name].keys(), (name, a[name].keys(), b[name].keys())
        for k in a[name]:
            x, y = a[name][k], b[name][k]
            assert x.shape == y.shape and x.dtype == y.dtype, (name, k, x.shape, y.shape)
            worst = max(worst, float((x.double() - y.double()).abs().max()))
    return worst


def resume_worker(mesh, path: str) -> dict:
    """Per stage: 4 steps straight; 2 steps, save, fresh model + Zero, load, 2 steps."""
    out = {}
    ref4 = reference(ALL)[0].state_dict()
    ref_model, ref_opt = reference(HALF)
    torch_full = get_optimizer_state_dict(ref_model, ref_opt,
                                          options=StateDictOptions(full_state_dict=True))
    for stage in (1, 2, 3):
        model, zero = build(stage)
        steps(model, zero, 1, ALL)
        straight = model.state_dict()
        out[f"zero{stage}/straight_vs_one_process"] = max_diff(straight, ref4)

        model, zero = build(stage)
        steps(model, zero, 1, HALF)
        saved = roundtrip({"model": model.state_dict(), "sharded": zero.state_dict(),
                           "full": zero.state_dict(full=True)})
        out[f"zero{stage}/full_vs_fsdp_format"] = state_diff(saved["full"]["state"],
                                                            torch_full["state"])
        out[f"zero{stage}/groups_as_fsdp"] = saved["full"]["param_groups"] == \
            torch_full["param_groups"]
        if stage == 3 and dist.get_rank() == 0:
            torch.save({"model": saved["model"], "full": saved["full"]}, path)
        for form in ("sharded", "full"):
            model, zero = build(stage)
            model.load_state_dict(saved["model"])
            zero.load_state_dict(saved[form])
            if stage == 3:
                out[f"zero3/{form}/freed_after_load"] = freed(zero)
            out[f"zero{stage}/{form}/loaded_vs_saved"] = max_diff(model.state_dict(),
                                                                  saved["model"])
            steps(model, zero, HALF + 1, ALL)
            out[f"zero{stage}/{form}/resumed_vs_straight"] = max_diff(model.state_dict(),
                                                                      straight)
    out.update(zero3_load_checks())
    out.update(sgd_full_form())
    return out


def zero3_load_checks() -> dict:
    """ZeRO-3's ``load_state_dict`` keeps torch's checks and leaves nothing gathered."""
    model, zero = build(3, offload=True)
    steps(model, zero, 1, HALF)
    sd = model.state_dict()
    out = {}
    fresh, fzero = build(3, offload=True)
    try:
        fresh.load_state_dict({k: v for k, v in sd.items() if k != "out.bias"})
        out["zero3/missing_key"] = "no error"
    except RuntimeError as e:
        out["zero3/missing_key"] = str(e)
    out["zero3/freed_after_error"] = freed(fzero)
    wrong = dict(sd, **{"inp.weight": torch.zeros(D + 1, D, dtype=torch.float64)})
    try:
        fresh.load_state_dict(wrong)
        out["zero3/size_mismatch"] = "no error"
    except RuntimeError as e:
        out["zero3/size_mismatch"] = str(e)
    # strict=False: a key the dict lacks keeps its values (and the host master copy follows)
    fresh, fzero = build(3, offload=True)
    fresh.load_state_dict({k: v for k, v in sd.items() if k != "scale"}, strict=False)
    got = fresh.state_dict()
    out["zero3/partial_kept"] = float((got["scale"] - LibModel().scale).abs().max())
    out["zero3/partial_loaded"] = max_diff({k: v for k, v in got.items() if k != "scale"},
                                           {k: v for k, v in sd.items() if k != "scale"})
    out["zero3/offload_host_matches"] = max(
        float((u.host_param - u.shard_param).abs().max()) for u in fzero.units)
    return out


def sgd_full_form() -> dict:
    """Another optimizer's element-wise state (SGD's momentum) through the full form."""
    model, zero = build(3, "sgd")
    steps(model, zero, 1, ALL)
    straight = model.state_dict()
    model, zero = build(3, "sgd")
    steps(model, zero, 1, HALF)
    saved = roundtrip({"model": model.state_dict(), "full": zero.state_dict(full=True)})
    model, zero = build(3, "sgd")
    model.load_state_dict(saved["model"])
    zero.load_state_dict(saved["full"])
    steps(model, zero, HALF + 1, ALL)
    return {"zero3/sgd/full/resumed_vs_straight": max_diff(model.state_dict(), straight)}


def world_one_worker(mesh, path: str) -> dict:
    """World 1: the world-2 ZeRO-3 checkpoint resumes in plain torch and in a 1-rank Zero."""
    saved = torch.load(path)
    ref4 = reference(ALL)[0].state_dict()
    out = {}
    model = LibModel()
    model.load_state_dict(saved["model"])
    cls, defaults = OPTIMIZERS["adamw"]
    optimizer = cls(groups(model), **defaults)
    optimizer.load_state_dict(to_torch(saved["full"], model))
    reference_steps(model, optimizer, HALF + 1, ALL)
    out["plain_torch/resumed_vs_one_process"] = max_diff(model.state_dict(), ref4)
    model, zero = build(3)
    model.load_state_dict(saved["model"])
    zero.load_state_dict(saved["full"])
    for step in range(HALF + 1, ALL + 1):  # the whole batch, as two halves' mean
        zero.zero_grad()
        sum(model(half) / 2 for half in batch(step).chunk(2)).backward()
        zero.finish()
        zero.step()
    out["zero3_world1/resumed_vs_one_process"] = max_diff(model.state_dict(), ref4)
    wrong = dict(zero.state_dict(), world_size=2)  # as if saved by a rank of a 2-rank run
    try:
        zero.load_state_dict(wrong)
        out["sharded_wrong_world"] = "no error"
    except ValueError as e:
        out["sharded_wrong_world"] = str(e)
    return out


class Partial(nn.Module):
    """Blocks that a forward may skip, and a head unit ``[out, skip]`` whose last module
    ``skip`` runs (before ``out``) only when ``use_skip``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.out = nn.Linear(D, 1)
        self.skip = nn.Linear(D, D)
        self.double()
        self.active, self.use_skip = (0, 1, 2), True

    def forward(self, x):
        h = self.inp(x)
        for k in self.active:
            h = h + torch.tanh(self.blocks[k](h))
        if self.use_skip:
            h = h + self.skip(h)
        return self.out(h).sub(1).pow(2).mean()


def pattern(model: Partial, step: int) -> None:
    """Odd steps skip block 1 and ``skip``; even steps use everything."""
    model.active = (0, 2) if step % 2 else (0, 1, 2)
    model.use_skip = step % 2 == 0


PARTIAL_STEPS = 4


def partial_use_worker(mesh) -> dict:
    """ZeRO-3 with find_unused_parameters=True while the used parameters change by step."""
    rank = dist.get_rank()
    ref = Partial()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02, weight_decay=0.1)
    for step in range(1, PARTIAL_STEPS + 1):
        pattern(ref, step)
        ref_opt.zero_grad()
        sum(ref(half) / 2 for half in batch(step).chunk(2)).backward()
        ref_opt.step()
    out = {}
    for prefetch in (False, True):
        model = Partial()
        zero = Zero(model, None, 3, optimizer_class=torch.optim.AdamW, lr=0.02,
                    weight_decay=0.1, find_unused_parameters=True, prefetch=prefetch)
        after_forward, after_step = [], []
        for step in range(1, PARTIAL_STEPS + 1):
            pattern(model, step)
            zero.zero_grad()
            loss = model(batch(step).chunk(2)[rank])
            after_forward.append([u.name for u in zero.units if u.gathered or u.pending])
            loss.backward()
            zero.finish()
            zero.step()
            after_step.append([u.name for u in zero.units if u.gathered or u.pending])
        with torch.no_grad():
            pattern(model, 1)
            model(batch(9))  # an evaluation forward leaves nothing gathered either
        out[f"prefetch={prefetch}"] = {
            "after_forward": after_forward, "after_step": after_step,
            "after_eval": [u.name for u in zero.units if u.gathered or u.pending],
            "vs_one_process": max_diff(model.state_dict(), ref.state_dict()),
            "skip_moved": float((model.state_dict()["skip.weight"]
                                 - Partial().skip.weight).abs().max())}
    return out
