"""The planner (``edu3d plan``) against published figures and against edu3d's own runs.

* real models: parameter counts within 1% of the published ones;
* the ZeRO paper's worked example and Korthikanti et al.'s activation formulas and numbers;
* every layout of the 3D parity matrix (tests/test_3d_parity.py), plus recomputation: the
  planner's per-rank weights, gradients and optimizer state equal what the run holds after
  a step, byte for byte (ZeRO's padding and AdamW's per-tensor step counters included), and
  its activation peak per pipeline rank is within ACT_TOL of the engine's measured peak (the
  engine also counts a few scalars the planner leaves out). Ratios printed with ``-s``.
"""

from __future__ import annotations

import functools
import json

import pytest

from edu3d.distributed import meter
from edu3d.plan import formulas as memory, estimate as plan_memory
from edu3d.plan import zero_modes
from edu3d.commands import plan as planner
from edu3d.model import shapes
from edu3d.course.ch07_memory_plan import measure_many, options
from edu3d.launch import launch
from edu3d.schedules.actions import build, chunks
from edu3d.schedules.simulate import simulate
from tests.test_3d_parity import LAYOUTS, _layout

ACT_TOL = 1e-3
EXTRA = {  # recomputation composes with the layouts; the planner models each mode
    "dp2-tp2 sp recompute full": "--dp 2 --tp 2 --sp --recompute full",
    "dp2 pp2 recompute selective m4": "--dp 2 --pp 2 --recompute selective --microbatches 4",
    "tp2 pp2 recompute full gpipe": "--tp 2 --pp 2 --recompute full --schedule gpipe "
                                    "--microbatches 4",
}
CASES = {**LAYOUTS, **EXTRA}


def test_real_models_have_their_published_parameter_counts():
    for name, published in shapes.PUBLISHED_PARAMS.items():
        count = shapes.spec_from(name).num_params()
        assert abs(count / published - 1) < 0.01, (name, count, published)


def test_course_models_count_like_the_model():
    from edu3d.model.gpt import config_from
    from edu3d.model.shapes import num_params_from_config

    for name in shapes.COURSE_PRESETS:
        for tie in (False, True):
            spec = shapes.spec_from(name, tied=tie)
            assert spec.num_params() == num_params_from_config(config_from(name, tie=tie))


def test_zero_paper_worked_example():
    """Rajbhandari et al. 2019, figure 1: Ψ = 7.5B, N_d = 64, K = 12."""
    psi, mp = 7.5e9, dict(param_bytes=2, grad_bytes=2, optimizer_bytes=12)
    got = [round(memory.zero_bytes(psi, 64, s, **mp)["total"] / 1e9, 1) for s in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_planner_state_is_the_zero_formula_for_a_real_model():
    spec = shapes.spec_from("llama2-7b")
    psi = spec.num_params()
    for zero in range(4):
        st = plan_memory.setup(dp=8, zero=zero, precision="bf16", microbatches=1)
        got = plan_memory.state_per_rank(spec, st, 0, at="rest")
        want = memory.zero_bytes(psi, 8, zero, 2, 2, 12)
        for cat in ("params", "grads", "optimizer"):
            assert abs(got[cat] - want[cat]) <= 8 * 8 * 100, (zero, cat)  # padding, step counters


def test_korthikanti_formulas_and_their_numbers():
    f = memory.activation_bytes_per_layer
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B, tensor parallel 8
    sbh = s * b * h
    assert f(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert f(s, b, h, a, t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert f(s, b, h, a, t, sp=True) == sbh / t * (34 + 5 * a * s / h)
    assert f(s, b, h, a, t, sp=True, recompute="selective") == sbh / t * 34
    assert f(s, b, h, a, t, recompute="selective") == sbh * (10 + 24 / t)
    assert f(s, b, h, a, t, sp=True, recompute="full") == 2 * sbh / t
    assert f(s, b, h, a, recompute="full") == 2 * sbh
    # "5as/h = 80 for GPT-3 175B, 64 for MT-NLG 530B": the attention core outweighs the 34
    assert 5 * a * s / h == 80 and 5 * 128 * 2048 / 20480 == 64
    # SP + selective recomputation cut activations about 5x against TP alone (their claim)
    for a_, h_ in ((96, 12288), (128, 20480)):
        ratio = f(s, b, h_, a_, t) / f(s, b, h_, a_, t, sp=True, recompute="selective")
        assert 4.5 < ratio < 5.6, ratio
    # SwiGLU with d_ff = 4h and full KV heads: only the MLP term changes (8sbf, not 4sbf)
    assert f(s, b, h, a, mlp="swiglu") - f(s, b, h, a) == 4 * s * b * 4 * h


def test_in_flight_replays_few_microbatches_but_equals_the_full_replay():
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"):
        for pp in (2, 4):
            for m in (pp, 3 * pp, 5 * pp)[name == "dualpipev":]:  # dualpipev: m >= 2p
                v = chunks(name, 2)
                full = simulate(build(name, pp, m, v), pp).peak_in_flight
                assert list(plan_memory.in_flight(name, pp, m, 2)) == full, (name, pp, m)


def test_pipeline_stages_differ_as_the_schedules_say():
    spec = shapes.spec_from("llama2-7b")
    common = dict(pp=4, tp=2, sp=True, microbatches=16, precision="bf16")
    one = plan_memory.estimate(spec, plan_memory.setup(schedule="1f1b", **common))
    gpipe = plan_memory.estimate(spec, plan_memory.setup(schedule="gpipe", **common))
    layer = plan_memory.stage_activation_bytes(
        spec, plan_memory.setup(schedule="1f1b", **common))[1]
    acts = [row["activations"] for row in one["per_stage"]]
    assert acts[1] == 3 * layer and acts[2] == 2 * layer  # 1F1B: rank r holds p - r
    assert gpipe["per_stage"][1]["activations"] == 16 * layer  # GPipe: all m
    params = [row["params"] for row in one["per_stage"]]
    assert params[0] > params[1] == params[2] < params[3]  # embedding first, head last
    assert one["fullest_pp_rank"] == 0 and one["total_bytes"] == one["per_stage"][0]["total"]


def test_plan_json_and_exit_codes(capsys):
    assert planner.plan_main(["--model", "llama2-7b", "--tp", "2", "--pp", "2", "--dp", "2",
                              "--zero", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                "total_bytes"):
        assert out[key] > 0
    assert len(out["per_stage"]) == 2 and out["fits"] is None
    assert planner.plan_main(["--model", "llama2-7b", "--gpu-mem", "80"]) == 1  # 108 GB of state
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert planner.plan_main(["--model", "tiny", "--tp", "3"]) == 2
    assert "tp=3 must divide n_heads=4" in capsys.readouterr().err
    assert planner.plan_main(["--model", "tiny", "--gpus", "8", "--dp", "2"]) == 2


def test_llama2_70b_on_64_gpus_gets_a_layout_a_practitioner_accepts(capsys):
    assert planner.plan_main(["--model", "llama2-70b", "--gpus", "64", "--gpu-mem", "80",
                              "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rec = out["recommended"]
    assert rec["dp"] * rec["tp"] * rec["pp"] == 64
    assert rec["tp"] <= 8 and rec["pp"] > 1  # TP inside a node, PP for depth
    assert rec["zero"] == 1 and rec["recompute"] == "selective"
    assert out["fits"] and out["total_bytes"] <= 0.9 * 80e9
    assert len(rec["reasons"]) >= 5 and "cost_model" in out


# ---- against measurement ------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _measured(world: int) -> dict[str, list[dict]]:
    """Every case of ``world`` ranks in one launch: per rank, what it held after one step."""
    names = [n for n in CASES if _layout(CASES[n].split()).world_size == world]
    first = _layout(CASES[names[0]].split())
    run = launch(measure_many, world, args=([CASES[n].split() for n in names],),
                 layout=first, timeout=300, name="plan-vs-run", echo=False)
    return {n: [run.results[r][i] for r in range(world)] for i, n in enumerate(names)}


@pytest.mark.parametrize("world", [2, 4, 8])
def test_planner_equals_measurement(world):
    for name, ranks in _measured(world).items():
        st = options(CASES[name].split())
        spec = plan_memory.spec_of(st)
        acts = plan_memory.activations_per_rank(spec, st)
        ratios = {}
        for res in ranks:
            pp, dp, _ = res["coord"]
            want = plan_memory.state_per_rank(spec, st, pp, dp, at="rest")
            for cat in ("params", "grads", "optimizer"):
                assert res["bytes"][cat] == want[cat], (name, res["coord"], cat)
            ratio = acts[pp] / res["bytes"]["activations"]
            assert abs(ratio - 1) < ACT_TOL, (name, res["coord"], ratio)
            ratios[pp] = ratio
        # edu3d train's record is the fullest rank's: the planner's fullest, at rest; where
        # ZeRO-2/3 reduce once per step, the full gradients (and ZeRO-3's gathered weights)
        # held between the micro-batches: the planner's peak
        fullest = max(ranks, key=lambda r: sum(r["bytes"].values()))
        want = dict(fullest["bytes"])
        if zero_modes.holds_step(st.parallel.zero, st.parallel.grad_reduce, st.microbatches):
            peak = max((plan_memory.state_per_rank(spec, st, r["coord"][0], r["coord"][1],
                                                   at="peak") for r in ranks),
                       key=lambda d: sum(d.values()))
            want.update({c: peak[c] for c in ("params", "grads", "optimizer")})
        assert ranks[0]["mem_bytes"] == {**want, "total": sum(want.values())}, name
        print(f"\n{name}: state exact; activations planner/measured per pp rank "
              + " ".join(f"{r}:{v:.5f}" for r, v in sorted(ratios.items())))


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_planner_equals_measurement_under_autocast_on_cuda():
    """edu3d's bf16 recipe (autocast over fp32 state) on a GPU: the state byte for byte, the
    saved activations within 0.1% for each recomputation mode; the allocator's peak is
    printed beside the planner's total (it adds the loss's backward buffers)."""
    import torch

    from edu3d.train.data import SyntheticCorpus
    from edu3d.model.gpt import GPT
    from edu3d.config.sections import Run
    from edu3d.train.preflight import model_config
    from edu3d.train.trainer import Trainer

    for recompute in ("none", "selective", "full"):
        args = Run.of(model="small", precision="bf16", global_batch=4, microbatches=1,
                        recompute=recompute)
        config = model_config(args)
        trainer = Trainer(GPT(config, seed=0).cuda(), None, args)
        x, y = (t.cuda() for t in SyntheticCorpus(config.vocab_size, config.seq_len,
                                                  seed=0).batch(1, 4))
        trainer.step(x, y, 1)
        torch.cuda.reset_peak_memory_stats()
        trainer.step(x, y, 2)
        spec, st = plan_memory.spec_of(args), args
        est = plan_memory.estimate(spec, st, at="rest")
        held = meter.measure(trainer.tensors())
        for cat in ("params", "grads", "optimizer"):
            assert held[cat] == est[f"{cat}_bytes"], (recompute, cat)
        ratio = est["activations_bytes"] / trainer.engine.peak_activation_bytes
        assert abs(ratio - 1) < ACT_TOL, (recompute, ratio)
        print(f"\n{recompute}: activations planner/measured {ratio:.5f}; total planner/"
              f"max_memory_allocated {est['total_bytes'] / torch.cuda.max_memory_allocated():.3f}")
        del trainer


def test_widget_draws_stages_verdict_and_measured_beside_the_estimate():
    from edu3d.widgets.memory_plan import stage_bars, zero_stages
    from edu3d.widgets.panels.ch07_memory import controls

    ctl = controls(dict(model="llama2-7b", dp=1, pp=1, precision="bf16", microbatches=8,
                        micro_batch=1, gpu_mem_gb=80))
    title = ctl.figure.layout.title.text
    assert "does NOT fit in 80 GB" in title and ctl.valid
    assert ctl.figure.layout.yaxis.title.text == "memory (GB)"
    assert ctl.allowed("tp") == [1, 2, 4, 8] and ctl.allowed("pp")[-1] == 16
    ctl.redraw(tp=3)  # never offered; a value the model cannot take becomes one it can
    assert ctl.valid and ctl.state["tp"] == 2
    ctl.redraw(model="tiny", tp=2, dp=2, pp=2, zero=1, precision="fp32", microbatches=2,
               micro_batch=2, gpu_mem_gb=0.01)
    assert ctl.valid and "fits in 10 MB" in ctl.figure.layout.title.text  # not "0.01 GB"
    assert ctl.argv() == ["--model", "tiny", "--dp", "2", "--tp", "2", "--pp", "2", "--zero",
                          "1", "--microbatches", "2", "--global-batch", "8", "--schedule",
                          "1f1b", "--recompute", "none"]
    rows = {r["pp_rank"]: r for r in ctl.estimate["per_stage"]}
    both = stage_bars(ctl.estimate, rows)
    groups = {t.offsetgroup for t in both.data}
    assert groups == {"estimate", "measured"}
    assert all(t.marker.pattern.shape == "/" for t in both.data if t.offsetgroup == "estimate")
    assert not any(t.marker.pattern.shape for t in both.data if t.offsetgroup == "measured")
    alone = stage_bars(ctl.estimate)  # an estimate without a run is still theory
    assert alone.data and all(t.marker.pattern.shape == "/" and "(estimate)" in t.name
                              for t in alone.data)
    zs = zero_stages(7.5e9, 64)
    assert [round(sum(t.y[i] for t in zs.data), 1) for i in range(4)] == [120.0, 31.4, 16.6, 1.9]


def test_params_gives_a_gpt3_shaped_model_that_splits_eight_ways():
    for n in (1.3e9, 7e9, 70e9, 175e9):
        spec = shapes.spec_for_params(n)
        assert abs(spec.num_params() / n - 1) < 0.02 and spec.n_heads % 8 == 0, n
    assert shapes.spec_for_params(175e9).n_layers == 96  # GPT-3's own shape
