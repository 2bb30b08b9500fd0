"""Context parallelism against the serial answer: the zigzag maps and the merge by hand, then
one 4-rank launch (cp=4 on the world, cp=2 on [0,1] and [2,3]) checking ring, all-gather and
Ulysses attention (forward and q, k, v gradients, both splits, fp32 and bf16) against full
causal attention, and ``apply_cp`` on a tiny GPT, alone and after ``apply_tp`` (tp=2 x cp=2),
against the serial model's loss and gradients. Packed documents too: every impl and split
against full attention under the block-diagonal document mask, with document boundaries
inside a chunk and exactly between two chunks, and the packed GPT."""

import functools
import math

import pytest
import torch

from edu3d.config.layout import Layout
from edu3d.launch import launch
from edu3d.model.gpt import GPT, GPTConfig
from edu3d.parallel.recompute import apply_recompute
from edu3d.parallel.cp import (apply_cp, block_attention, check, merge, positions, split_tokens,
                               unsplit, valid_seq_lens, work)
from tests.workers_cp import DOCS, all_checks

TOL = 1e-5
INF = float("-inf")


@pytest.mark.parametrize("split", ["zigzag", "plain"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_maps_cover_the_sequence_and_invert(cp, split):
    held = [positions(16, cp, r, split) for r in range(cp)]
    assert sorted(p for h in held for p in h) == list(range(16))
    x = torch.arange(2 * 16 * 3).view(2, 16, 3)
    parts = [split_tokens(x, cp, r, split) for r in range(cp)]
    assert all(torch.equal(p[:, :, 0] // 3 % 16, torch.tensor([h, h])) for p, h in zip(parts, held))
    assert torch.equal(unsplit(parts, cp, split), x)


def test_zigzag_positions_by_hand():
    assert positions(8, 2, 0) == [0, 1, 6, 7] and positions(8, 2, 1) == [2, 3, 4, 5]
    assert positions(8, 2, 1, "plain") == [4, 5, 6, 7]
    assert valid_seq_lens(2, "zigzag", 12) == [4, 8, 12]
    assert valid_seq_lens(2, "plain", 6) == [2, 4, 6]
    with pytest.raises(ValueError, match="choose seq_len in 8, 16"):
        check(12, 4)
    with pytest.raises(ValueError, match="choose one of zigzag, plain"):
        check(8, 2, "stripes")


def test_work_plain_grows_zigzag_is_equal():
    assert work(16, 4, "plain") == [10, 26, 42, 58]  # rank r: sum of (p + 1) over its 4
    assert work(16, 4) == [34] * 4
    assert sum(work(64, 8)) == sum(work(64, 8, "plain")) == 64 * 65 // 2


def test_merge_by_hand():
    out_a, out_b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 6.0]])
    lse_a, lse_b = torch.tensor([0.0]), torch.tensor([math.log(3.0)])  # weights 1/4 and 3/4
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert torch.allclose(out, torch.tensor([[2.5, 5.0]]))
    assert torch.allclose(lse, torch.tensor([math.log(4.0)]))
    out, lse = merge(out_a, torch.tensor([INF]), out_b, lse_b)  # a saw nothing: b wins
    assert torch.equal(out, out_b) and lse.item() == pytest.approx(math.log(3.0))
    out, lse = merge(out_a, torch.tensor([INF]), out_b, torch.tensor([INF]))  # nothing at all
    assert torch.equal(out, torch.zeros(1, 2)) and lse.item() == INF


def test_block_split_in_two_merges_to_full_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g) for _ in range(3))
    p = torch.arange(8)
    full, lse = block_attention(q, k, v, p, p, 0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    a = block_attention(q, k[..., :4, :], v[..., :4, :], p, p[:4], 0.5)
    b = block_attention(q, k[..., 4:, :], v[..., 4:, :], p, p[4:], 0.5)
    assert b[1][0, 0, :4].eq(INF).all() and b[0][0, 0, :4].eq(0).all()  # nothing visible
    out, lse2 = merge(*a, *b)
    assert torch.allclose(full, ref, atol=1e-6) and torch.allclose(out, ref, atol=1e-6)
    assert torch.allclose(lse2, lse, atol=1e-6) and not out.isnan().any()


@functools.lru_cache(maxsize=None)
def _launched() -> list[dict]:
    run = launch(all_checks, 4, layout=Layout(dp=2, tp=2), timeout=120, name="cp")
    return [run.results[r] for r in range(4)]


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_full_attention(cp):
    for rank, res in enumerate(_launched()):
        for key, r in res["attn"][cp].items():
            assert max(r["errs"]) < TOL, (rank, cp, key, r["errs"])
            assert r["dtype"] == "torch.float32"


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_with_packed_documents_equals_masked_attention(cp):
    """Row 0's boundaries fall exactly between chunks, row 1's inside them (workers_cp.DOCS);
    some ring blocks hide every key from some query rows (a document starting after the
    block): their merge weight is 0, never NaN."""
    for rank, res in enumerate(_launched()):
        for key, r in res["packed"][cp].items():
            assert max(r["errs"]) < TOL, (rank, cp, key, r["errs"])


def test_packed_documents_cross_chunks_as_the_test_says():
    docs = DOCS
    for cp, size in ((2, 4), (4, 2)):
        starts = [int(i) for i in (docs[0, 1:] != docs[0, :-1]).nonzero().flatten() + 1]
        assert all(s % size == 0 for s in starts)  # row 0: exactly at chunk boundaries
        starts = [int(i) for i in (docs[1, 1:] != docs[1, :-1]).nonzero().flatten() + 1]
        assert all(s % size for s in starts)  # row 1: inside chunks


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_runs_in_bf16(cp):
    for res in _launched():
        for key, r in res["bf16"][cp].items():
            assert r["dtype"] == r["grad_dtype"] == "torch.bfloat16"
            assert max(r["errs"]) < 2e-2, (cp, key, r["errs"])


def test_ring_skips_hidden_blocks_and_zigzag_balances_them():
    results = _launched()
    for cp in (2, 4):
        zig = [res["attn"][cp]["ring/zigzag"]["work"] for res in results]
        plain = [res["attn"][cp]["ring/plain"]["work"] for res in results]
        if cp == 2:
            zig, plain = zig[:2], plain[:2]  # ranks 2, 3 are the other pair's copy
        # blocks are half a rank's tokens, c = T/(2cp): zigzag computes 2cp + 1 of them on
        # every rank, plain 4r + 3 on rank r (its chunks 2r and 2r+1); the same total.
        c = 16 // (2 * cp)
        assert zig == [(2 * cp + 1) * c * c] * cp
        assert plain == [(4 * r + 3) * c * c for r in range(cp)]


def test_apply_cp_gpt_equals_serial():
    for rank, res in enumerate(_launched()):
        for key, r in res["gpt"].items():
            assert r["loss_err"] < TOL and r["grad_err"] < TOL, (rank, key, r)
            assert r["same_names"]


def test_apply_cp_packed_gpt_equals_serial():
    """The packed rows through apply_cp's model (restarting positions cut like the tokens,
    the document mask in every impl), recomputation included, against the serial model."""
    for rank, res in enumerate(_launched()):
        for key, r in res["gpt_packed"].items():
            assert r["loss_err"] < TOL and r["grad_err"] < TOL, (rank, key, r)


def test_apply_cp_after_apply_tp_equals_serial():
    """tp=2 (with and without sequence parallelism) x cp=2 on 4 ranks."""
    for rank, res in enumerate(_launched()):
        for key, r in res["tp_cp"].items():
            assert r["loss_err"] < TOL and r["grad_err"] < TOL, (rank, key, r)


def test_ulysses_refuses_a_degree_not_dividing_heads():
    for res in _launched():
        assert "choose cp in 1, 3" in res["ulysses_refused"]


def test_apply_cp_refusals_name_the_fix():
    config = GPTConfig(n_layers=1, n_heads=4, d_model=16, seq_len=16, vocab_size=32)
    with pytest.raises(ValueError, match="apply_cp first, then apply_recompute"):
        apply_cp(apply_recompute(GPT(config), "selective"), None, 0, 2)
    with pytest.raises(ValueError, match="choose cp in 1, 2, 4"):
        apply_cp(GPT(config), None, 0, 8, impl="ulysses", split="plain")
    with pytest.raises(ValueError, match="choose seq_len in"):
        apply_cp(GPT(config), None, 0, 3)
    model = apply_cp(GPT(config), None, 1, 2)
    assert model.cp_positions == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="cut the batch with split_batch"):
        model.embed(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match=r"whole rows' document ids \[B, 16\]"):
        model.embed(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
