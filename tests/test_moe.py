"""Mixture of experts: routing, balance losses, capacity, statistics (serial), and expert
parallelism against the serial layer (one 4-rank launch, workers in tests/workers_moe.py)."""

import io
import math

import pytest
import torch

from edu3d.config.layout import Layout
from edu3d.launch import launch
from edu3d.model import balance as balance_mod
from edu3d.model.gpt import (GPT, MLP, PRESETS, GPTConfig, config_from, flops_per_token,
                             num_params)
from edu3d.model.balance import AuxLoss, set_aux_scale
from edu3d.model.moe import MoE, active_params, capacity_keep, route, total_params
from edu3d.parallel.ep import apply_ep, expert_param_names
from edu3d.config.sections import Run
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import run as train
from edu3d.train.preflight import model_config
from edu3d.train.trainer import Trainer
from tests.workers_moe import moe_checks


def gen(seed):
    return torch.Generator().manual_seed(seed)


def old_init(model, seed):
    """GPT.init_weights as it was before MoE existed."""
    g = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                p.normal_(0.0, residual_std, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)


def test_dense_config_is_unchanged():
    for cfg in (PRESETS["tiny"], config_from("tiny", tie=True)):
        model = GPT(cfg, seed=3)
        names = [n for n, _ in model.named_parameters()]
        assert not any("router" in n or "experts" in n for n in names)
        ref = GPT(cfg, seed=0)
        old_init(ref, 3)
        for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
            assert torch.equal(a, b), n
        assert total_params(cfg) == active_params(cfg) == num_params(model)


def test_moe_names_init_and_counts():
    cfg = GPTConfig(n_layers=4, d_model=64, n_experts=4, topk=2, moe_every=2, shared_experts=1)
    model = GPT(cfg)
    names = {n for n, _ in model.named_parameters()}
    assert "blocks.0.mlp.router.weight" in names and "blocks.2.mlp.experts.3.fc.weight" in names
    assert "blocks.0.mlp.shared.0.proj.weight" in names and "blocks.1.mlp.fc.weight" in names
    assert not any(n.startswith("blocks.1.mlp.router") for n in names)
    assert "blocks.0.mlp.expert_bias" in model.state_dict()
    residual = 0.02 / math.sqrt(2 * cfg.n_layers)
    big = GPT(GPTConfig(n_layers=4, d_model=128, n_experts=2))
    std = big.blocks[0].mlp.experts["1"].proj.weight.std().item()
    assert std == pytest.approx(residual, rel=0.05)
    assert big.blocks[0].mlp.router.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert total_params(cfg) == num_params(model)
    assert total_params(cfg, exclude_embeddings=True) == num_params(model, exclude_embeddings=True)
    mlp = 8 * 64 * 64 + 5 * 64
    assert total_params(cfg) - active_params(cfg) == 2 * (4 - 2) * mlp
    n_active = active_params(cfg, exclude_embeddings=True)
    assert flops_per_token(cfg) == 6 * n_active + 12 * 4 * 64 * cfg.seq_len


@pytest.mark.parametrize("kw, match", [({"topk": 5}, "topk=5 is more than n_experts=4"),
                                       ({"balance": "x"}, "balance"),
                                       ({"router_dtype": "bf16"}, "router_dtype"),
                                       ({"capacity_factor": -1.0}, "capacity_factor"),
                                       ({"moe_every": 0}, "moe_every")])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(n_experts=4, **kw)


def test_route_topk_gates_and_bias():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    idx, gates = route(probs, 2)
    assert idx.tolist() == [[0, 1], [1, 2]]
    torch.testing.assert_close(gates, torch.tensor([[0.625, 0.375], [2 / 3, 1 / 3]]))
    idx, gates = route(probs, 1)  # k = 1: the raw probability (Switch)
    assert idx.tolist() == [[0], [1]]
    torch.testing.assert_close(gates, torch.tensor([[0.5], [0.6]]))
    _, gates = route(probs, 2, norm_topk=False)
    torch.testing.assert_close(gates, torch.tensor([[0.5, 0.3], [0.6, 0.3]]))
    idx, gates = route(probs, 2, bias=torch.tensor([0.0, 0.0, 1.0]))  # bias selects only
    assert idx.tolist() == [[2, 0], [2, 1]]
    torch.testing.assert_close(gates, torch.tensor([[0.2 / 0.7, 0.5 / 0.7], [1 / 3, 2 / 3]]))


def one_hot_layer(E=4, k=1, **kw):
    """A layer with d = E whose router is 50·I: token e·one-hot goes to expert e, prob ~1."""
    cfg = GPTConfig(n_heads=1, d_model=E, n_experts=E, topk=k, router_dtype="fp64", **kw)
    layer = MoE(cfg, MLP)
    with torch.no_grad():
        layer.router.weight.copy_(50 * torch.eye(E))
    return layer


@pytest.mark.parametrize("k", [1, 2])
def test_aux_loss_is_one_balanced_and_E_over_k_collapsed(k):
    """1 at perfect balance; at collapse every token sends its k assignments to the same k
    experts, f_i = 1/k for them, so the maximum is E/k (4 for top-1, 2 for top-2)."""
    layer = one_hot_layer(k=k)
    balanced = torch.eye(4).repeat(2, 1).view(1, 8, 4)
    layer(balanced)
    assert layer.take_stats()["aux"] == pytest.approx(1.0, abs=1e-9)
    collapsed = torch.eye(4)[[0] * 8].view(1, 8, 4)
    layer(collapsed)
    stats = layer.take_stats()
    assert stats["aux"] == pytest.approx(4 / k, abs=1e-9)
    assert stats["counts"][0] == 8 and stats["counts"].sum() == 8 * k
    assert stats["forwards"] == 1


def router_dtypes(layer, x, **autocast) -> dict:
    """The dtypes of the router's logits path (probabilities, gates, aux, z) on ``x`` under
    ``torch.autocast(**autocast)``, and its probabilities."""
    with torch.autocast("cpu", **autocast):
        r = layer.route(x.reshape(-1, x.shape[-1]), x.shape[0])
    return {"probs": r.probs.dtype, "gates": r.gates.dtype, "aux": r.aux.dtype,
            "z": r.z.dtype}, r.probs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_stays_in_router_dtype_under_autocast(dtype):
    """Autocast recasts a matmul to 16 bits; the router's logits, softmax and z-loss must
    not follow it: they come out in fp32, bit for bit what autocast off gives."""
    cfg = GPTConfig(d_model=16, n_heads=1, n_experts=4, topk=2)
    layer = MoE(cfg, MLP)
    x = torch.randn(2, 8, 16, generator=gen(5))
    got, probs = router_dtypes(layer, x, dtype=dtype)
    assert set(got.values()) == {torch.float32}, got
    _, plain = router_dtypes(layer, x, enabled=False)
    assert torch.equal(probs, plain)


def test_bias_balance_counts_the_unbiased_topk_and_defaults_to_no_aux_loss():
    """DeepSeek-V3, Megatron: with the bias on, the loss's f_i counts the router's own top-k
    (the bias only selects). Every token prefers expert 0, the bias sends all to expert 2:
    routed counts say expert 2, the loss sees the collapse on expert 0 (E/k = 4)."""
    layer = one_hot_layer(E=4, k=1, balance="bias")
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    layer(torch.eye(4)[[0] * 8].view(1, 8, 4))
    stats = layer.take_stats()
    assert stats["counts"].tolist() == [0, 0, 8, 0]
    assert stats["aux"] == pytest.approx(4.0, abs=1e-9)
    bias = model_config(Run.of(experts=4, balance="bias"))
    assert bias.aux_loss_coef == 0.0 and bias.balance == "bias"
    both = model_config(Run.of(experts=4, balance="bias", aux_loss_coef=1e-3))
    assert both.aux_loss_coef == 1e-3
    assert model_config(Run.of(experts=4)).aux_loss_coef == 1e-2


def test_sequence_scope_is_the_mean_over_sequences():
    """--aux-scope sequence: each sequence its own group (DeepSeek-V3's sequence-wise loss):
    the value and the router's gradient are the mean of one forward per sequence."""
    torch.manual_seed(0)  # the experts' initial weights: not whatever earlier tests left
    x = torch.randn(3, 5, 16, generator=gen(6))
    kw = dict(d_model=16, n_heads=1, n_experts=4, topk=2, router_dtype="fp64",
              aux_loss_coef=1.0)
    seq = MoE(GPTConfig(aux_scope="sequence", **kw), MLP)
    one = MoE(GPTConfig(**kw), MLP)
    one.load_state_dict(seq.state_dict())
    (seq(x) * 0).sum().backward()
    value = seq.take_stats()["aux"]
    try:
        set_aux_scale(1 / 3)
        values = []
        for b in range(3):
            (one(x[b:b + 1]) * 0).sum().backward()
            values.append(one.take_stats()["aux"])
    finally:
        set_aux_scale(1.0)
    assert value == pytest.approx(sum(values) / 3, rel=1e-12)
    # the router's weight is fp32: a sum in another order moves each entry by rounding of
    # the largest ones (1.6e-9 on entries of 1e-3 under one seed of 40), not of its own size
    scale = one.router.weight.grad.abs().max().item()
    torch.testing.assert_close(seq.router.weight.grad, one.router.weight.grad, rtol=1e-6,
                               atol=1e-6 * scale)
    whole = MoE(GPTConfig(**kw), MLP)
    whole.load_state_dict(seq.state_dict())
    whole(x)
    assert abs(whole.take_stats()["aux"] - value) > 1e-4  # the scope changes the loss


def test_z_loss_and_aux_scale_reach_the_router():
    layer = one_hot_layer(E=4, k=2, aux_loss_coef=0.0, z_loss_coef=1.0)
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    try:
        set_aux_scale(0.25)
        out = layer(x)
        (out * 0).sum().backward()
    finally:
        set_aux_scale(1.0)
    w = layer.router.weight.detach().double().requires_grad_()
    z = torch.logsumexp(x.reshape(-1, 4).double() @ w.t(), -1).square().mean()
    (0.25 * z).backward()
    assert layer.take_stats()["z"] == pytest.approx(z.item(), rel=1e-6)
    torch.testing.assert_close(layer.router.weight.grad.double(), w.grad, rtol=1e-6, atol=1e-9)


def test_auxloss_passes_output_and_gives_scaled_gradient():
    out, aux = torch.randn(3, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    try:
        set_aux_scale(0.5)
        AuxLoss.apply(out, aux * 3).sum().backward()
    finally:
        set_aux_scale(1.0)
    assert out.grad.tolist() == [1.0, 1.0, 1.0] and aux.grad.item() == pytest.approx(1.5)
    assert balance_mod.aux_scale() == 1.0


def test_capacity_keeps_highest_gates_ties_to_lower_index():
    gate = torch.tensor([0.9, 0.5, 0.5, 0.7, 0.4, 0.4, 0.4])
    expert = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    token = torch.tensor([5, 2, 1, 0, 6, 3, 4])
    keep = capacity_keep(gate, expert, token, 2, 2)
    # expert 0: 0.9 and 0.7 stay; expert 1: three ties, tokens 3 and 4 stay
    assert keep.tolist() == [True, False, False, True, False, True, True]


def test_layer_capacity_drops_to_ceil_and_stats_count_every_assignment():
    cfg = GPTConfig(d_model=16, n_heads=1, n_experts=4, topk=2, capacity_factor=1.0,
                    router_dtype="fp64")
    layer = MoE(cfg, MLP)
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    stats = layer.take_stats()
    N, k, E = 24, 2, 4
    cap = math.ceil(N * k / E * 1.0)
    assert int(stats["counts"].sum()) == N * k
    assert stats["dropped"] == int((stats["counts"] - cap).clamp(min=0).sum()) > 0
    # the reference: per token, the kept assignments' gates times their experts' outputs
    flat = x.reshape(-1, 16)
    probs = (flat.double() @ layer.router.weight.double().t()).softmax(-1)
    idx, gates = route(probs, k)
    keep = capacity_keep(gates.flatten(), idx.flatten(),
                         torch.arange(N).repeat_interleave(k), E, cap).view(N, k)
    ref = torch.zeros_like(flat)
    for t in range(N):
        for j in range(k):
            if keep[t, j]:
                ref[t] += gates[t, j].float() * layer.experts[str(int(idx[t, j]))](flat[t])
    torch.testing.assert_close(out.reshape(-1, 16), ref, rtol=1e-5, atol=1e-6)


def test_shared_experts_and_dropless_sum():
    cfg = GPTConfig(d_model=16, n_heads=1, n_experts=3, topk=2, shared_experts=2)
    layer = MoE(cfg, MLP)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3))
    flat = x.reshape(-1, 16)
    idx, gates = route((flat @ layer.router.weight.t()).softmax(-1), 2)
    ref = layer.shared["0"](flat) + layer.shared["1"](flat)
    for t in range(8):
        for j in range(2):
            ref[t] += gates[t, j] * layer.experts[str(int(idx[t, j]))](flat[t])
    torch.testing.assert_close(layer(x).reshape(-1, 16), ref, rtol=1e-5, atol=1e-6)
    assert layer.take_stats()["dropped"] == 0


def test_bias_mode_selects_with_bias_and_update_moves_it():
    layer = one_hot_layer(E=4, k=1, balance="bias", bias_rate=0.1)
    with torch.no_grad():
        layer.router.weight.fill_(0.0)  # uniform probs: the bias alone decides
        layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.5, 0.0]))
    x = torch.randn(1, 6, 4)
    layer(x)
    assert layer.take_stats()["counts"].tolist() == [0, 0, 6, 0]
    layer.update_bias(torch.tensor([0, 0, 6, 2]))
    # mean 2: expert 3 stays where it was
    torch.testing.assert_close(layer.expert_bias, torch.tensor([0.1, 0.1, 0.4, 0.0]))


def test_moe_gpt_trains_a_step():
    cfg = GPTConfig(n_layers=2, n_experts=4, topk=2, shared_experts=1, capacity_factor=1.25,
                    z_loss_coef=1e-3)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen(0))
    _, loss = model(idx, idx)
    loss.backward()
    assert model.blocks[1].mlp.router.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.parameters())


def test_apply_ep_keeps_serial_names_and_refuses_uneven_splits():
    cfg = GPTConfig(n_layers=2, n_experts=4, moe_every=2)
    model = apply_ep(GPT(cfg), None, 1, 2)  # the group is used only in forward
    names = expert_param_names(model)
    assert "blocks.0.mlp.experts.2.fc.weight" in names and len(names) == 2 * 4
    assert not any("experts.0" in n or "experts.1" in n for n, _ in model.named_parameters())
    assert "blocks.0.mlp.router.weight" not in names
    with pytest.raises(ValueError, match="4 experts do not split evenly over ep=3"):
        apply_ep(GPT(cfg), None, 0, 3)


# ---------------------------------------------------------------------- 4 ranks, one launch
@pytest.fixture(scope="module")
def ranks():
    run = launch(moe_checks, 4, layout=Layout(dp=4), timeout=120, name="moe", echo=False)
    return [run.results[r] for r in range(4)]


def test_dispatch_then_combine_is_exact(ranks):
    for res in ranks:
        for key in ("identity2", "identity4"):
            assert res[key] == {"exact": True, "grad": True, "rows": True}, key


@pytest.mark.parametrize("case", ["ep2 cap0.0", "ep4 cap0.0", "ep2 cap1.0", "ep4 cap1.0",
                                  "ep4 aux only"])
def test_expert_parallel_equals_serial(ranks, case):
    """Outputs and input gradients per rank; each expert's gradient on its owner equals the
    serial gradient summed over the group's tokens; the router's and shared experts'
    gradients summed over the group equal serial's (so the dense average over D is right)."""
    ep = 4 if case.startswith("ep4") else 2
    for r, res in enumerate(ranks):
        got = res[case]
        for key in ("out", "dx", "experts", "replicated"):
            assert got[key] < 1e-5, (r, key, got[key])
        first = (r % ep) * 8 // ep
        assert got["held"] == [str(e) for e in range(first, first + 8 // ep)]
        assert got["names"][0] == f"mlp.experts.{first}.fc.bias"
        assert got["matrix_row_sum"] == got["kept"]
        assert got["router_grad"] > 0
    if "cap1.0" in case:
        assert any(res[case]["kept"] < 24 for res in ranks)  # something was dropped


@pytest.mark.parametrize("case", ["cp2 cap0.0", "cp2 cap1.0"])
def test_sequence_group_equals_serial(ranks, case):
    """Two ranks holding zigzag halves of the same sequences: outputs, the aux value and
    the dropped count equal serial's; gradients averaged over the two equal serial's."""
    for res in ranks:
        got = res[case]
        assert got["out"] < 1e-5 and got["params"] < 1e-6 and got["dx"] < 1e-6, got
        assert got["aux"] < 1e-12
        assert got["dropped"][0] == got["dropped"][1]
    assert ranks[0]["cp2 cap1.0"]["dropped"][0] > 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_training_step_routes_in_fp32_under_mixed_precision(precision, monkeypatch):
    """Through the Trainer's own autocast (``--precision bf16/fp16``): every MoE forward's
    router probabilities and z-loss are fp32, and the step trains."""
    seen = []
    plain_route = MoE.route

    def spy(self, tokens, sequences):
        r = plain_route(self, tokens, sequences)
        seen.append({r.probs.dtype, r.z.dtype, r.aux.dtype})
        return r

    monkeypatch.setattr(MoE, "route", spy)
    run = Run.of(experts=4, topk=2, layers=2, d_model=32, heads=2, seq=16, vocab=64,
                 global_batch=4, precision=precision, z_loss_coef=1e-3)
    config = model_config(run)
    trainer = Trainer(GPT(config), None, run)
    x, y = SyntheticCorpus(config.vocab_size, config.seq_len).batch(1, 4)
    out = trainer.step(x, y, 1)
    assert len(seen) == 2 and all(s == {torch.float32} for s in seen), seen
    assert math.isfinite(out["loss"]) and out["aux_loss"] > 0.5


@pytest.mark.parametrize("experts, says", [(0, "234,880 parameters"),
                                           (4, "experts top-2")])
def test_a_run_names_its_model_in_one_line(experts, says, capsys):
    """``edu3d train``'s banner on stderr: one line naming the model (a dense model's without
    the MoE fields), never the configuration's repr."""
    train(Run.of(experts=experts, steps=1), out=io.StringIO())
    banner = [line for line in capsys.readouterr().err.splitlines() if "parameters" in line]
    assert len(banner) == 1 and says in banner[0] and "GPTConfig" not in banner[0], banner
    assert ("router" in banner[0]) is False and ("experts" in banner[0]) == bool(experts)
