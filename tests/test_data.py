"""The synthetic corpus: deterministic, layout-free batches, and how they are cut up."""

import math

import pytest
import torch

from edu3d.train.cut import microbatches, shard_rows
from edu3d.train.data import STEP_ENTROPY, SyntheticCorpus


def test_batch_shapes_and_shift():
    corpus = SyntheticCorpus(256, 32)
    x, y = corpus.batch(step=3, global_batch=8)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert 0 <= int(x.min()) and int(x.max()) < 256


def test_batches_are_deterministic_and_vary_with_seed_and_step():
    a, b = SyntheticCorpus(256, 32, seed=0), SyntheticCorpus(256, 32, seed=0)
    torch.manual_seed(99)  # the global RNG plays no part
    assert torch.equal(a.batch(5, 8)[0], b.batch(5, 8)[0])
    assert not torch.equal(a.batch(5, 8)[0], a.batch(6, 8)[0])
    assert not torch.equal(a.batch(5, 8)[0], SyntheticCorpus(256, 32, seed=1).batch(5, 8)[0])


def test_sequences_follow_the_chain_then_repeat():
    corpus = SyntheticCorpus(64, 16)
    x, y = corpus.batch(0, 16)
    tokens = torch.cat([x, y[:, -1:]], dim=1)
    p = corpus.period
    assert p == 9 and torch.equal(tokens[:, p:], tokens[:, : 17 - p])
    prev, nxt = tokens[:, : p - 1].flatten(), tokens[:, 1:p].flatten()
    assert (corpus.successors[prev] == nxt[:, None]).any(dim=1).all()
    assert all(len(set(row.tolist())) == 4 for row in corpus.successors)


def test_entropy_floor():
    assert STEP_ENTROPY == pytest.approx(1.1369, abs=1e-4)
    assert SyntheticCorpus(256, 32).entropy_floor() == pytest.approx(16 * STEP_ENTROPY / 32)
    assert SyntheticCorpus(256, 32).entropy_floor() < math.log(256)


def test_shard_rows_and_microbatches():
    x = torch.arange(24).view(8, 3)
    assert torch.equal(shard_rows(x, 1, 4), x[2:4])
    assert torch.equal(torch.cat([shard_rows(x, i, 2) for i in range(2)]), x)
    with pytest.raises(ValueError, match="8 rows do not split evenly over 3 .*multiple of 3"):
        shard_rows(x, 0, 3)
    mbs = microbatches(x, x + 1, 4)
    assert len(mbs) == 4 and torch.equal(mbs[1][0], x[2:4]) and torch.equal(mbs[1][1], x[2:4] + 1)
    with pytest.raises(ValueError, match="8 rows do not split into 3 micro-batches; choose m "
                                         "among 1, 2, 4, 8"):
        microbatches(x, x, 3)
