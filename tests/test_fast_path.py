"""The fast path computes the same numbers: a padded vocabulary, SDPA against the explicit
softmax, TF32 off on CPU, the fused/foreach optimizer, the deferred loss read."""

import io

import pytest
import torch

from edu3d.config.layout import Layout
from edu3d.launch import launch
from edu3d.model.gpt import GPT, config_from, explicit_attention, set_attention
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import run
from edu3d.config.sections import Run
from tests import workers_fast

V = 250  # not a multiple of 64: --vocab-pad 64 makes the tables 256 rows


def _batch(vocab=V, rows=4):
    return SyntheticCorpus(vocab, 32, seed=0).batch(1, rows)


# ---- the padded vocabulary -----------------------------------------------------------------
def test_padded_vocabulary_is_the_same_model():
    plain, padded = GPT(config_from(vocab=V), seed=0), GPT(config_from(vocab=V, vocab_pad=64))
    assert padded.lm_head.weight.shape[0] == padded.config.padded_vocab == 256
    assert torch.equal(padded.tok_emb.weight[:V], plain.tok_emb.weight)
    assert torch.equal(padded.lm_head.weight[:V], plain.lm_head.weight)
    assert not padded.lm_head.weight[V:].any() and not padded.tok_emb.weight[V:].any()
    x, y = _batch()
    (la, lossa), (lb, lossb) = plain(x, y), padded(x, y)
    assert torch.isneginf(lb[..., V:]).all()  # the padding never wins
    assert torch.allclose(lb[..., :V], la, atol=1e-6)
    assert torch.allclose(lossa, lossb, atol=1e-6)
    lossa.backward(), lossb.backward()
    assert torch.allclose(padded.lm_head.weight.grad[:V], plain.lm_head.weight.grad, atol=1e-7)
    assert not padded.lm_head.weight.grad[V:].any()


def test_padded_vocabulary_trains_like_the_unpadded_one_serially():
    common = dict(vocab=V, steps=4, json=True)
    a = run(Run.of(**common), out=io.StringIO())
    b = run(Run.of(**common, vocab_pad=64), out=io.StringIO())
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-6)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-5)


def test_tied_gpt2_shape_pads_to_50304():
    assert config_from("gpt2-small", vocab_pad=64).padded_vocab == 50304


# ---- attention: the fused kernel against the explicit softmax ------------------------------
def test_sdpa_equals_explicit_softmax_and_their_gradients():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16, generator=g, requires_grad=True) for _ in range(3))
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    b = explicit_attention(q, k, v)
    assert torch.allclose(a, b, atol=1e-6)
    ga = torch.autograd.grad(a.square().sum(), (q, k, v))
    gb = torch.autograd.grad(b.square().sum(), (q, k, v))
    for x, y in zip(ga, gb):
        assert torch.allclose(x, y, atol=1e-5)


def test_the_model_with_either_attention_gives_the_same_loss_and_gradients():
    x, y = _batch(256)
    models = [GPT(config_from(), seed=0) for _ in range(2)]
    set_attention(models[1], "explicit")
    losses = [m(x, y)[1] for m in models]
    assert abs(losses[0].item() - losses[1].item()) < 1e-6
    for loss in losses:
        loss.backward()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    with pytest.raises(ValueError, match="choose one of sdpa, explicit"):
        set_attention(models[0], "flash")


def test_tp2_padded_vocabulary_and_explicit_attention_match_serial():
    """One launch of tp = 2: sdpa, explicit, and sdpa over a padded vocabulary."""
    runs = [dict(attn="sdpa"), dict(attn="explicit"), dict(vocab_pad=64)]
    res = launch(workers_fast.variants, 2, args=({"tp": 2, "vocab": V}, runs, 3, True),
                 layout=Layout(tp=2), timeout=120, name="fast-tp").results[0]
    serial = workers_fast.variants(None, {"vocab": V}, [{}], 3, True)[0]
    for rec in res:
        assert rec["losses"] == pytest.approx(serial["losses"], abs=1e-6)
    for rec in res[:2]:  # gradients of the same model, either attention
        for name, g in serial["grads"].items():
            assert torch.allclose(rec["grads"][name], g, atol=1e-6), name


# ---- the optimizer's kernel, TF32, the deferred read ---------------------------------------
def test_adamw_runs_over_tensor_lists_on_cpu():
    from edu3d.train.optim import make_optimizer

    opt = make_optimizer(GPT(config_from()), Run.of())
    assert opt.defaults["foreach"] is True and not opt.defaults.get("fused")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_adamw_is_fused_and_tf32_is_on_unless_asked_off():
    from edu3d.train.optim import make_optimizer
    from edu3d.train.trainer import Trainer

    model = GPT(config_from()).cuda()
    assert make_optimizer(model, Run.of()).defaults["fused"] is True
    Trainer(model, None, Run.of())
    assert torch.backends.cuda.matmul.allow_tf32
    Trainer(GPT(config_from()).cuda(), None, Run.of(no_tf32=True))
    assert not torch.backends.cuda.matmul.allow_tf32


def test_the_loss_is_read_only_at_logged_steps():
    from edu3d.train.trainer import Trainer

    trainer = Trainer(GPT(config_from()), None, Run.of())
    out = trainer.step(*SyntheticCorpus(256, 32).batch(1, 8), 1, read=False)
    assert isinstance(out["loss"], torch.Tensor) and isinstance(out["grad_norm"], torch.Tensor)
    every = run(Run.of(steps=6, json=True), out=io.StringIO())
    third = run(Run.of(steps=7, log_every=3, json=True), out=io.StringIO())
    assert [r["step"] for r in third] == [3, 6, 7]  # and the last step
    for r in third[:2]:
        assert r["loss"] == every[r["step"] - 1]["loss"] and r["tokens_per_s"] > 0


@pytest.mark.parametrize("flags,message", [
    (dict(log_every=2, ckpt_dir="/tmp/x"), "use --log-every 1 with --ckpt-dir"),
    (dict(attn="flash"), "choose one of sdpa, explicit"),
])
def test_fast_path_refusals(flags, message):
    from edu3d.config.layout import LayoutError
    from edu3d.train.preflight import check_args

    with pytest.raises(LayoutError, match=message):
        check_args(Run.of(**flags))


def test_compile_without_a_compiler_is_refused_before_launch(monkeypatch, capsys):
    from edu3d.commands.train import main

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["--compile", "--steps", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--compile needs a C++ compiler" in err and "install g++" in err
