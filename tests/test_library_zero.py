"""``Zero`` as a library (issue 29): any model, any torch optimizer, any zero_grad placement.

* the unit policy cuts any ``nn.Module`` by its child modules: a head called ``out``, an
  ``lm_head`` without ``ln_f``, parameters on the root, mixed dtypes (one unit per dtype),
  every trainable parameter in exactly one unit; edu3d's GPT keeps its units;
* in one 2-rank launch, the plain loop ``zero.zero_grad(); loss = model(x); loss.backward();
  zero.finish(); zero.step()`` equals the same torch optimizer on one process (AdamW betas
  (0.9, 0.999) and SGD with momentum, two param groups with their own lr and weight decay)
  at stages 1, 2 and 3, and so do ``model.zero_grad()`` and ``zero.zero_grad()`` before
  forward or after the step, either ``set_to_none``;
* a parameter no rank uses is left alone, as torch's AdamW leaves a ``None`` gradient (with
  ``find_unused_parameters=True``; without it, an error that names the flag); one used by
  one rank only steps with that rank's gradient;
* ZeRO-3's parameters outside forward are empty tensors (no crash on ``norm``, ``repr``,
  ``clone``), ``model.state_dict()`` gathers full tensors, and ``torch.save`` of it loads
  into a plain model.
"""

import functools

import pytest
import torch.nn as nn

from edu3d.launch import launch
from edu3d.model.gpt import GPT, GPTConfig
from edu3d.parallel.zero.flat_unit import FlatUnit
from edu3d.parallel.zero.units import check_cover, model_units
from tests.workers_library_zero import LibModel, library_worker

TOL = 1e-12  # measured 0: with 2 ranks (g0 + g1) / 2 is exactly the mean over the batch


class OutHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.out = nn.Linear(4, 10)


class NoLnF(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.lm_head = nn.Linear(4, 10)


def names(units):
    return [n for n, _, _ in units]


def test_unit_policy_covers_any_model():
    m = OutHead()
    assert names(model_units(m)) == ["embed", "block0", "block1", "head"]
    assert model_units(m)[-1][2] == [m.out.weight, m.out.bias]  # `out` is optimised
    assert names(model_units(NoLnF())) == ["embed", "block0", "block1", "head"]
    lib = LibModel()
    units = model_units(lib)
    assert names(units) == ["root", "embed", "block0", "block1", "block2", "head.float32",
                            "head.float64"]
    assert all(len({p.dtype for p in ps}) == 1 for _, _, ps in units)
    assert units[0][1] == [lib] and units[0][2] == [lib.scale]
    seq = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    assert names(model_units(seq)) == ["layer0", "layer2"]
    plain = nn.Linear(3, 3)
    assert names(model_units(plain)) == ["root"]
    frozen = OutHead()
    frozen.tok_emb.weight.requires_grad_(False)
    assert names(model_units(frozen)) == ["block0", "block1", "head"]
    with pytest.raises(ValueError, match="in none"):
        check_cover(m, model_units(m)[1:])
    with pytest.raises(ValueError, match="in two units"):
        check_cover(m, model_units(m) + model_units(m)[:1])
    with pytest.raises(ValueError, match="mixes dtypes"):
        FlatUnit("x", [lib], [lib.scale, lib.out.weight], 2, 0)


def test_gpt_units_unchanged():
    """Chapter 03's picture and the parity tests rely on these units."""
    for tie in (False, True):
        gpt = GPT(GPTConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8, vocab_size=32,
                            tie_weights=tie), seed=0)
        units = model_units(gpt)
        want = ["embed", "block0", "block1", "head"]
        assert names(units) == (["tied"] + want if tie else want)
        head = units[-1]
        assert head[1] == ([gpt.ln_f] if tie else [gpt.ln_f, gpt.lm_head])
        if tie:
            assert units[0][1] == [gpt.tok_emb, gpt.lm_head]
            assert units[1][2] == [gpt.pos_emb.weight]


@functools.lru_cache(maxsize=None)
def run():
    return launch(library_worker, 2, timeout=240, name="library-zero", echo=False).results


def test_plain_loop_equals_one_process_for_every_optimizer_stage_and_zero_grad():
    for rank, res in enumerate(run()):
        checked = {k: v for k, v in res.items() if isinstance(v, float)
                   and not k.endswith(("unused_moved",))}
        assert len(checked) == 3 * (2 + 4 + 1) + 2, sorted(checked)
        print(f"rank {rank}: largest |zero - one process| {max(checked.values()):.2e}")
        assert min(res["reference_moved"].values()) > 1e-3  # the reference does train
        bad = {k: v for k, v in checked.items() if v > TOL}
        assert not bad, bad


def test_unused_parameter_left_alone_or_named():
    for res in run():
        for stage in (1, 2, 3):
            assert res[f"zero{stage}/unused_moved"] == 0.0  # no decay, no moments
            msg = res[f"zero{stage}/unused_error"]
            assert "extra.weight" in msg and "find_unused_parameters=True" in msg, msg


def test_zero3_parameters_safe_outside_forward_and_state_dict_full():
    for res in run():
        freed = res["zero3/freed"]
        assert freed["touched"] == {"shape": (0,), "norm": 0.0, "repr": freed["touched"]["repr"],
                                    "clone": (0,)}
        assert freed["still_freed"] == (0,)  # state_dict() freed what it gathered
        assert freed["vs_full_tensors"] == 0.0
        assert freed["saved_vs_reference"] < TOL
        assert freed["loss_again"] == freed["loss_again"]  # a finite forward after it
