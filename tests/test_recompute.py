"""Activation recomputation changes memory and time, never the numbers.

Serially, and in one launch of 8 ranks (dp2-tp2-pp2: TP with and without SP, 1F1B,
interleaved and ZB-H1, ZeRO-1 and ZeRO-3; then dp4-tp2 ZeRO-3 on the same ranks): the
gradients of one plain-SGD step and the losses and norms of 2 AdamW steps with
``--recompute selective`` and ``full`` equal the same layout without recomputation. They
come out bitwise equal (the recomputed forward is the same deterministic arithmetic); the
tests allow 1e-6 relative. And the bytes one layer keeps equal
:func:`edu3d.plan.formulas.layer_activation_bytes` exactly, at tp 1, 2, 4 with and
without SP, the trainer's measured activations included.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from edu3d.course.ch07_memory import measure_layer
from edu3d.launch import launch
from edu3d.plan.formulas import activation_bytes_per_layer, layer_activation_bytes
from edu3d.config.layout import Layout
from edu3d.model.gpt import GPT, config_from
from edu3d.parallel.recompute import apply_recompute, recompute_mode
from tests.workers_recompute import all_checks, compare, serial_adamw

TOL = 1e-6


def _check(name: str, res: dict, serial_tol: float | None = 1e-5) -> None:
    for mode in ("selective", "full"):
        r = res[mode]
        print(f"\n{name} {mode}: grad {r['grad_err']:.1e} (bitwise {r['grad_exact']}) "
              f"loss {r['loss_err']:.1e} norm {r['norm_err']:.1e}")
        assert r["grad_err"] <= TOL and r["loss_err"] <= TOL and r["norm_err"] <= TOL, name
    if serial_tol is not None:  # and the layout itself equals the serial model
        assert res["serial_grad_err"] < serial_tol, name
    assert res["losses"][-1] < res["losses"][0]  # it trains
    act = res["activations"]
    assert act["full"] < act["selective"] < act["none"], (name, act)


def test_apply_recompute_keeps_parameters_refuses_twice_and_copies():
    model = GPT(config_from("tiny", layers=2))
    names = [n for n, _ in model.named_parameters()]
    assert recompute_mode(model) == "none"
    apply_recompute(model, "full")
    assert recompute_mode(model) == "full"
    assert [n for n, _ in model.named_parameters()] == names
    with pytest.raises(ValueError, match="already recomputes"):
        apply_recompute(model, "selective")
    with pytest.raises(ValueError, match="none, selective, full"):
        apply_recompute(GPT(config_from("tiny", layers=2)), "partial")
    with torch.no_grad():  # no graph: the plain forward runs (generation)
        assert model(torch.zeros(1, 4, dtype=torch.long))[0].shape == (1, 4, 256)
    twin = copy.deepcopy(model)  # a copy recomputes its own blocks, not the original's
    assert recompute_mode(twin) == "full"
    assert twin.blocks[0].forward.args[0].__self__ is twin.blocks[0]


@pytest.mark.parametrize("argv", [[], ["--microbatches", "2", "--precision", "bf16"]],
                         ids=["fp32", "bf16 m2"])
def test_serial_trainer_equal_with_recompute(argv):
    """One process: SGD gradients and 2 AdamW steps; bf16 autocast (the recomputed forward
    runs under the forward's autocast) and accumulation over 2 micro-batches. The trainer's
    measured activations differ from none's by exactly the formula's bytes per layer."""
    res = compare(None, argv)
    _check("serial " + " ".join(argv), res, None if argv else 1e-5)
    if not argv:  # fp32: exact bytes (4 layers, batch 8, one micro-batch in flight)
        c = config_from("tiny")
        per = {m: layer_activation_bytes(c.seq_len, 8, c.d_model, c.n_heads, mode=m)
               for m in ("none", "selective", "full")}
        act = res["activations"]
        for mode in ("selective", "full"):
            assert act["none"] - act[mode] == c.n_layers * (per["none"] - per[mode])


def test_serial_model_adamw_equal():
    """The serial reference model itself, recomputing, takes the same AdamW steps."""
    ref = serial_adamw([], "none")
    for mode in ("selective", "full"):
        ours = serial_adamw([], mode)
        assert [r["loss"] for r in ours] == [r["loss"] for r in ref]
        assert [r["grad_norm"] for r in ours] == [r["grad_norm"] for r in ref]


def test_layer_bytes_serial_and_paper_ratio():
    """tp 1: measured == formula for every mode and two shapes; fp32 and no dropout against
    the paper's 16-bit count: full recomputation keeps exactly 2x Korthikanti's bytes. The
    planner's torch-free count (:mod:`edu3d.plan.formulas`) is the same formula."""
    for c, b in ((config_from("tiny"), 2), (config_from("tiny", seq=16, heads=8), 3)):
        s, h, a = c.seq_len, c.d_model, c.n_heads
        for mode in ("none", "selective", "full"):
            assert measure_layer(c, b, mode=mode) == layer_activation_bytes(s, b, h, a,
                                                                            mode=mode)
        assert layer_activation_bytes(s, b, h, a, mode="full") == \
            2 * activation_bytes_per_layer(s, b, h, a, recompute="full")


LAYOUTS_3D = {  # on the dp2-tp2-pp2 mesh of 8 ranks
    "dp2-tp2-pp2 1f1b": "--dp 2 --tp 2 --pp 2 --microbatches 2 --layers 2",
    "dp2-tp2 sp-pp2 interleaved zero3": "--dp 2 --tp 2 --sp --pp 2 --vpp 2 --schedule "
                                        "interleaved --microbatches 2 --zero 3",
    "dp2-tp2-pp2 zb-h1 zero1": "--dp 2 --tp 2 --pp 2 --schedule zb-h1 --microbatches 2 "
                               "--zero 1 --layers 2",
}
LAYOUTS_DP4 = {  # on a dp4-tp2 mesh of the same ranks
    # the second micro-batch's forward is the last: it frees the units, and the backward's
    # recomputation runs on the parameters gathered again by ZeRO-3's gradient hooks
    "dp4-tp2 sp zero3 m2 prefetch": "--dp 4 --tp 2 --sp --zero 3 --microbatches 2 --prefetch",
}


@functools.lru_cache(maxsize=None)
def _launched() -> list[dict]:
    """Every launched check in one launch of 8 ranks (start-up is the expensive part)."""
    run = launch(all_checks, 8, args=([v.split() for v in LAYOUTS_3D.values()],
                                      [v.split() for v in LAYOUTS_DP4.values()],
                                      config_from("tiny")),
                 layout=Layout(dp=2, tp=2, pp=2), timeout=300, name="recompute")
    return run.results


def test_launched_layouts_equal_with_recompute():
    """dp2-tp2-pp2: TP with and without SP, 1F1B, interleaved and ZB-H1 (its split I/W
    backward recomputes the blocks in each pass), ZeRO-1 and ZeRO-3 under pipelining; and
    dp4-tp2 ZeRO-3 with SP, micro-batches and prefetch. Every rank's result is checked."""
    for rank, res in enumerate(_launched()):
        for name, r in zip(LAYOUTS_3D, res["3d"]):
            _check(f"{name} rank {rank}", r)
        for name, r in zip(LAYOUTS_DP4, res["dp4"]):
            _check(f"{name} rank {rank}", r)


def test_layer_bytes_at_tp_1_2_4_and_repeated_tp_comm():
    """One layer's saved bytes at tp = 1, 2, 4 with and without SP for each mode, on every
    rank: equal to the formula, byte for byte; and the TP collectives a recomputed layer
    repeats in backward, from the trace."""
    for rank, res in enumerate(_launched()):
        rows = res["sweep"]
        assert {(r["tp"], r["sp"]) for r in rows} == {(1, False), (2, False), (2, True),
                                                      (4, False), (4, True)}
        for r in rows:
            assert r["measured"] == r["formula"], (rank, r)
        comm = res["comm"]
        for axis, last in (("tp", "all_reduce"), ("sp", "reduce_scatter")):
            none, full = comm[f"{axis} none"], comm[f"{axis} full"]
            assert comm[f"{axis} selective"] == none  # the attention core talks to no one
            # full: backward repeats the forward's collectives, all but the block's last
            # (torch stops recomputing after the last tensor that has to be saved again)
            repeated = dict(none["forward"], **{last: none["forward"][last] - 1})
            assert full["backward"] == {op: none["backward"].get(op, 0) + n
                                        for op, n in repeated.items()}, (rank, axis, comm)


def test_bench_recompute_agrees_with_torch_checkpointing():
    """``edu3d bench recompute`` (one repetition at tp 2, inside the launch above): its rows
    exist, and each row's bytes per layer are the formula's. The benchmark itself raises
    unless both sides' gradients are bitwise equal (torch's ``checkpoint_wrapper`` and
    selective checkpointing against edu3d's recomputation)."""
    rep = _launched()[0]["bench"]
    c = config_from("tiny")
    assert rep["benchmark"] == "recompute" and rep["world_size"] == 8
    for row, mode in zip(rep["results"], ("none", "selective", "full")):
        assert row["name"] == f"{c.n_layers} blocks {mode}"
        assert row["edu3d_s"] > 0 and row["reference_s"] > 0
        assert row["saved_bytes_per_layer"] == layer_activation_bytes(
            c.seq_len, 2, c.d_model, c.n_heads, t=2, mode=mode)
