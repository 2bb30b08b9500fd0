"""Rank functions for tests/test_moe.py: expert parallelism and the context-parallel token
group, each checked against the serial MoE layer (4 ranks, groups made with new_group)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from edu3d.distributed import comm
from edu3d.model.gpt import MLP, GPTConfig
from edu3d.model.moe import MoE, TokenGroups
from edu3d.parallel.ep import apply_ep, combine, dispatch, expert_param_names


def err(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def gen(seed):
    return torch.Generator().manual_seed(seed)


def identity_round_trip(group, ep: int, rank: int) -> dict:
    """Rows sorted by expert go out and come back; each 'expert' adds its id, so a row that
    reached the wrong expert shows. Gradients come back to the source unchanged."""
    E = 8
    per_expert = torch.randint(0, 4, (E,), generator=gen(100 + rank))
    per_expert[rank % E] = 0  # an empty segment
    xs = torch.randn(int(per_expert.sum()), 5, generator=gen(rank)).requires_grad_()
    x_local, route = dispatch(xs, per_expert, group)
    first = dist.get_rank(group) * (E // ep)
    ids = torch.cat([torch.full((c,), float(first + e)) for e, c in enumerate(route.per_local)])
    back = combine(x_local + ids[:, None], route, group)
    expect = xs + torch.repeat_interleave(torch.arange(E).float(), per_expert)[:, None]
    w = torch.randn(xs.shape, generator=gen(7))
    (back * w).sum().backward()
    return {"exact": bool(torch.equal(back, expect)), "grad": bool(torch.equal(xs.grad, w)),
            "rows": sum(route.recv) == x_local.shape[0]}


def moe_config(cap: float) -> GPTConfig:
    return GPTConfig(d_model=16, n_heads=1, n_experts=8, topk=2, shared_experts=1,
                     capacity_factor=cap, aux_loss_coef=0.01, z_loss_coef=1e-3,
                     router_dtype="fp64")


def serial_layer(cfg) -> MoE:
    torch.manual_seed(0)
    layer = MoE(cfg, MLP)
    with torch.no_grad():  # a sharper router than N(0, 0.02): real choices, some drops
        layer.router.weight.normal_(0.0, 1.0, generator=gen(1))
    return layer


def ep_vs_serial(group, members: list[int], rank: int, cap: float, aux_only: bool) -> dict:
    """The EP layer on this rank's tokens against the serial layer run once per member's
    tokens (each forward call is its own token group, as on the real ranks)."""
    cfg = moe_config(cap)
    serial = serial_layer(cfg)
    holder = nn.ModuleDict({"mlp": copy.deepcopy(serial)})
    ep = len(members)
    apply_ep(holder, group, members.index(rank), ep)
    layer = holder["mlp"]

    def loss_of(out, r):
        w = torch.randn(out.shape, generator=gen(50 + r))
        return (out * w).sum() * (0.0 if aux_only else 1.0)

    xs = {r: torch.randn(2, 6, 16, generator=gen(10 + r)).requires_grad_() for r in members}
    outs = {}
    for r in members:
        outs[r] = serial(xs[r])
        loss_of(outs[r], r).backward()
    x = xs[rank].detach().clone().requires_grad_()
    out = layer(x)
    loss_of(out, rank).backward()
    stats = layer.take_stats()

    res = {"out": err(out, outs[rank]), "dx": err(x.grad, xs[rank].grad)}
    sp = dict(serial.named_parameters())
    res["experts"] = max(err(p.grad, sp[f"experts.{n}"].grad)
                         for n, p in layer.experts.named_parameters())
    replicated = {"router.weight": layer.router.weight,
                  **{f"shared.{n}": p for n, p in layer.shared.named_parameters()}}
    worst = 0.0
    for n, p in replicated.items():  # summed over the group = the serial sum over members
        g = p.grad.clone()
        comm.all_reduce(g, group)
        worst = max(worst, err(g, sp[n].grad))
    res["replicated"] = worst
    res["held"] = sorted(layer.experts.keys(), key=int)
    res["names"] = sorted(expert_param_names(holder))[:2]
    res["matrix_row_sum"] = int(stats["matrix"].sum())
    res["kept"] = 2 * 12 - stats["dropped"]
    res["router_grad"] = float(layer.router.weight.grad.abs().sum())
    return res


def cp_vs_serial(group, members: list[int], rank: int, cap: float) -> dict:
    """Two ranks each hold part of the same sequences (positions zigzag, as context
    parallelism balances them): outputs, stats and gradients averaged over the two must be
    the serial layer's on the whole sequences, capacity decided over the whole group."""
    cfg = moe_config(cap)
    serial = serial_layer(cfg)
    layer = copy.deepcopy(serial)
    c = members.index(rank)
    pos = torch.tensor([0, 1, 2, 9, 10, 11]) if c == 0 else torch.arange(3, 9)
    layer.use_groups(TokenGroups(group, len(members), c, pos, collectives=comm))

    x = torch.randn(2, 12, 16, generator=gen(3)).requires_grad_()
    w = torch.randn(2, 12, 16, generator=gen(4))
    out = serial(x)
    (out * w).mean().backward()
    s_stats = serial.take_stats()

    xl = x.detach()[:, pos].clone().requires_grad_()
    ol = layer(xl)
    (ol * w[:, pos]).mean().backward()
    stats = layer.take_stats()
    worst = 0.0
    sp = dict(serial.named_parameters())
    for n, p in layer.named_parameters():  # averaged over the cp ranks = serial
        g = p.grad.clone()
        comm.all_reduce(g, group)
        worst = max(worst, err(g / len(members), sp[n].grad))
    dropped = torch.tensor([stats["dropped"]])
    comm.all_reduce(dropped, group)
    return {"out": err(ol, out[:, pos]), "params": worst,
            "dx": err(xl.grad, len(members) * x.grad[:, pos]),
            "aux": abs(stats["aux"] - s_stats["aux"]),
            "dropped": (int(dropped), s_stats["dropped"])}


def moe_checks(mesh) -> dict:
    rank = dist.get_rank()
    pairs = [[0, 1], [2, 3]]
    g2 = [dist.new_group(p) for p in pairs]
    g4 = dist.new_group([0, 1, 2, 3])
    mine = pairs[rank // 2]
    group2 = g2[rank // 2]
    out = {"identity2": identity_round_trip(group2, 2, rank),
           "identity4": identity_round_trip(g4, 4, rank)}
    for cap in (0.0, 1.0):
        out[f"ep2 cap{cap}"] = ep_vs_serial(group2, mine, rank, cap, aux_only=False)
        out[f"ep4 cap{cap}"] = ep_vs_serial(g4, [0, 1, 2, 3], rank, cap, aux_only=False)
        out[f"cp2 cap{cap}"] = cp_vs_serial(group2, mine, rank, cap)
    out["ep4 aux only"] = ep_vs_serial(g4, [0, 1, 2, 3], rank, 1.0, aux_only=True)
    return out
