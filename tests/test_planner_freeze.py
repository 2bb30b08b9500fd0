"""The planner counts ``--freeze``: a frozen run holds, on every rank and to the byte, what
``estimate`` / ``state_per_rank`` say (frozen weights whole on every rank, in no ZeRO unit;
no gradient, no optimizer state), and ``edu3d plan --freeze`` prints it.

One launch of 2 ranks measures every case (dp2 under ZeRO 0-3, tp2, pp2) with the chapter-07
helper (:func:`edu3d.course.ch07_memory_plan.measure_many`): each rank's bytes after one
AdamW step, and ``Trainer.stats()["mem_bytes"]`` (the fullest rank's peak); then records
chapter 07's memory timeline of a frozen ZeRO-1 step (``--memory-timeline``'s document),
whose planner line must be the frozen run's.
"""

from __future__ import annotations

import functools
import json

import pytest

from edu3d.commands.plan import plan_main
from edu3d.course import ch07_memory_timeline as timeline
from edu3d.course.ch07_memory_plan import measure_many, options
from edu3d.config.layout import Layout
from edu3d.launch import launch
from edu3d.model.shapes import spec_from
from edu3d.plan import estimate as plan_memory
from edu3d.plan.inventory import serial_names
from tests.workers_freeze import BAD_FREEZE

FREEZE = ["--freeze", "tok_emb.*,blocks.0.*"]
SMALL = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--vocab", "64",
         "--global-batch", "4"]
CASES = {f"dp2 zero{z}": ["--dp", "2", "--zero", str(z)] for z in range(4)}
CASES.update({"dp2 zero2 m2 per-step": ["--dp", "2", "--zero", "2", "--microbatches", "2",
                                        "--grad-reduce", "per-step"],
              "tp2 sp": ["--tp", "2", "--sp"], "pp2": ["--pp", "2", "--microbatches", "2"]})
STATE = ("params", "grads", "optimizer")


def _argv(name: str, frozen: bool = True) -> list[str]:
    return SMALL + CASES[name] + (FREEZE if frozen else [])


TIMELINE = timeline.argv_of({"zero": 1, "microbatches": 1, "recompute": "none"}) + FREEZE


def measure_and_record(mesh, argvs: list[list[str]], timeline_argv: list[str]) -> tuple:
    """Launch target: every case measured, then one memory timeline recorded."""
    return measure_many(mesh, argvs), timeline.record(mesh, timeline_argv)


@functools.lru_cache(maxsize=None)
def _launched() -> list:
    return launch(measure_and_record, 2, args=([_argv(n) for n in CASES], TIMELINE),
                  layout=Layout(dp=2), timeout=300, name="plan-freeze", echo=False).results


def _measured() -> dict[str, list[dict]]:
    res = _launched()
    return {n: [res[r][0][i] for r in range(2)] for i, n in enumerate(CASES)}


@pytest.mark.parametrize("name", list(CASES))
def test_a_frozen_runs_bytes_equal_the_planners(name):
    ranks = _measured()[name]
    args = options(_argv(name))
    spec, st = plan_memory.spec_of(args), args
    assert st.memory.freeze == ("tok_emb.*", "blocks.0.*")
    for res in ranks:  # every rank after the step: the planner's rank at rest
        pp, dp, _ = res["coord"]
        want = plan_memory.state_per_rank(spec, st, pp, dp, at="rest")
        got = {c: res["bytes"][c] for c in STATE}
        print(f"\n{name} rank {res['coord']}: measured {got} planned {want}")
        assert got == want, (name, res["coord"])
    # edu3d train's record (the fullest rank's peak) is estimate_for's fullest pipeline rank
    est = plan_memory.estimate_for(args, at="peak")
    got = ranks[0]["mem_bytes"]
    assert sum(got[c] for c in STATE) == est["state_bytes"], name
    assert {c: got[c] for c in STATE} == {c: est[f"{c}_bytes"] for c in STATE}, name
    # and the planner without --freeze would have said more gradients and optimizer state
    unfrozen = plan_memory.estimate_for(options(_argv(name, frozen=False)), at="peak")
    assert est["grads_bytes"] < unfrozen["grads_bytes"]
    assert est["optimizer_bytes"] < unfrozen["optimizer_bytes"]


def test_the_memory_timelines_planner_line_is_the_frozen_runs():
    """``edu3d train --memory-timeline --freeze``: the document records the globs, and the
    planner's state it carries (drawn beside the timeline) is what the step held."""
    doc = _launched()[0][1]
    assert doc["options"]["freeze"] == "tok_emb.*,blocks.0.*"
    planned = timeline.planned_peak(doc)
    assert {c: planned[c] for c in STATE} == {c: doc["stats"][c] for c in STATE}
    unfrozen = plan_memory.estimate_for(options(TIMELINE[:-2]))["per_stage"][0]
    assert planned["grads"] < unfrozen["grads"] and planned["total"] < unfrozen["total"]


def test_the_planners_names_are_the_serial_models():
    """The torch-free names the planner matches globs against are ``named_parameters``'."""
    from edu3d.model.gpt import GPTConfig
    from edu3d.model.shapes import spec_from_config
    from edu3d.parallel.freeze import param_names
    from edu3d.plan.formulas import MoESpec
    import dataclasses

    for tied in (False, True):
        config = GPTConfig(vocab_size=64, n_layers=3, n_heads=2, d_model=16, seq_len=8,
                           tie_weights=tied, n_experts=4, shared_experts=1, moe_every=2)
        spec = MoESpec(**dataclasses.asdict(spec_from_config(config)), experts=4,
                       shared_experts=1, moe_every=2)
        assert list(serial_names(spec)) == param_names(config)
        dense = dataclasses.replace(config, n_experts=0, shared_experts=0)
        assert list(serial_names(spec_from_config(dense))) == param_names(dense)


def test_freezing_takes_a_ranks_gradients_and_optimizer_state_exactly():
    """Closed form, tiny model, dp=1, fp32 AdamW: the frozen ``tok_emb`` (256 x 64) and
    block 0 (``12h² + 13h`` = 49,984 elements) keep their 4 weight bytes each and lose 4
    gradient and 8 optimizer bytes each, and AdamW's 4-byte step counter per tensor (1 + 12)."""
    spec = spec_from("tiny")
    frozen_elements = 256 * 64 + 12 * 64 ** 2 + 13 * 64
    base = plan_memory.estimate(spec, plan_memory.setup(), at="rest")
    cold = plan_memory.estimate(spec, plan_memory.setup(freeze=("tok_emb.*", "blocks.0.*")),
                                at="rest")
    assert cold["params_bytes"] == base["params_bytes"]
    assert base["grads_bytes"] - cold["grads_bytes"] == 4 * frozen_elements
    assert base["optimizer_bytes"] - cold["optimizer_bytes"] == 8 * frozen_elements + 4 * 13
    # ZeRO-3 shards the trainable weights only: the frozen ones stay whole on both ranks
    z3 = plan_memory.setup(dp=2, zero=3, freeze=("tok_emb.*", "blocks.0.*"))
    assert plan_memory.state_per_rank(spec, z3, 0, 1, at="rest")["params"] >= 4 * frozen_elements


def _plan(argv, capsys) -> tuple[int, str, str]:
    code = plan_main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_edu3d_plan_freeze_prints_fewer_gradient_and_optimizer_bytes(capsys):
    base = ["--model", "tiny", "--dp", "2", "--zero", "1", "--json"]
    code, out, _ = _plan(base, capsys)
    before = json.loads(out)
    code2, out, _ = _plan(base + ["--freeze", "tok_emb.*,blocks.0.*"], capsys)
    after = json.loads(out)
    assert code == code2 == 0
    assert after["setup"]["freeze"] == ["tok_emb.*", "blocks.0.*"]
    frozen_elements = 256 * 64 + 12 * 64 ** 2 + 13 * 64  # 66,368
    assert after["params_bytes"] == before["params_bytes"] == 4 * spec_from("tiny").num_params()
    assert before["grads_bytes"] - after["grads_bytes"] == 4 * frozen_elements
    # ZeRO-1: the optimizer state is sharded over 2 ranks (each unit padded to a multiple of 2)
    assert after["grads_bytes"] == 4 * (spec_from("tiny").num_params() - frozen_elements)
    assert after["optimizer_bytes"] == plan_memory.state_per_rank(
        spec_from("tiny"), plan_memory.setup(dp=2, zero=1, freeze=("tok_emb.*", "blocks.0.*")),
        0, 0)["optimizer"] < before["optimizer_bytes"]
    # the text table says it too
    code, text, _ = _plan(base[:-1] + ["--freeze", "tok_emb.*,blocks.0.*"], capsys)
    assert code == 0 and "frozen" in text and "66,368 of 234,880 parameters" in text
    # sizes and counts in the unit their size calls for (never "0.002 GB", "0.000 B")
    assert "tiny: 234,880 parameters" in text and "(the ZeRO paper's count): 2.288 MB" in text


@pytest.mark.parametrize("argv,message", BAD_FREEZE)
def test_a_bad_freeze_is_refused_in_one_line(argv, message, capsys, monkeypatch):
    from edu3d import cli
    from edu3d.commands import plan

    monkeypatch.setattr(plan, "estimate", lambda *a, **k: pytest.fail("estimated"))
    monkeypatch.setattr(plan.plan_search, "search", lambda *a, **k: pytest.fail("searched"))
    try:
        code = cli.main(["plan", "--model", "tiny", "--dp", "2", *argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, err


def test_the_search_weighs_layouts_with_frozen_parameters(capsys):
    code, out, _ = _plan(["--model", "gpt2", "--gpus", "8", "--gpu-mem", "80", "--json",
                          "--freeze", "blocks.[0-5].*"], capsys)
    frozen = json.loads(out)
    code2, out, _ = _plan(["--model", "gpt2", "--gpus", "8", "--gpu-mem", "80", "--json"],
                          capsys)
    assert code == code2 == 0
    assert frozen["recommended"]["freeze"] == ["blocks.[0-5].*"]
    assert all(c["freeze"] == ["blocks.[0-5].*"] for c in frozen["candidates"])
    assert frozen["state_bytes"] < json.loads(out)["state_bytes"]


def test_the_cost_model_counts_no_weight_gradient_flops_for_frozen_blocks():
    """6N FLOPs per token is 2N forward, 2N input gradients, 2N weight gradients: a frozen
    block tensor drops its 2 (the embeddings are not in N); a routed expert weighs k/E. The
    performance model skips the weight-gradient kernels of a frozen block, and only them."""
    import dataclasses

    from edu3d.plan.formulas import as_moe
    from edu3d.plan.inventory import frozen_active
    from edu3d.plan.step import predict

    spec = spec_from("tiny")
    block0 = sum(k for _, k, _ in as_moe(spec).block_tensors(0))
    assert frozen_active(spec, ("tok_emb.*", "blocks.0.*")) == block0 == 49_984
    assert frozen_active(spec, ("tok_emb.*",)) == 0
    free, cold = (predict(spec, plan_memory.setup(dp=2, freeze=f), "h100-sxm").stages[0]
                  for f in ((), ("tok_emb.*", "blocks.0.*")))
    assert cold["F"] == free["F"] and cold["I"] == free["I"] and cold["W"] < free["W"]
    moe = dataclasses.replace(as_moe(spec), experts=4, topk=2)
    routed = moe.layer_params(active=True) - moe.layer_params()  # the k experts a token uses
    assert frozen_active(moe, ("blocks.*.mlp.experts.*",)) == routed
