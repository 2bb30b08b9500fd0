"""Tensor parallelism's pieces, each against the answer worked out by hand or the serial layer.

One 4-rank launch checks everything at tp=4 and again at tp=2 (a dp=2 x tp=2 mesh built in
the same processes): the six conjugate operators with rank-valued inputs (rank r sends r+1,
so every forward and backward result is a number you can compute on paper), the column, row
and vocabulary-parallel layers and the vocabulary-parallel cross entropy against their serial
counterparts, the per-layer collective counts, and the activation memory against the formula.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from edu3d.launch import launch
from edu3d.config.layout import Layout, LayoutError
from edu3d.distributed.mesh import Mesh
from edu3d.model.gpt import GPT, GPTConfig, config_from
from edu3d.parallel.tp import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                               check_layout, ops, shard, unshard, vocab_parallel_cross_entropy)
from edu3d.parallel.tp.activations import block_collectives, measure_layer, saved_activation_bytes
from edu3d.plan.formulas import activation_bytes_per_layer as korthikanti_bytes
from edu3d.plan.formulas import layer_activation_bytes as model_activation_bytes

LAYER_CONFIG = GPTConfig(n_layers=1, n_heads=4, d_model=32, seq_len=8, vocab_size=50)


def _err(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def check_operators(group) -> dict[str, float]:
    """Max abs error of each operator's forward and backward against the hand-computed value."""
    t, r = ops.group_size(group), ops.group_rank(group)
    S = t * (t + 1) / 2  # sum over ranks of (rank + 1)
    mine = float(r + 1)
    blocks = torch.arange(1, t + 1, dtype=torch.float32)  # block j holds j + 1
    errs = {}

    x = torch.full((3,), mine, requires_grad=True)
    y = ops.identity_all_reduce(x, group)
    y.backward(torch.full((3,), mine))
    errs["identity/all-reduce"] = max(_err(y, x), _err(x.grad, torch.full((3,), S)))

    x = torch.full((3,), mine, requires_grad=True)
    y = ops.all_reduce_identity(x, group)
    y.backward(torch.full((3,), mine))
    errs["all-reduce/identity"] = max(_err(y, torch.full((3,), S)),
                                      _err(x.grad, torch.full((3,), mine)))

    x = torch.full((2, 3), mine, requires_grad=True)  # gather along the last dim
    y = ops.all_gather_split(x, group, -1)
    y.backward(torch.arange(3 * t, dtype=torch.float32).expand(2, -1))
    errs["all-gather/split"] = max(_err(y, blocks.repeat_interleave(3).expand(2, -1)),
                                   _err(x.grad, torch.arange(3 * r, 3 * r + 3.0).expand(2, -1)))

    x = torch.arange(2 * t, dtype=torch.float32).view(1, 2 * t, 1).expand(1, -1, 3)
    x = x.clone().requires_grad_()  # split along the sequence
    y = ops.split_all_gather(x, group, 1)
    y.backward(torch.full_like(y, mine))
    per_block = blocks.repeat_interleave(2).view(1, -1, 1).expand(1, -1, 3)
    errs["split/all-gather"] = max(_err(y, x[:, 2 * r:2 * r + 2]), _err(x.grad, per_block))

    pos = torch.arange(1, 2 * t + 1, dtype=torch.float32).view(1, -1, 1)
    x = (mine * pos).expand(1, -1, 3).clone().requires_grad_()
    y = ops.reduce_scatter_all_gather(x, group, 1)
    y.backward(torch.full_like(y, mine))
    errs["reduce-scatter/all-gather"] = max(
        _err(y, S * pos[:, 2 * r:2 * r + 2].expand(1, -1, 3)),
        _err(x.grad, blocks.repeat_interleave(2).view(1, -1, 1).expand(1, -1, 3)))

    x = torch.full((1, 2, 3), mine, requires_grad=True)
    y = ops.all_gather_reduce_scatter(x, group, 1)
    y.backward(torch.full_like(y, mine))
    errs["all-gather/reduce-scatter"] = max(
        _err(y, blocks.repeat_interleave(2).view(1, -1, 1).expand(1, -1, 3)),
        _err(x.grad, torch.full((1, 2, 3), S)))
    return errs


def check_layers(group) -> dict[str, float]:
    """Max abs error of each parallel layer's output and gradients against the serial layer."""
    t, r = ops.group_size(group), ops.group_rank(group)
    torch.manual_seed(0)  # the same serial layers and inputs on every rank
    B, T, d, out = 2, 4 * t, 8, 12
    errs = {}
    for sp in (False, True):
        for overlap in (False, True):
            lin = nn.Linear(d, out)
            x = torch.randn(B, T, d, requires_grad=True)
            gy = torch.randn(B, T, out)
            (lin(x) * gy).sum().backward()
            col = ColumnParallelLinear.from_linear(lin, group, gather_output=not sp,
                                                   sequence_parallel=sp, overlap=overlap)
            xs = (x.detach().chunk(t, 1)[r] if sp else x.detach()).clone().requires_grad_()
            y = col(ops.all_gather_reduce_scatter(xs, group, 1) if sp else xs)
            g_local = gy if not sp else gy.chunk(t, -1)[r]
            want = lin(x).detach() if not sp else lin(x).detach().chunk(t, -1)[r]
            (y * g_local).sum().backward()
            want_gx = x.grad if not sp else x.grad.chunk(t, 1)[r]
            errs[f"column sp={sp} overlap={overlap}"] = max(
                _err(y, want), _err(xs.grad, want_gx),
                _err(col.weight.grad, shard(lin.weight.grad, 0, r, t)),
                _err(col.bias.grad, shard(lin.bias.grad, 0, r, t)))

        lin = nn.Linear(out, d)
        x = torch.randn(B, T, out, requires_grad=True)
        gy = torch.randn(B, T, d)
        (lin(x) * gy).sum().backward()
        row = RowParallelLinear.from_linear(lin, group, sequence_parallel=sp)
        xs = x.detach().chunk(t, -1)[r].clone().requires_grad_()
        y = row(xs)
        g_local = gy.chunk(t, 1)[r] if sp else gy
        (y * g_local).sum().backward()
        want = lin(x).detach()
        want_bias = gy.chunk(t, 1)[r].sum((0, 1)) if sp else lin.bias.grad  # partial under SP
        errs[f"row sp={sp}"] = max(_err(y, want.chunk(t, 1)[r] if sp else want),
                                   _err(xs.grad, x.grad.chunk(t, -1)[r]),
                                   _err(row.weight.grad, shard(lin.weight.grad, 1, r, t)),
                                   _err(row.bias.grad, want_bias))

        vocab = 4 * t + 1  # never a multiple of t: the last rank holds padding rows
        emb = nn.Embedding(vocab, d)
        idx = torch.randint(0, vocab, (B, T))
        gy = torch.randn(B, T, d)
        (emb(idx) * gy).sum().backward()
        vpe = VocabParallelEmbedding.from_embedding(emb, group, sequence_parallel=sp)
        y = vpe(idx)
        (y * (gy.chunk(t, 1)[r] if sp else gy)).sum().backward()
        want = emb(idx).detach()
        full_grad = shard(emb.weight.grad, 0, r, t, pad_to=vpe.weight.shape[0] * t)
        errs[f"vocab embedding sp={sp}"] = max(_err(y, want.chunk(t, 1)[r] if sp else want),
                                               _err(vpe.weight.grad, full_grad))
    return errs


def check_cross_entropy(group) -> dict[str, float]:
    """Vocabulary-parallel CE against F.cross_entropy: loss and logits gradient."""
    t, r = ops.group_size(group), ops.group_rank(group)
    torch.manual_seed(1)
    errs = {}
    for vocab in (8 * t, 8 * t - 1, 8 * t - 3):  # exact, and padded by 1 and 3
        vpad = -(-vocab // t) * t
        logits = torch.randn(2, 5, vocab) * 3
        target = torch.randint(0, vocab, (2, 5))
        target[0, 1] = target[1, 4] = -100
        target[1, 0] = vocab - 1  # the last real token: on the rank holding padding
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full.flatten(0, 1), target.flatten(), ignore_index=-100)
        want.backward()
        padded = torch.cat([logits, torch.full((2, 5, vpad - vocab), 7.0)], -1)  # junk padding
        local = padded.chunk(t, -1)[r].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(local, target, group, vocab_size=vocab)
        got.backward()
        want_grad = torch.cat([full.grad, torch.zeros(2, 5, vpad - vocab)], -1).chunk(t, -1)[r]
        errs[f"cross entropy vocab={vocab}"] = max(abs(got.item() - want.item()) / want.item(),
                                                   _err(local.grad, want_grad))
    return errs


def parallelize_from_layout(mesh) -> float:
    """``apply_tp`` given a Layout (it builds the mesh) vs given the launch's mesh."""
    from edu3d.parallel.tp import apply_tp

    cfg = GPTConfig(n_layers=1, n_heads=4, d_model=16, seq_len=8, vocab_size=30)
    idx = torch.arange(16).view(2, 8) % 30
    a_model, b_model = GPT(cfg), GPT(cfg)
    apply_tp(a_model, mesh)
    apply_tp(b_model, mesh.layout)
    a, b = a_model(idx, idx)[1], b_model(idx, idx)[1]
    c = GPT(cfg)(idx, idx)[1]
    return max(abs(a.item() - c.item()), abs(b.item() - c.item())) / c.item()


def tp_worker(mesh) -> dict:
    """Everything at the launch's tp, then at tp=2 on a dp=2 x tp=2 mesh of the same ranks."""
    out = {"layout_err": parallelize_from_layout(mesh)}
    for m in (mesh, Mesh.build(Layout(dp=2, tp=2))):
        t = m.size("tp")
        out[t] = {"ops": check_operators(m.tp), "layers": check_layers(m.tp),
                  "ce": check_cross_entropy(m.tp),
                  "memory": {sp: measure_layer(m, LAYER_CONFIG, 2, sp) for sp in (False, True)},
                  "collectives": {sp: block_collectives(m, LAYER_CONFIG, 2, sp)
                                  for sp in (False, True)}}
    return out


@pytest.fixture(scope="module")
def results():
    res = launch(tp_worker, 4, layout=Layout(tp=4), timeout=240)
    return res.results  # per rank: {tp: {...}}


def test_parallelize_takes_a_layout_or_a_mesh(results):
    for rank_res in results:
        assert rank_res["layout_err"] < 1e-6


@pytest.mark.parametrize("tp", [2, 4])
def test_operators_forward_and_backward_match_hand_computed_values(results, tp):
    for rank_res in results:
        errs = rank_res[tp]["ops"]
        assert len(errs) == 6 and max(errs.values()) == 0.0, errs


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_equal_serial_layers(results, tp):
    for rank_res in results:
        errs = rank_res[tp]["layers"]
        assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_equals_torch(results, tp):
    for rank_res in results:
        errs = rank_res[tp]["ce"]
        assert max(errs.values()) < 1e-6, errs


@pytest.mark.parametrize("tp", [2, 4])
def test_collectives_per_layer(results, tp):
    c = results[0][tp]["collectives"]
    assert c[False] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    # SP: each all-reduce becomes all-gather + reduce-scatter; backward also re-gathers the
    # two column layers' sharded inputs for their weight gradients.
    assert c[True] == {"forward": {"all_gather": 2, "reduce_scatter": 2},
                       "backward": {"all_gather": 4, "reduce_scatter": 2}}


@pytest.mark.parametrize("tp", [2, 4])
def test_activation_memory_matches_formula(results, tp):
    for rank_res in results:
        for sp, m in rank_res[tp]["memory"].items():
            assert m["measured"] == model_activation_bytes(8, 2, 32, 4, tp, sp), m
    no_sp, sp = results[0][tp]["memory"][False], results[0][tp]["memory"][True]
    assert sp["measured"] * tp == pytest.approx(
        model_activation_bytes(8, 2, 32, 4, 1, False), rel=1e-12)
    assert sp["measured"] < no_sp["measured"]


def test_serial_layer_memory_matches_formula():
    cfg = LAYER_CONFIG
    x = torch.randn(2, cfg.seq_len, cfg.d_model, requires_grad=True)
    measured, _ = saved_activation_bytes(GPT(cfg).blocks[0], x)
    assert measured == model_activation_bytes(cfg.seq_len, 2, cfg.d_model, cfg.n_heads)
    # the paper's 16-bit count for the same layer, for scale: sbh(34 + 5as/h)
    s, b, h, a = cfg.seq_len, 2, cfg.d_model, cfg.n_heads
    assert korthikanti_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)


def test_shard_unshard_roundtrip_with_fused_qkv_and_padding():
    w = torch.arange(3 * 8 * 2, dtype=torch.float32).view(24, 2)
    shards = [shard(w, 0, r, 4, parts=3) for r in range(4)]
    assert torch.equal(shards[1][:, 0], torch.tensor([4., 6., 20., 22., 36., 38.]))
    assert torch.equal(unshard(shards, 0, parts=3), w)
    v = torch.randn(10, 3)
    padded = [shard(v, 0, r, 4, pad_to=12) for r in range(4)]
    assert torch.equal(padded[3][2], torch.zeros(3))
    assert torch.equal(unshard(padded, 0, size=10), v)


def test_layouts_the_model_cannot_take_fail_with_the_valid_choices():
    cfg = config_from("tiny")  # 4 heads, seq 32
    with pytest.raises(LayoutError, match="tp=3 does not divide n_heads=4; choose 1, 2, 4"):
        check_layout(Layout(tp=3), cfg)
    with pytest.raises(LayoutError, match="does not divide it; choose tp in 1, 2"):
        check_layout(Layout(tp=4), config_from("tiny", seq=30), sequence_parallel=True)


def test_bench_tp_reports_both_modes_and_agrees_with_dtensor():
    from edu3d.bench.bench_tp import run_benchmark

    rep = run_benchmark(2, reps=1)  # a shape check, not a timing: benchmarks are commands
    assert rep["benchmark"] == "tp" and rep["world_size"] == 2
    assert [r["name"] for r in rep["results"]] == ["2 blocks", "2 blocks overlap", "2 blocks sp"]
    for r in rep["results"]:
        assert r["ratio"] > 0 and r["max_abs_diff"] < 1e-4
        assert r["reference"].startswith("torch.distributed.tensor.parallel")


def test_split_figure_draws_every_rank_and_names_the_collective():
    from edu3d.widgets.tensor_split import split_figure

    torch.manual_seed(0)
    x, w = torch.randn(4, 6), torch.randn(6, 8)
    results = []
    for r in range(2):
        col = {"x": x, "w": w.chunk(2, 1)[r], "partial": x @ w.chunk(2, 1)[r], "result": x @ w}
        row = {"x": x.chunk(2, 1)[r], "w": w.chunk(2, 0)[r],
               "partial": x.chunk(2, 1)[r] @ w.chunk(2, 0)[r], "result": x @ w}
        results.append({"serial": x @ w, "column": col, "row": row})
    for kind, word in (("column", "all-gather"), ("row", "all-reduce")):
        fig = split_figure(results, kind)
        assert len(fig.data) == 3 * 2 + 2
        assert any(word in a.text for a in fig.layout.annotations)
        assert "on 2 ranks" in fig.layout.title.text
    with pytest.raises(ValueError, match="kind must be"):
        split_figure(results, "diagonal")
