"""Rank workers for tests/test_library_zero.py: ``Zero`` as a library in a plain PyTorch loop.

Every rank builds the same small model (not edu3d's GPT: blocks, a head called ``out``, a
parameter on the root, a float32 head in a float64 model, an optional extra module), trains
it with ``Zero`` on its half of the batch and, beside it, a single-process reference with
the same torch optimizer on the whole batch; each case returns the largest difference of
the final parameters (read through ``model.state_dict()``, which gathers under ZeRO-3).
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
import torch.nn as nn

from edu3d.parallel.zero.sharding import Zero

D, BATCH, STEPS = 6, 8, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class LibModel(nn.Module):
    """Blocks, a head called ``out`` (float32 in a float64 model), a root parameter, and
    ``extra``, used only where ``use_extra`` is set."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.rand(D) + 0.5)
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(D, 1)
        self.extra = nn.Linear(D, D)
        self.double()
        self.out.float()
        self.use_extra = True

    def forward(self, x):
        h = self.inp(x * self.scale)
        for b in self.blocks:
            h = b(h)
        if self.use_extra:
            h = h + self.extra(h)
        return self.out(h.float()).double().sub(1).pow(2).mean()


def batch(step: int) -> torch.Tensor:
    return torch.randn(BATCH, D, generator=torch.Generator().manual_seed(step),
                       dtype=torch.float64)


def groups(model: nn.Module) -> list[dict]:
    """Two param groups with their own lr and weight decay."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.startswith("blocks")], "lr": 0.03,
             "weight_decay": 0.1},
            {"params": [p for n, p in named if not n.startswith("blocks")], "lr": 0.01,
             "weight_decay": 0.02}]


OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"betas": (0.9, 0.999), "eps": 1e-8}),
              "sgd": (torch.optim.SGD, {"momentum": 0.9, "lr": 0.05})}


def reference(opt: str, extra_on: tuple[bool, bool]) -> dict:
    """One process, the whole batch: the loss is the mean of the two halves' losses (rank
    r's half uses ``extra`` when ``extra_on[r]``)."""
    model = LibModel()
    cls, kw = OPTIMIZERS[opt]
    optimizer = cls(groups(model), **kw)
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        x = batch(step)
        loss = 0
        for r, half in enumerate(x.chunk(2)):
            model.use_extra = extra_on[r]
            loss = loss + model(half) / 2
        loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(stage: int, opt: str, placement: str, extra_on: tuple[bool, bool],
          find_unused: bool = False) -> tuple[LibModel, Zero]:
    """``STEPS`` steps of the plain loop with ``zero_grad`` where ``placement`` says."""
    rank = dist.get_rank()
    model = LibModel()
    model.use_extra = extra_on[rank]
    cls, kw = OPTIMIZERS[opt]
    zero = Zero(model, None, stage, optimizer_class=cls, params=groups(model),
                find_unused_parameters=find_unused, **kw)
    for step in range(1, STEPS + 1):
        if placement == "zero_first":
            zero.zero_grad()
        elif placement == "model_first":
            model.zero_grad()
        elif placement == "zeros_first":
            zero.zero_grad(set_to_none=False)
        loss = model(batch(step).chunk(2)[rank])
        loss.backward()
        zero.finish()
        zero.step()
        if placement == "zero_after":
            zero.zero_grad()
        elif placement == "model_after":
            model.zero_grad()
    return model, zero


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def library_worker(mesh) -> dict:
    """Every case: ``{name: max |zero - reference|}``, plus the checks that are not numbers."""
    out, refs = {}, {}

    def ref(opt, extra_on):
        if (opt, extra_on) not in refs:
            refs[opt, extra_on] = reference(opt, extra_on)
        return refs[opt, extra_on]

    both, neither, rank1 = (True, True), (False, False), (False, True)
    for stage in (1, 2, 3):
        for opt in OPTIMIZERS:
            model, _ = train(stage, opt, "zero_first", both)
            out[f"zero{stage}/{opt}"] = max_diff(model.state_dict(), ref(opt, both))
        for placement in ("model_first", "zero_after", "model_after", "zeros_first"):
            model, _ = train(stage, "adamw", placement, both)
            out[f"zero{stage}/adamw/{placement}"] = max_diff(model.state_dict(), ref("adamw", both))
        # a module no rank uses: torch's AdamW leaves it alone (p.grad stays None)
        model, _ = train(stage, "adamw", "zero_first", neither, find_unused=True)
        sd = model.state_dict()
        out[f"zero{stage}/unused"] = max_diff(sd, ref("adamw", neither))
        out[f"zero{stage}/unused_moved"] = float((sd["extra.weight"] - LibModel().extra.weight)
                                                 .abs().max())
        if stage < 3:  # used by rank 1 only: stepped everywhere, with rank 1's half
            model, _ = train(stage, "adamw", "zero_first", rank1, find_unused=True)
            out[f"zero{stage}/used_by_one_rank"] = max_diff(model.state_dict(), ref("adamw", rank1))
        try:
            train(stage, "adamw", "zero_first", neither)
            out[f"zero{stage}/unused_error"] = "no error"
        except RuntimeError as e:
            out[f"zero{stage}/unused_error"] = str(e)
    initial = LibModel().state_dict()
    out["reference_moved"] = {opt: max_diff(ref(opt, both), initial) for opt in OPTIMIZERS}
    out["zero3/freed"] = freed_checks()
    return out


def freed_checks() -> dict:
    """ZeRO-3 outside forward: parameters are safe to touch; state_dict is full and saves."""
    model, zero = train(3, "adamw", "zero_first", (True, True))
    p = model.blocks[0].fc.weight
    touched = {"shape": tuple(p.shape), "norm": float(p.norm()), "repr": len(repr(p)),
               "clone": tuple(p.clone().shape)}
    sd = model.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    plain = LibModel()
    plain.load_state_dict(torch.load(buf))
    gathered = zero.full_tensors("param")
    full = {n: gathered[q] for n, q in model.named_parameters()}
    still_freed = tuple(p.shape)
    loss_again = float(model(batch(9).chunk(2)[dist.get_rank()]))  # gathers again
    return {"touched": touched, "still_freed": still_freed, "loss_again": loss_again,
            "vs_full_tensors": max_diff({n: sd[n] for n in full}, full),
            "saved_vs_reference": max_diff(plain.state_dict(), reference("adamw", (True, True)))}
