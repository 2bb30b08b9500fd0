"""Live runs for chapter 04: what every rank of a tensor-parallel group sees, returned as data.

After reading this file you should know where the chapter's numbers come from. Each function
is a launch target (``launch(fn, n, layout=Layout(tp=n))``) that runs the real layers on
every rank and returns plain tensors and numbers; the charts only draw them:

* :func:`split_demo` — one column-parallel and one row-parallel product ``X·W``: each
  rank's input, weight shard, partial output and the result after the collective;
* :func:`operator_table` — the six conjugate operators fed rank-valued inputs (rank r sends
  r + 1) and the gradient each rank gets back;
* :func:`cross_entropy_demo` — the vocabulary-parallel loss against ``F.cross_entropy``;
* :func:`train_demo` — a few training steps of the TP (and TP+SP) model next to the serial
  loop on the same batches;
* :func:`memory_sweep` — activation memory of one layer for tp = 1, 2, 4 (sub-meshes of the
  launched ranks), SP off and on, next to the formula.

The chapter's panel predicts at once what :func:`tp_panel_run` then measures on tp ranks:
:func:`tp_split_prediction` (each rank's shards of one ``X·W``, cut in this process exactly
as :func:`split_demo` cuts them on the ranks), :func:`tp_collectives_prediction` (count and
ring bytes of one layer's collectives, SP off and on) and :func:`tp_activation_prediction`
(activation bytes of one layer, Korthikanti's count adapted to this model).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

from edu3d.course import lesson_args
from edu3d.distributed import trace
from edu3d.config.layout import Layout
from edu3d.distributed.mesh import Mesh
from edu3d.model.gpt import GPT, GPTConfig
from edu3d.parallel.tp import ops
from edu3d.parallel.tp.activations import block_collectives, block_input, measure_layer, tp_block
from edu3d.parallel.tp.apply import apply_tp
from edu3d.parallel.tp.layers import (ColumnParallelLinear, RowParallelLinear,
                                      vocab_parallel_cross_entropy)
from edu3d.plan.formulas import activation_bytes_per_layer, layer_activation_bytes
from edu3d.plan.links import wire_bytes
from edu3d.train.data import SyntheticCorpus
from edu3d.train.trainer import Trainer


def split_demo(mesh, rows: int = 4, d_in: int = 6, d_out: int = 8, seed: int = 0) -> dict:
    """Column and row split of one ``nn.Linear`` (no bias); every tensor this rank touched."""
    g = mesh.tp
    torch.manual_seed(seed)  # the same serial layer and input on every rank
    x = torch.randn(rows, d_in)
    lin = nn.Linear(d_in, d_out, bias=False)
    serial = (x @ lin.weight.t()).detach()
    out = {"x": x, "serial": serial}
    with torch.no_grad():
        col = ColumnParallelLinear.from_linear(lin, g)
        partial = col(x)
        out["column"] = {"x": x, "w": col.weight.t().clone(), "partial": partial,
                         "result": ops.all_gather(partial, g, -1)}
        row = RowParallelLinear.from_linear(lin, g)
        xs = ops.split(x, g, -1)
        partial = F.linear(xs, row.weight)
        out["row"] = {"x": xs, "w": row.weight.t().clone(), "partial": partial,
                      "result": ops.all_reduce(partial, g)}
    return out


def operator_table(mesh) -> list[tuple[str, str, str]]:
    """(operator, forward output, input gradient) on this rank. Every input element is
    ``r + 1`` and so is every element of the incoming gradient, so the numbers say which
    collective ran in which direction (1-D tensors, split along dim 0)."""
    g, r, t = mesh.tp, mesh.index("tp"), mesh.size("tp")
    table = (("identity/all-reduce (f)", ops.identity_all_reduce, 1),
             ("all-reduce/identity (g)", ops.all_reduce_identity, 1),
             ("all-gather/split", ops.all_gather_split, 1),
             ("split/all-gather", ops.split_all_gather, t),
             ("reduce-scatter/all-gather", ops.reduce_scatter_all_gather, t),
             ("all-gather/reduce-scatter", ops.all_gather_reduce_scatter, 1))
    rows = []
    for name, fn, size in table:
        x = torch.full((size,), float(r + 1), requires_grad=True)
        y = fn(x, g, 0)
        y.backward(torch.full_like(y, float(r + 1)))
        rows.append((name, _fmt(y), _fmt(x.grad)))
    return rows


def _fmt(t: torch.Tensor) -> str:
    return "[" + " ".join(f"{v:g}" for v in t.flatten().tolist()) + "]"


def cross_entropy_demo(mesh, vocab: int = 11, tokens: int = 6, seed: int = 0) -> dict:
    """Vocabulary-parallel CE on a padded vocabulary (with an ignored target) vs torch."""
    g, r, t = mesh.tp, mesh.index("tp"), mesh.size("tp")
    torch.manual_seed(seed)
    logits = torch.randn(tokens, vocab) * 2
    target = torch.randint(0, vocab, (tokens,))
    target[1] = -100
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full, target, ignore_index=-100)
    want.backward()
    per_rank = -(-vocab // t)
    padded = F.pad(logits, (0, per_rank * t - vocab))
    local = padded.chunk(t, -1)[r].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(local, target, g, vocab_size=vocab)
    got.backward()
    want_grad = F.pad(full.grad, (0, per_rank * t - vocab)).chunk(t, -1)[r]
    return {"loss": got.item(), "torch_loss": want.item(), "columns": (r * per_rank,
            min((r + 1) * per_rank, vocab)), "padding": per_rank * t - vocab,
            "loss_err": abs(got.item() - want.item()) / want.item(),
            "grad_err": (local.grad - want_grad).abs().max().item()}


def train_demo(mesh, config: GPTConfig, steps: int = 8, batch: int = 4) -> dict:
    """Serial, TP and TP+SP training on the same batches: per-step loss and grad norm, and
    each run's time window in the trace (``"windows"``)."""
    args = lesson_args(global_batch=batch, lr=3e-3)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
    out, rec = {"windows": {}}, trace.current()
    for name, sp in (("serial", None), ("tp", False), ("tp+sp", True)):
        args = args.replace(sp=bool(sp), tp_overlap=False)
        trainer = Trainer(GPT(config, 0), None if sp is None else mesh, args)
        t0 = rec.now()
        out[name] = [trainer.step(*corpus.batch(s, batch), s) for s in range(1, steps + 1)]
        out["windows"][name] = (t0, rec.now())  # which trace events belong to this run
    return out


def collectives(mesh, config: GPTConfig, batch: int = 2) -> dict:
    """The collectives of one layer, SP off and on, counted from the trace."""
    return {sp: block_collectives(mesh, config, batch, sp) for sp in (False, True)}


def memory_sweep(mesh, config: GPTConfig, batch: int = 2) -> list[dict]:
    """Activation bytes of one layer on rank 0 of tp = 1, 2, ... up to the launched ranks."""
    n, rows, t = mesh.layout.world_size, [], 1
    while t <= n:
        m = mesh if t == mesh.size("tp") else Mesh.build(Layout(dp=n // t, tp=t))
        for sp in (False, True):
            rows.append({**measure_layer(m, config, batch, sp),
                         **tp_activation_prediction(config, batch, t, sp)})
        t *= 2
    return rows


def chapter_run(mesh, train_config: GPTConfig, layer_config: GPTConfig, steps: int = 8) -> dict:
    """Everything chapter 04 shows at one tp size, in one launch."""
    model = GPT(layer_config, 0)
    apply_tp(model, mesh)
    block = model.blocks[0]
    return {"split": split_demo(mesh), "operators": operator_table(mesh),
            "cross_entropy": cross_entropy_demo(mesh), "block": repr(block),
            "collectives": collectives(mesh, layer_config),
            "train": train_demo(mesh, train_config, steps)}


# ---- the chapter's panel: predictions at once, one launch to measure them ------------------------
#: the split the panel draws: 4 tokens, 8 -> 8 features (8 divides by every tp it offers)
SPLIT = {"rows": 4, "d_in": 8, "d_out": 8, "seed": 0}


def tp_layer_config():
    """Chapter 04's one-layer model: 8 heads, d = 128, s = 64 (b = 2 in every measurement)."""
    return GPTConfig(n_layers=1, n_heads=8, d_model=128, seq_len=64, vocab_size=64)


def tp_split_prediction(t: int, rows: int = 4, d_in: int = 8, d_out: int = 8,
                        seed: int = 0) -> list[dict]:
    """Each of ``t`` ranks' tensors for the column and the row split of one ``nn.Linear``,
    cut here with ``chunk`` from the same seeded layer and input
    :func:`edu3d.course.ch04_tensor_parallel.split_demo` builds on every rank: what the ranks will hold."""
    torch.manual_seed(seed)
    x = torch.randn(rows, d_in)
    lin = nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        w = lin.weight.detach().t()  # [d_in, d_out]
        serial = x @ w
        col_w, row_w, xs = w.chunk(t, 1), w.chunk(t, 0), x.chunk(t, -1)
        col_parts = [x @ cw for cw in col_w]
        row_parts = [xi @ rw for xi, rw in zip(xs, row_w)]
        col_result, row_result = torch.cat(col_parts, -1), sum(row_parts)
    return [{"x": x, "serial": serial,
             "column": {"x": x, "w": col_w[r].clone(), "partial": col_parts[r],
                        "result": col_result},
             "row": {"x": xs[r].clone(), "w": row_w[r].clone(), "partial": row_parts[r],
                     "result": row_result}} for r in range(t)]


def split_difference(measured: list[dict], predicted: list[dict], kind: str) -> float:
    """Largest |difference| between the ranks' tensors and the prediction."""
    return max(float((m[kind][k] - p[kind][k]).abs().max())
               for m, p in zip(measured, predicted) for k in ("x", "w", "partial", "result"))


#: one layer's collectives, from the operators in edu3d.parallel.tp (f, g and the SP pairs)
TP_COLLECTIVES = {False: {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}},
                  True: {"forward": {"all_gather": 2, "reduce_scatter": 2},
                         "backward": {"all_gather": 4, "reduce_scatter": 2}}}

#: the collectives whose ring bytes per rank the performance model counts
#: (:func:`edu3d.plan.links.wire_bytes`: ``2(t-1)/t`` of the buffer, ``(t-1)/t`` for the others)
RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")


def tp_collectives_prediction(config, batch: int, t: int, sp: bool) -> dict:
    """``{phase: {op: {"count", "bytes", "ring_bytes"}}}`` for one layer on ``t`` ranks:
    ``bytes`` is the full buffer S = b·s·h·4 of each collective summed (what the trace
    records), ``ring_bytes`` what one rank sends on a ring (all-reduce 2(t-1)/t·S,
    all-gather and reduce-scatter (t-1)/t·S)."""
    s_bytes = batch * config.seq_len * config.d_model * 4
    out = {}
    for phase, counts in TP_COLLECTIVES[sp].items():
        out[phase] = {op: {"count": n, "bytes": n * s_bytes,
                           "ring_bytes": n * wire_bytes(op, s_bytes, t)}
                      for op, n in counts.items()}
    return out


def tp_activation_prediction(config, batch: int, t: int, sp: bool) -> dict:
    """Activation bytes one layer keeps per rank: this model's count (fp32, no dropout,
    fused attention) and Korthikanti et al.'s 16-bit count for the paper's layer."""
    s, h, a = config.seq_len, config.d_model, config.n_heads
    return {"model_formula": layer_activation_bytes(s, batch, h, a, t, sp),
            "korthikanti_16bit": activation_bytes_per_layer(s, batch, h, a, t, sp)}


def tp_panel_run(mesh, config, batch: int = 2, sp: bool = False) -> dict:
    """Launch target (``Layout(tp=t)``): the split demo, one layer's collectives counted and
    summed from the trace (forward and backward, SP as asked), and the activation bytes the
    layer saved, measured with ``saved_tensors_hooks``."""
    block = tp_block(config, mesh, sp, 0)
    x = block_input(config, batch, mesh, sp, 0)
    phases = {}
    with trace.use(trace.Recorder(mesh.rank)) as rec:
        y = block(x)
        phases["forward"] = [e for e in rec.events if e["lane"] == "comm"]
        rec.events.clear()
        y.backward(torch.ones_like(y))
        phases["backward"] = [e for e in rec.events if e["lane"] == "comm"]
    t = mesh.size("tp")
    collectives = {}
    for phase, evs in phases.items():
        counts = Counter(e["op"] for e in evs)
        collectives[phase] = {
            op: {"count": n, "bytes": sum(e["bytes"] for e in evs if e["op"] == op),
                 "ring_bytes": sum(wire_bytes(op, e["bytes"], t) if op in RING_OPS else 0
                                   for e in evs if e["op"] == op)}
            for op, n in sorted(counts.items())}
    return {"split": split_demo(mesh, **SPLIT), "collectives": collectives,
            "memory": {**measure_layer(mesh, config, batch, sp),
                       **tp_activation_prediction(config, batch, t, sp)}}
