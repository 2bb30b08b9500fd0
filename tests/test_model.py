"""The serial reference GPT: config validation, deterministic init, shapes, FLOPs."""

import math

import pytest
import torch

from edu3d.model.gpt import GPT, PRESETS, GPTConfig, config_from, flops_per_token, num_params


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_same_seed_same_weights_different_seed_differs():
    a, b = _state(GPT(PRESETS["tiny"], seed=0)), _state(GPT(PRESETS["tiny"], seed=0))
    c = _state(GPT(PRESETS["tiny"], seed=1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])


def test_weights_ignore_global_rng():
    torch.manual_seed(123)
    a = _state(GPT(PRESETS["tiny"]))
    torch.manual_seed(456)
    torch.rand(1000)
    b = _state(GPT(PRESETS["tiny"]))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_init_statistics():
    cfg = config_from("tiny", d_model=128)
    model = GPT(cfg)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert torch.all(model.blocks[0].attn.qkv.bias == 0)
    assert torch.all(model.ln_f.weight == 1) and torch.all(model.ln_f.bias == 0)


def test_shapes_and_split_forward_matches_forward():
    cfg = PRESETS["tiny"]
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    logits, loss = model(idx)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size) and loss is None
    x = model.embed(idx)
    for block in model.blocks:
        x = block(x)
    torch.testing.assert_close(model.head(x), logits, rtol=0, atol=0)
    assert model(idx[:, :5])[0].shape == (2, 5, cfg.vocab_size)
    with pytest.raises(ValueError, match="longer than seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_loss_at_init_is_about_ln_vocab():
    cfg = PRESETS["tiny"]
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    _, loss = GPT(cfg)(idx, idx)
    assert loss.item() == pytest.approx(math.log(cfg.vocab_size), abs=0.05)


def test_attention_is_causal():
    cfg = PRESETS["tiny"]
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % cfg.vocab_size
    torch.testing.assert_close(model(idx)[0][:, :-1], model(changed)[0][:, :-1])


def test_tied_weights_share_storage():
    model = GPT(config_from("tiny", tie=True))
    assert model.lm_head.weight is model.tok_emb.weight
    untied = GPT(PRESETS["tiny"])
    assert num_params(untied) - num_params(model) == 256 * 64


def test_presets_and_overrides():
    assert PRESETS["gpt2-small"].tie_weights and PRESETS["gpt2-small"].vocab_size == 50257
    cfg = config_from("small", layers=2, seq=64)
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.seq_len) == (2, 8, 256, 64)
    assert PRESETS["small"].n_layers == 6  # presets are not mutated
    assert cfg.d_ff == 1024 and cfg.head_dim == 32
    with pytest.raises(ValueError, match="unknown model preset 'huge'; choose one of tiny, small"):
        config_from("huge")
    with pytest.raises(ValueError, match="n_heads=5 does not divide d_model=64; choose one of "
                                         "1, 2, 4, 8, 16, 32, 64"):
        config_from(heads=5)
    with pytest.raises(ValueError, match="n_layers=0 must be a positive integer"):
        GPTConfig(n_layers=0)


def test_flops_per_token_uses_non_embedding_params():
    for cfg in (PRESETS["tiny"], config_from("tiny", tie=True)):
        n = num_params(GPT(cfg), exclude_embeddings=True)
        assert flops_per_token(cfg) == 6 * n + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len
