"""--batching: documents of different lengths, padded, bucketed, filled to a token budget or
packed, with a loss normalised by the global number of target tokens.

Unit tests of the batchers (every document used once, budgets kept, the padding-waste
formula), of the block-diagonal mask and the restarting positions, and that a packed
sequence's loss is the documents' losses computed one at a time; then parity: dp2, tp2,
pp2 (pad, bucket, tokens and pack, on every schedule), dp2 x pp2 (tokens) and, with packing,
cp2 (every CP attention, both splits), dp2 x cp2 and cp2 x pp2 equal the per-document
reference at the gradient level with plain SGD and after 3 AdamW steps, within 1e-5 relative
(after AdamW, beyond what rounding can do there: tests/adamw_noise.py). The layouts of one
world size share one launch."""

from __future__ import annotations

import functools

import pytest
import torch

from edu3d.commands.train import parse
from edu3d.config.layout import Layout, LayoutError
from edu3d.launch import launch
from edu3d.model.gpt import GPT, PRESETS, document_mask, document_positions, set_attention
from edu3d.parallel.pp.engine import PipelineEngine
from edu3d.parallel.pp.stage import split_model
from edu3d.train.batching import (IGNORE, MODES, POOL_DOCS, expected_pad_waste, per_document_loss,
                                  step_batch)
from edu3d.train.cut import cut
from edu3d.train.documents import DocumentCorpus
from edu3d.train.preflight import BATCHING, check_args
from tests.workers_batching import parity_many

TOL = 1e-5
CORPUS = DocumentCorpus(256, 32, seed=0)


def test_modes_agree_with_options():
    assert BATCHING == MODES


def test_lengths_are_lognormal_clipped_and_deterministic():
    n = CORPUS.lengths(("step", 1), 4000)
    assert n.min() >= 2 and n.max() <= 32
    assert torch.equal(n, CORPUS.lengths(("step", 1), 4000))
    assert not torch.equal(n, CORPUS.lengths(("step", 2), 4000))
    wide = DocumentCorpus(256, 1024, seed=0, mean=100, sigma=0.5).lengths(("x",), 20000)
    assert float(wide.double().mean()) == pytest.approx(100, rel=0.03)  # the mean asked for
    assert torch.unique(DocumentCorpus(256, 32, mean=8, sigma=0).lengths(("x",), 50)).tolist() == [8]


def test_documents_are_the_walk_and_its_repeat():
    for d, n in zip(CORPUS.documents(("k",), [2, 5, 32]), [2, 5, 32]):
        assert len(d) == n + 1
        p = (n + 2) // 2
        assert torch.equal(d[p:], d[:n + 1 - p])


@pytest.mark.parametrize("mode", ["pad", "bucket", "tokens", "pack"])
def test_batches_keep_their_invariants(mode):
    b = step_batch(CORPUS, mode, 3, 8, slots=4, max_tokens=64)
    groups = b.groups(4)
    assert all(groups) and sum(map(len, groups)) == len(b.rows)
    for rows in groups:
        mbs_width = max(sum(len(d) - 1 for d in r) for r in rows)
        assert mbs_width <= 32
        if mode == "tokens":
            assert len(rows) * mbs_width <= 64  # the budget
    if mode == "pack":
        assert all(sum(len(d) - 1 for d in r) <= 32 for r in b.rows)
        assert b.waste(4) < step_batch(CORPUS, "pad", 3, 8).waste(4)
    if mode in ("pad", "bucket"):
        assert len(b.rows) == 8 and all(len(r) == 1 for r in b.rows)
    x, y, doc, w = zip(*cut(b, None, 2, dp_index=1, dp_size=2))
    assert sum(int((t != IGNORE).sum()) for t in y) * 2 * 2 / b.targets == pytest.approx(sum(w))
    assert (doc[0] is not None) == (mode == "pack")


def test_bucket_and_tokens_use_every_document_once():
    """bucket: the 8 steps of a pool are a permutation of its sorted documents; tokens:
    consecutive steps take consecutive batches of the pool (no document twice)."""
    pool = sorted(len(d) for s in range(1, 9) for d in step_batch(CORPUS, "bucket", s, 8).documents)
    want = sorted(CORPUS.lengths(("bucket", 0), 64).tolist())
    assert pool == [n + 1 for n in want]
    taken = [len(d) - 1 for s in range(1, 4) for d in step_batch(CORPUS, "tokens", s, 8, 2, 64).documents]
    assert len(taken) < POOL_DOCS and sorted(taken) == sorted(taken)  # within the first pool
    assert sum(taken) <= 3 * 2 * 64


def test_mask_blocks_other_documents_and_positions_restart():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2]])
    mask = document_mask(doc)[0, 0]
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    assert document_positions(doc).tolist() == [[0, 1, 2, 0, 1, 0]]


@pytest.mark.parametrize("attn", ["sdpa", "explicit"])
def test_packed_loss_equals_the_documents_alone(attn):
    """The classic failure: without the mask (or with positions running on) the packed loss
    is not the documents' loss. With them it is, to fp32 rounding, in both attention paths."""
    model = GPT(PRESETS["tiny"], seed=0)
    set_attention(model, attn)
    b = step_batch(CORPUS, "pack", 1, 8)
    (x, y, doc, w), = cut(b, None, 1)
    want = per_document_loss(model, b).detach()
    got = (model(x, y, doc)[1] * w).detach()
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    unmasked = (model(x, y)[1] * w).detach()  # documents see each other, positions run on
    assert abs(float(unmasked) - float(want)) > 1e-3


def test_cp_pieces_are_weighted_by_their_own_targets():
    """Under context parallelism each rank's piece of a micro-batch counts its own targets:
    the weights add up to dp x cp x m, and with one row per micro-batch and long documents
    some plain-split pieces are padding only (weight 0), as the "empty pieces" layout below
    needs. Equal weights (a loss divided by cp) would be wrong exactly there."""
    b = step_batch(DocumentCorpus(256, 32, seed=0, mean=12), "pack", 1, 8)
    weights = [w for dp in (0, 1) for r in (0, 1)
               for *_, w in cut(b, None, 4, dp_index=dp, dp_size=2, cp_size=2, cp_rank=r,
                                split="plain")]
    assert sum(weights) == pytest.approx(2 * 2 * 4) and 0.0 in weights
    x, y, doc, _ = cut(b, None, 4, dp_size=2, cp_size=2, cp_rank=1)[0]
    assert x.shape == y.shape == (1, 16) and doc.shape == (1, 32)  # doc ids stay whole
    with pytest.raises(ValueError, match="--batching pack, not pad"):
        cut(step_batch(CORPUS, "pad", 1, 8), None, 1, cp_size=2)


def test_pad_waste_formula_matches_batches():
    lengths = CORPUS.lengths(("formula",), 20000)
    for rows in (1, 2, 4):
        fed = [step_batch(CORPUS, "pad", s, rows) for s in range(1, 400)]
        measured = 1 - sum(b.targets for b in fed) / sum(b.fed(1) for b in fed)
        assert measured == pytest.approx(expected_pad_waste(lengths, rows), abs=0.03)
    assert expected_pad_waste(lengths, 1) == pytest.approx(0.0, abs=1e-9)


def test_pipeline_receives_take_each_microbatch_shape():
    """A pipeline stage sizes micro-batch i's receive from its own copy of the batch: the
    first message teaches only the rule [B, T / k, *rest] (k = tp under sequence
    parallelism); a tensor that is not [B, T / k, ...] keeps its one shape."""
    model = GPT(PRESETS["tiny"], seed=0)
    stages = split_model(model, [(0, 2), (2, 4)], 1, 0)
    engine = PipelineEngine(stages, [], 2, [0], None, 2)
    engine.batch = [(torch.zeros(4, 9, dtype=torch.long), None),
                    (torch.zeros(21, 3, dtype=torch.long), None)]
    for sent, k in ((torch.zeros(4, 9, 64), 1), (torch.zeros(4, 3, 64), 3)):
        rule = engine._rule(sent, 0)
        assert rule[1] == k and engine._expect(rule, 0) == (torch.float32, sent.shape)
        assert engine._expect(rule, 1) == (torch.float32, (21, 3 // k, 64))
    fixed = engine._rule(torch.zeros(7, 64, dtype=torch.bfloat16), 0)
    assert engine._expect(fixed, 1) == (torch.bfloat16, (7, 64))


@pytest.mark.parametrize("argv, knob", [
    ("--batching pad --cp 2", "--cp"), ("--batching tokens --cp 2", "--batching pack"),
    ("--batching tokens --max-tokens 8", "--max-tokens 8"), ("--max-tokens 64", "--max-tokens"),
    ("--batching pack --sp --tp 2", "--sp"), ("--batching pad --experts 2", "--experts"),
    ("--batching pack --max-tokens 64", "--max-tokens")])
def test_bad_combinations_are_refused_naming_the_knob(argv, knob):
    with pytest.raises(LayoutError, match=knob):
        check_args(parse(argv.split()))


LAYOUTS = {
    "dp2 pack": "--dp 2 --batching pack",
    "dp2 tokens m2": "--dp 2 --batching tokens --max-tokens 64 --microbatches 2",
    "dp2 zero2 pad": "--dp 2 --zero 2 --batching pad",
    "tp2 pack explicit": "--tp 2 --batching pack --attn explicit",
    "tp2 tokens": "--tp 2 --batching tokens --max-tokens 96",
    "pp2 pack 1f1b": "--pp 2 --batching pack --microbatches 2",
    # a pipeline with micro-batches of their own [B, T] (refused until each stage sized its
    # receives from its copy of the batch), on every schedule
    "pp2 pad 1f1b m2": "--pp 2 --batching pad --microbatches 2",
    "pp2 bucket gpipe m4": "--pp 2 --batching bucket --schedule gpipe --microbatches 4",
    "pp2 pad zb-h1 m4": "--pp 2 --batching pad --schedule zb-h1 --microbatches 4",
    "pp2 tokens interleaved m2": "--pp 2 --vpp 2 --schedule interleaved --batching tokens "
                                 "--max-tokens 64 --microbatches 2",
    "dp2 pp2 tokens m2": "--dp 2 --pp 2 --batching tokens --max-tokens 64 --microbatches 2",
    # context parallelism: the rows cut over 2 ranks, the document mask crossing them
    "cp2 pack ring": "--cp 2 --batching pack",
    "cp2 pack ring plain": "--cp 2 --cp-split plain --batching pack",
    "cp2 pack allgather": "--cp 2 --cp-impl allgather --batching pack",
    "cp2 pack ulysses": "--cp 2 --cp-impl ulysses --batching pack --attn explicit",
    "dp2 cp2 pack m2": "--dp 2 --cp 2 --batching pack --microbatches 2",
    # one row per micro-batch, long documents: some rows end before their middle, so rank 1
    # of the plain split holds only padding there (weight 0, still runs backward)
    "dp2 cp2 pack plain m4 empty pieces": "--dp 2 --cp 2 --cp-split plain --batching pack "
                                          "--microbatches 4 --doc-mean 12",
    "cp2 pp2 pack m2": "--cp 2 --pp 2 --batching pack --microbatches 2",  # each stage's mask
}


def _layout(argv):
    get = {k: int(argv[argv.index(f"--{k}") + 1]) if f"--{k}" in argv else 1
           for k in ("dp", "tp", "pp", "cp")}
    return Layout(**get)


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    """Every layout of ``world`` ranks in one launch (each on a mesh of its own)."""
    names = [n for n in LAYOUTS if _layout(LAYOUTS[n].split()).world_size == world]
    run = launch(parity_many, world, args=([LAYOUTS[n].split() for n in names], TOL),
                 layout=_layout(LAYOUTS[names[0]].split()), timeout=300, name="batching")
    return dict(zip(names, run.results[0]))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_per_document_reference(name):
    res = _results(_layout(LAYOUTS[name].split()).world_size)[name]
    print(f"\n{name}: grad {res['grad_err']:.1e} loss {res['loss0_err']:.1e} "
          f"adam {res['adam_err']:.1e} param {res['param_err']:.1e}")
    assert res["grad_err"] < TOL and res["loss0_err"] < TOL
    assert res["adam_err"] < TOL and res["param_err"] < TOL
