"""Chapter 13 (context parallelism): the runs its notebook launches and the formulas beside them.

After reading this file you should know where each of the chapter's numbers comes from:

* :func:`owner_map`, :func:`ring_block_work`: which rank computes each causal score entry
  under the plain and zigzag splits, and the score entries the ring's block rule computes
  per rank (whole quarter-blocks, a hidden one skipped), next to
  :func:`edu3d.parallel.cp.work` (the causal entries alone);
* :func:`attention_lesson` is a launch target on 4 ranks (cp = 4 on all of them, cp = 2 on
  the pairs [0, 1] and [2, 3]): the ring's work counter for both splits, a traced forward
  and backward of ring attention (the ring's steps) and of each implementation (bytes and
  step time), each checked against full causal attention;
* the ring's steps (the trace's sends, the work of each step, when a step hides its transfer)
  are in :mod:`edu3d.course.ch13_context_parallelism_ring`; the lesson run also probes the
  overlap condition there (``overlap``);
* :func:`impl_bytes` sums what each implementation sent, :func:`impl_formulas` predicts it
  (DESIGN.md "Formulas"):
  ring ``(cp-1)`` sends of K and V, ``2·b·(s/cp)·h`` values each, forward (and in backward
  again, with dK, dV ``cp`` times); all-gather the same K, V once (``(cp-1)/cp`` of
  ``2·b·s·h``), its backward a reduce-scatter of as much; Ulysses four all-to-alls of
  ``b·s·h/cp`` values (``(cp-1)/cp`` of each leaves the rank), forward and backward; its
  degree divides the heads and, under grouped-query attention, the K/V heads too unless K
  and V are replicated (:func:`ulysses_degrees`);
* :func:`merge_demo`: the log-sum-exp merge on one query's real numbers;
* :func:`activation_sweep` (a launch target) measures what one layer of the GPT saves for
  backward under CP, against :func:`edu3d.plan.formulas.layer_activation_bytes` at
  ``s/cp``; :func:`playbook_scale` puts the same law at Llama 3 8B's size and 128k tokens;
* the capstone, a four-axis layout with experts, lives in
  :mod:`edu3d.course.ch13_context_parallelism_capstone`; the panels' runs are :func:`work_run` and
  :func:`exchange_run`.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from edu3d.distributed import trace
from edu3d.distributed.meter import measure_activations
from edu3d.distributed.trace import wire_bytes
from edu3d.model.gpt import GPT, GPTConfig
from edu3d.parallel.cp import (IMPLS, apply_cp, block_attention, cp_core, last_work, merge,
                               positions, split_tokens)
from edu3d.course.ch13_context_parallelism_ring import overlap_probe
from edu3d.plan.formulas import activation_bytes_per_layer, layer_activation_bytes

SPLITS = ("zigzag", "plain")
LESSON = {"batch": 1, "heads": 4, "seq_len": 32, "head_dim": 8}  # the attention tensors
VALUE_BYTES = 4  # fp32
LLAMA3_8B = {"layers": 32, "h": 4096, "heads": 32, "kv_heads": 8, "d_ff": 14336,
             "seq_len": 131072}  # the Ultra-Scale Playbook's long-context example


# ---------------------------------------------------------------- section 1: who computes what

def owner_map(seq_len: int, cp: int, split: str = "zigzag") -> list[list[int]]:
    """``[query][key]`` -> the rank whose queries own that score entry, -1 where the causal
    mask hides it (key after query)."""
    owner = {p: r for r in range(cp) for p in positions(seq_len, cp, r, split)}
    return [[owner[q] if k <= q else -1 for k in range(seq_len)] for q in range(seq_len)]


def _halves(pos: list[int]) -> list[tuple[int, int, int]]:
    """(size, first, last) of each half of a rank's tokens: the ring's unit of work."""
    n = len(pos)
    parts = [pos[: n // 2], pos[n // 2:]] if n > 1 and n % 2 == 0 else [pos]
    return [(len(p), min(p), max(p)) for p in parts]


def ring_block_work(seq_len: int, cp: int, split: str = "zigzag") -> list[int]:
    """Per rank, the score entries ring attention computes: each half of its queries against
    each half of every rank's keys, skipped only when every key comes after every query.
    A visible block is computed whole (its hidden corner masked, not skipped), so this is a
    little more than :func:`~edu3d.parallel.cp.work`'s causal count."""
    out = []
    for r in range(cp):
        mine = _halves(positions(seq_len, cp, r, split))
        total = 0
        for src in range(cp):
            for qn, _, q_last in mine:
                for kn, k_first, _ in _halves(positions(seq_len, cp, src, split)):
                    total += 0 if k_first > q_last else qn * kn
        out.append(total)
    return out


def imbalance(per_rank: list[int]) -> float:
    """The slowest rank's work over the mean (1.0: perfectly balanced)."""
    return max(per_rank) / (sum(per_rank) / len(per_rank))


# ---------------------------------------------------------------- the 4-rank lesson run

def lesson_tensors(seed: int = 1, **shape) -> tuple[torch.Tensor, ...]:
    """Deterministic ``q, k, v, dout [B, H, T, hd]`` (the same on every rank)."""
    s = {**LESSON, **shape}
    g = torch.Generator().manual_seed(seed)
    dims = (s["batch"], s["heads"], s["seq_len"], s["head_dim"])
    return tuple(torch.randn(*dims, generator=g) for _ in range(4))


def _groups(mesh) -> dict[int, tuple]:
    """cp -> (process group named "cp", this rank's index in it), built collectively."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {n: (dist.new_group(list(range(n)), group_desc="cp"), rank)}
    if n >= 4:
        pairs = [dist.new_group([i, i + 1], group_desc="cp") for i in range(0, n, 2)]
        out[2] = (pairs[rank // 2], rank % 2)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm().clamp_min(1e-12))


def _fwd_bwd(impl: str, group, cp_rank: int, cp: int, split: str, tensors, ref):
    """One forward and backward of ``impl`` on this rank's tokens; worst relative error of
    the output and the q, k, v gradients against full attention, and the ring's counter."""
    q, k, v, dout = tensors
    mine = lambda t: split_tokens(t, cp, cp_rank, split, dim=2)  # noqa: E731
    local = [mine(t).requires_grad_() for t in (q, k, v)]
    rec = trace.current()
    with rec.context(phase="forward"):
        y = cp_core(impl, group, positions(q.shape[2], cp, cp_rank, split))(*local)
    counted = last_work()["computed"] if impl == "ring" else None
    with rec.context(phase="backward"):
        y.backward(mine(dout))
    errs = [_rel(y, mine(ref[0]))] + [_rel(t.grad, mine(g)) for t, g in zip(local, ref[1:])]
    return max(errs), counted


def attention_lesson(mesh, repeats: int = 5, **shape) -> dict:
    """Everything sections 1, 2 and 4 measure, in one launch of 4 ranks (``Layout(dp=4)``;
    the ``cp`` groups are built here). Returns this rank's:

    * ``work[(cp, split)]``: the ring's counter (score entries computed) for cp = 2 and 4;
    * ``errors``: worst relative error against full attention, per impl and split;
    * ``step_ms[impl]``: median forward + backward time at cp = 4 (zigzag);
    * ``overlap``: one ring step's attention against moving one K, V block, per sequence
      length, at cp = 4 (:func:`~edu3d.course.ch13_context_parallelism_ring.overlap_probe`);
    * the trace holds step 1 (the ring, cp = 4, zigzag) and steps 2, 3, 4 (ring, allgather,
      ulysses, one each, ``case`` = impl) for :func:`ring_steps` and :func:`impl_bytes`.
    """
    tensors = lesson_tensors(**shape)
    q, k, v, dout = tensors
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, is_causal=True)
    out.backward(dout)
    ref = (out, full[0].grad, full[1].grad, full[2].grad)
    groups = _groups(mesh)
    rec, quiet = trace.current(), trace.NullRecorder()
    res = {"rank": dist.get_rank(), "work": {}, "errors": {}, "step_ms": {}}
    with trace.use(quiet):
        for cp, (group, cp_rank) in sorted(groups.items()):
            for split in SPLITS:
                for impl in IMPLS:
                    err, counted = _fwd_bwd(impl, group, cp_rank, cp, split, tensors, ref)
                    res["errors"][f"{impl}/{split}/cp{cp}"] = err
                    if counted is not None:
                        res["work"][(cp, split)] = counted
    cp = max(groups)
    group, cp_rank = groups[cp]
    for step, impl in enumerate(IMPLS, start=2):
        times = []
        for i in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            with trace.use(rec if i == 0 else quiet), rec.context(step=step, case=impl):
                _fwd_bwd(impl, group, cp_rank, cp, "zigzag", tensors, ref)
            times.append(time.perf_counter() - t0)
        res["step_ms"][impl] = 1e3 * statistics.median(times[1:])
    dist.barrier()
    with rec.context(step=1, case="ring steps"):
        _fwd_bwd("ring", group, cp_rank, cp, "zigzag", tensors, ref)
    with trace.use(quiet):
        res["overlap"] = overlap_probe(group, repeats=repeats)
    res["cp"] = cp
    return res


# ---------------------------------------------------------------- section 3: the merge

def merge_demo(seq_len: int = 8, cut: int = 4, head_dim: int = 4, seed: int = 0) -> dict:
    """The last query of a causal sequence against keys ``[0, cut)`` and ``[cut, seq_len)``
    separately, merged, and against all keys at once; plus the wrong merge (the average)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, n, head_dim, generator=g) for n in (1, seq_len, seq_len))
    qpos, kpos = torch.tensor([seq_len - 1]), torch.arange(seq_len)
    scale = head_dim ** -0.5
    a = block_attention(q, k[..., :cut, :], v[..., :cut, :], qpos, kpos[:cut], scale)
    b = block_attention(q, k[..., cut:, :], v[..., cut:, :], qpos, kpos[cut:], scale)
    merged, lse = merge(*a, *b)
    full, full_lse = block_attention(q, k, v, qpos, kpos, scale)
    flat = lambda t: [round(float(x), 4) for x in t.flatten()]  # noqa: E731
    return {"cut": cut, "seq_len": seq_len,
            "out_a": flat(a[0]), "lse_a": float(a[1]), "out_b": flat(b[0]), "lse_b": float(b[1]),
            "weight_a": math.exp(float(a[1]) - float(lse)),
            "weight_b": math.exp(float(b[1]) - float(lse)),
            "merged": flat(merged), "lse": float(lse), "full": flat(full),
            "full_lse": float(full_lse), "average": flat((a[0] + b[0]) / 2),
            "error": _rel(merged, full), "average_error": _rel((a[0] + b[0]) / 2, full)}


# ---------------------------------------------------------------- section 4: the three exchanges

def cp_wire_bytes(ev: dict) -> float:
    """Bytes a comm event sends off this rank: :func:`~edu3d.distributed.trace.wire_bytes`,
    and for an all-to-all the ``(n-1)/n`` of its buffer that goes to the other ranks."""
    if ev.get("op") == "all_to_all":
        n = ev.get("n", 1)
        return (n - 1) / n * ev.get("bytes", 0)
    return wire_bytes(ev)


def impl_bytes(events: list[dict], rank: int = 0) -> dict[str, dict[str, float]]:
    """Per implementation (steps 2-4 of :func:`attention_lesson`'s trace), the bytes
    ``rank`` sent over the cp group, forward and backward."""
    out = {impl: {"forward": 0.0, "backward": 0.0} for impl in IMPLS}
    for ev in events:
        if (ev.get("rank") == rank and ev.get("lane") == "comm" and ev.get("group") == "cp"
                and ev.get("case") in out and ev.get("step") in (2, 3, 4)):
            out[ev["case"]][ev.get("phase", "forward")] += cp_wire_bytes(ev)
    return out


def impl_formulas(seq_len: int, cp: int, hidden: int, batch: int = 1,
                  value_bytes: int = VALUE_BYTES) -> dict[str, dict[str, float]]:
    """Bytes one rank sends per attention layer, forward and backward (the formulas of
    DESIGN.md, with this code's extras: the ring also passes each block's positions, 8 bytes
    a token, re-sends K, V in backward and sends its dK, dV ``cp`` times, the last bringing
    them home; all-gather and Ulysses gather the positions once)."""
    kv = 2 * batch * seq_len // cp * hidden * value_bytes  # one rank's K and V
    pos = seq_len // cp * 8
    ring_f = (cp - 1) * (kv + pos)
    a2a = (cp - 1) / cp * 4 * batch * seq_len * hidden / cp * value_bytes
    gathered = (cp - 1) * pos  # all-gather and Ulysses gather every rank's positions once
    return {"ring": {"forward": ring_f, "backward": ring_f + (cp * kv if cp > 1 else 0)},
            "allgather": {"forward": (cp - 1) * kv + gathered, "backward": (cp - 1) * kv},
            "ulysses": {"forward": a2a + gathered, "backward": a2a}}


def ulysses_degrees(heads: int, kv_heads: int | None = None) -> list[int]:
    """The cp degrees Ulysses can use with ``heads`` query heads per TP rank: it hands each
    rank whole heads, so the degree divides them; under grouped-query attention each rank
    also needs whole K/V heads, so it divides ``kv_heads`` too unless K and V are replicated
    (sent cp/kv_heads times over)."""
    return [d for d in range(1, heads + 1)
            if heads % d == 0 and (kv_heads is None or kv_heads % d == 0)]


# ---------------------------------------------------------------- section 5: activation memory

def _layer_bytes(config: GPTConfig, group, cp_rank: int, cp: int, impl: str, batch: int) -> int:
    model = GPT(config, seed=0)
    if cp > 1:
        apply_cp(model, group, cp_rank, cp, impl=impl)
    block = model.blocks[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, config.seq_len, config.d_model, generator=g)
    x = split_tokens(x, cp, cp_rank) if cp > 1 else x
    x = x.contiguous().requires_grad_()
    return measure_activations(lambda: block(x), exclude=block.parameters())


def activation_sweep(mesh, seq_lens=(32, 64, 128), batch: int = 1, d_model: int = 32,
                     heads: int = 4, impls=("ring",)) -> list[dict]:
    """Bytes one layer saves for backward on this rank, for each sequence length, cp in
    1, 2, 4 (the launched ranks) and each impl, with the formula at ``s/cp``."""
    groups = _groups(mesh)
    rows = []
    for s in seq_lens:
        config = GPTConfig(n_layers=1, n_heads=heads, d_model=d_model, seq_len=s,
                           vocab_size=64)
        rows.append({"seq_len": s, "cp": 1, "impl": "serial",
                     "measured": _layer_bytes(config, None, 0, 1, "ring", batch),
                     "formula": layer_activation_bytes(s, batch, d_model, heads)})
        for cp, (group, cp_rank) in sorted(groups.items()):
            for impl in impls:
                rows.append({"seq_len": s, "cp": cp, "impl": impl,
                             "measured": _layer_bytes(config, group, cp_rank, cp, impl, batch),
                             "formula": layer_activation_bytes(s // cp, batch, d_model,
                                                               heads)})
    return rows


def ring_extra_bytes(row: dict, batch: int = 1, d_model: int = 32) -> int:
    """What ring attention saves beyond the formula for a sweep row: its fp32 output in the
    ``[b, heads, s/cp, hd]`` layout (the projection saves its own copy in ``[b, s/cp, h]``)
    and the positions of its tokens, 8 bytes each. 0 for the serial layer."""
    if row["cp"] == 1:
        return 0
    t = row["seq_len"] // row["cp"]
    return batch * t * d_model * VALUE_BYTES + 8 * t


def playbook_scale(cps=(1, 2, 4, 8, 16), tp: int = 1, model: dict | None = None) -> list[dict]:
    """Activation GB per GPU for a whole model at long context, per cp degree: Korthikanti's
    16-bit count per layer (:func:`edu3d.plan.formulas.activation_bytes_per_layer`, b = 1,
    SwiGLU MLP, grouped K/V, selective recomputation: the fused attention of every long
    context run keeps no ``s x s`` scores) at ``s/cp`` tokens, times the layers. Default:
    Llama 3 8B at 128k tokens, the Ultra-Scale Playbook's example."""
    m = {**LLAMA3_8B, **(model or {})}
    rows = []
    for cp in cps:
        per_layer = activation_bytes_per_layer(
            m["seq_len"] // cp, 1, m["h"], m["heads"], t=tp, sp=tp > 1,
            recompute="selective", d_ff=m["d_ff"], kv_heads=m["kv_heads"], mlp="swiglu")
        rows.append({"cp": cp, "tp": tp, "per_layer_gb": per_layer / 1e9,
                     "total_gb": per_layer * m["layers"] / 1e9})
    return rows


# ---------------------------------------------------------------- the panels' runs

def work_run(mesh, seq_len: int = 32, split: str = "zigzag") -> int:
    """The ring's counter on this rank for cp = the launched world (a panel's run)."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, _ = lesson_tensors(seq_len=seq_len)
    mine = [split_tokens(t, cp, rank, split, dim=2) for t in (q, k, v)]
    cp_core("ring", dist.group.WORLD, positions(seq_len, cp, rank, split))(*mine)
    return last_work()["computed"]


def exchange_run(mesh, seq_len: int = 32, heads: int = 4, impls=IMPLS) -> dict:
    """One traced forward and backward of each impl over the launched world (steps 2, 3, 4
    of the trace, for :func:`impl_bytes`), and its median time over 3 more."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)), group_desc="cp")  # named "cp" in the trace
    tensors = lesson_tensors(seq_len=seq_len, heads=heads)
    mine = lambda t: split_tokens(t, cp, rank, "zigzag", dim=2)  # noqa: E731
    rec, out = trace.current(), {}
    for step, impl in enumerate(IMPLS, start=2):
        if impl not in impls:
            continue
        times = []
        for i in range(4):
            local = [mine(t).requires_grad_() for t in tensors[:3]]
            dist.barrier()
            t0 = time.perf_counter()
            with trace.use(rec if i == 0 else trace.NullRecorder()):
                with trace.current().context(step=step, case=impl, phase="forward"):
                    y = cp_core(impl, group, positions(seq_len, cp, rank))(*local)
                with trace.current().context(step=step, case=impl, phase="backward"):
                    y.backward(mine(tensors[3]))
            times.append(time.perf_counter() - t0)
        out[impl] = 1e3 * statistics.median(times[1:])
    return out
