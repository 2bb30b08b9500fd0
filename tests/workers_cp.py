"""Rank functions for the context-parallelism tests (tests/test_cp_attention.py): every check
of one 4-rank launch, each returning worst relative errors so the test can assert on them."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from edu3d.distributed import comm
from edu3d.model.gpt import GPT, GPTConfig, document_mask
from edu3d.parallel.recompute import apply_recompute
from edu3d.parallel.tp import apply_tp, partial_grad_names, unshard
from edu3d.parallel.cp import (IMPLS, apply_cp, cp_core, last_work, split_batch, split_tokens,
                               ulysses_attention)

SPLITS = ("zigzag", "plain")
# Two packed rows of 16 tokens. Row 0's documents start at 4 and 8, exactly where the chunks
# of cp=2 zigzag (4 tokens) and cp=4 (2 tokens) meet; row 1's start at 3, 13 and 15, inside
# chunks, and its second document spans chunks of every rank.
DOCS = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2],
                     [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3]])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _groups() -> dict[int, tuple]:
    """cp -> (group, rank in it): cp=4 is the world, cp=2 is [0,1] or [2,3]."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1], group_desc="cp01"), dist.new_group([2, 3], group_desc="cp23")]
    return {4: (dist.group.WORLD, rank), 2: (pairs[rank // 2], rank % 2)}


def attention_checks(group, cp_rank: int, cp: int, dtype=torch.float32,
                     docs: torch.Tensor | None = None) -> dict:
    """Each impl and split against full causal attention: forward and q, k, v gradients;
    with ``docs`` (packed rows' document ids), against full attention under
    :func:`~edu3d.model.gpt.document_mask`."""
    g = torch.Generator().manual_seed(1)
    B, H, T, hd = 2, 4, 16, 8
    q, k, v, dout = (torch.randn(B, H, T, hd, generator=g) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True) if docs is None else \
        F.scaled_dot_product_attention(*full, attn_mask=document_mask(docs))
    ref.backward(dout)
    out = {}
    for split in SPLITS:
        mine = lambda t: split_tokens(t, cp, cp_rank, split, dim=2)  # noqa: E731
        pos = [int(p) for p in mine(torch.arange(T).view(1, 1, T, 1)).flatten()]
        for impl in IMPLS:
            local = [mine(t).to(dtype).requires_grad_() for t in (q, k, v)]
            y = cp_core(impl, group, pos)(*local, *(() if docs is None else (docs,)))
            work = last_work()["computed"] if impl == "ring" else None
            y.backward(mine(dout).to(dtype))
            errs = [_rel(y, mine(ref))] + [_rel(t.grad, mine(f.grad))
                                           for t, f in zip(local, full)]
            out[f"{impl}/{split}"] = {"errs": errs, "dtype": str(y.dtype), "work": work,
                                      "grad_dtype": str(local[0].grad.dtype)}
    return out


def gpt_check(group, cp_rank: int, cp: int, docs: torch.Tensor | None = None) -> dict:
    """apply_cp on a tiny GPT against the serial model: loss and summed gradients / cp.
    With ``docs``, both models take packed rows (the CP model the whole rows' ids)."""
    config = GPTConfig(n_layers=2, n_heads=4, d_model=32, seq_len=16, vocab_size=64)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 64, (2, 16), generator=g)
    y = torch.randint(0, 64, (2, 16), generator=g)
    extra = () if docs is None else (docs,)
    serial = GPT(config, seed=0)
    loss = serial(x, y, *extra)[1]
    loss.backward()
    out = {}
    for impl, split, recompute in [("ring", "zigzag", "none"), ("ring", "plain", "none"),
                                   ("allgather", "zigzag", "none"),
                                   ("ulysses", "zigzag", "none"),
                                   ("ring", "zigzag", "selective"),
                                   ("ulysses", "plain", "full")]:
        model = apply_cp(GPT(config, seed=0), group, cp_rank, cp, impl=impl, split=split)
        apply_recompute(model, recompute)
        xs, ys = split_batch(x, y, cp, cp_rank, split)
        local = model(xs, ys, *extra)[1]
        local.backward()
        total = local.detach().clone()
        comm.all_reduce(total, group)
        errs = [abs(float(total) / cp - float(loss)) / abs(float(loss))]
        names = []
        for (name, p), (sname, sp) in zip(model.named_parameters(), serial.named_parameters()):
            grad = p.grad.clone()
            comm.all_reduce(grad, group)
            errs.append(_rel(grad / cp, sp.grad))
            names.append(name == sname)
        out[f"{impl}/{split}/{recompute}"] = {"loss_err": errs[0], "grad_err": max(errs[1:]),
                                  "same_names": all(names)}
    return out


def tp_cp_check(mesh) -> dict:
    """TP (tp group, with and without SP) then CP (the dp group as the cp group) on the tiny
    GPT: loss and full gradients (shards glued, summed over cp, / cp) against serial."""
    config = GPTConfig(n_layers=2, n_heads=4, d_model=32, seq_len=16, vocab_size=64)
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, 64, (2, 16), generator=g) for _ in range(2))
    serial = GPT(config, seed=0)
    loss = serial(x, y)[1]
    loss.backward()
    ref = dict(serial.named_parameters())
    cp, cp_rank, out = mesh.size("dp"), mesh.index("dp"), {}
    for sp in (False, True):
        for impl in ("ring", "ulysses"):
            model = GPT(config, seed=0)
            specs = apply_tp(model, mesh.tp, sequence_parallel=sp)
            apply_cp(model, mesh.dp, cp_rank, cp, impl=impl)
            local = model(*split_batch(x, y, cp, cp_rank, "zigzag"))[1]
            local.backward()
            total = local.detach().clone()
            comm.all_reduce(total, mesh.dp)
            errs = [abs(float(total) / cp - float(loss)) / abs(float(loss))]
            partial = set(partial_grad_names(specs, sp))
            for name, p in model.named_parameters():
                grad = p.grad.clone()
                if name in partial:
                    comm.all_reduce(grad, mesh.tp)
                comm.all_reduce(grad, mesh.dp)
                if specs[name] is not None:
                    dim, parts, size = specs[name]
                    shards = [torch.empty_like(grad) for _ in range(mesh.size("tp"))]
                    dist.all_gather(shards, grad.contiguous(), group=mesh.tp)
                    grad = unshard(shards, dim, parts, size)
                errs.append(_rel(grad / cp, ref[name].grad))
            out[f"sp={sp}/{impl}"] = {"loss_err": errs[0], "grad_err": max(errs[1:])}
    return out


def all_checks(mesh) -> dict:
    groups = _groups()
    res = {"attn": {}, "bf16": {}, "packed": {}, "gpt": None}
    for cp, (group, cp_rank) in groups.items():
        res["attn"][cp] = attention_checks(group, cp_rank, cp)
        res["bf16"][cp] = attention_checks(group, cp_rank, cp, torch.bfloat16)
        res["packed"][cp] = attention_checks(group, cp_rank, cp, docs=DOCS)
    group, cp_rank = groups[2]
    res["gpt"] = gpt_check(group, cp_rank, 2)
    res["gpt_packed"] = gpt_check(group, cp_rank, 2, DOCS)
    res["tp_cp"] = tp_cp_check(mesh)
    try:  # 3 heads over cp=4: refused before any exchange, on every rank alike
        t = torch.zeros(1, 3, 4, 2)
        ulysses_attention(t, t, t, torch.arange(4), dist.group.WORLD)
        res["ulysses_refused"] = None
    except ValueError as e:
        res["ulysses_refused"] = str(e)
    return res
