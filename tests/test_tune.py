"""``edu3d tune``: the planner's best layouts, measured, and the cost model's rank correlation.

One real tuning of a small model on 2 ranks (one launch) checks the whole road: at least 6
candidates, each with a measured step time, tokens/s and peak memory, a winner, and a
correlation in [-1, 1]. Timings are never asserted against each other: the machine is shared.
"""

from __future__ import annotations

import json
import math

import pytest

from edu3d import cli
from edu3d.bench import autotune, ranking
from edu3d.config.sections import Run
from edu3d.model.shapes import spec_from
from edu3d.plan import search as plan_search
from edu3d.plan.estimate import setup

SMALL = ["--layers", "2", "--d-model", "32", "--seq", "32"]


# ---- Spearman, by hand ------------------------------------------------------------------------
def test_ranks_average_ties():
    assert ranking.ranks([10, 30, 20]) == [1, 3, 2]
    assert ranking.ranks([1, 2, 2, 3]) == [1, 2.5, 2.5, 4]
    assert ranking.ranks([5, 5, 5]) == [2, 2, 2]


def test_spearman_on_known_inputs():
    assert ranking.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert ranking.spearman([1, 2, 3, 4], [9, 7, 5, 1]) == pytest.approx(-1.0)
    # one swap of neighbours among 4: 1 - 6*2/(4*15) = 0.8
    assert ranking.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # ties averaged: ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4) -> 4.5 / sqrt(4.5 * 5)
    assert ranking.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(22.5))
    # monotone, not linear: still 1
    assert ranking.spearman([1, 2, 3], [1, 100, 10_000]) == pytest.approx(1.0)
    assert math.isnan(ranking.spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError):
        ranking.spearman([1, 2], [1, 2, 3])


# ---- the candidates ------------------------------------------------------------------------------
def test_pick_varies_layouts_zero_micro_batches_and_recompute():
    spec = spec_from("tiny", n_layers=2, d_model=32, seq_len=32)
    cluster = autotune.cluster_for(2)
    rows = [r for r in plan_search.search(spec, cluster, 8, "fp32") if r["fits"]]
    picked = autotune.pick(rows, 8)
    setups = [r["setup"] for r in picked]
    assert len(set(setups)) == 8
    assert {autotune.layout_key(st) for st in setups} == {
        autotune.layout_key(r["setup"]) for r in rows}  # every layout of 2 ranks
    assert len({st.parallel.zero for st in setups}) > 1 and len({st.micro_batch for st in setups}) > 1
    assert len({st.memory.recompute for st in setups}) > 1
    times = [r["time"]["total"] for r in picked]
    assert times == sorted(times)  # the planner's order
    assert autotune.pick(rows, 3) == [r for r in picked if r in autotune.pick(rows, 3)]


def test_bucket_sizes_become_candidates_the_model_weighs():
    """Small buckets all-reduce while backward runs (edu3d's bucketed DDP); one 25 MB bucket
    waits for its end: the model predicts the small ones faster."""
    base = Run.of(layers=2, d_model=32, seq=32)
    planned = autotune.plan(base, 2, top=3, steps=2, bucket_mb=(0.01, 25.0))
    dp = [c for c in planned["candidates"] if c["bucket_mb"] is not None]
    assert {c["bucket_mb"] for c in dp} == {0.01, 25.0}
    step = {c["bucket_mb"]: c["predicted_step_s"] for c in dp if c["setup"] == dp[0]["setup"]}
    assert step[0.01] < step[25.0]
    assert all("--bucket-mb 0.01" in c["command"] for c in dp if c["bucket_mb"] == 0.01)


# ---- bad input: one line, exit 2, nothing launched ---------------------------------------------
BAD = [(["--model", "llama2-7b", "--gpus", "2"], "choose one of tiny"),
       (["--model", "nope", "--gpus", "2"], "choose one of tiny"),
       (["--gpus", "0"], "--gpus: 0: must be a positive integer"),
       (["--gpus", "-2"], "--gpus: -2: must be a positive integer"),
       (["--gpus", "100000"], "this machine hosts 1 to"),
       (["--gpus", "2", "--gpu-mem", "0"], "--gpu-mem: 0: must be a finite number > 0"),
       (["--gpus", "2", "--gpu-mem", "-1"], "--gpu-mem: -1: must be a finite number > 0"),
       (["--gpus", "2", "--gpu-mem", "nan"], "--gpu-mem: nan: must be a finite number > 0"),
       (["--gpus", "2", "--gpu-mem", "1e-6"], "no layout of tiny fits 2 rank(s)"),
       (["--gpus", "2", "--steps", "0"], "--steps: 0: must be a positive integer"),
       (["--gpus", "2", "--top", "0"], "--top: 0: must be a positive integer"),
       (["--gpus", "2", "--warmup", "-1"], "--warmup: -1: must be an integer >= 0"),
       (["--gpus", "2", "--bucket-mb", "25,0"], "--bucket-mb: 0: must be a finite number > 0"),
       (["--gpus", "2", "--heads", "5"], "n_heads=5 does not divide")]


@pytest.mark.parametrize("argv,message", BAD, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else None)
def test_bad_input_is_refused_in_one_line_before_any_rank(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(autotune, "launch", lambda *a, **k: pytest.fail("launched"))
    try:
        code = cli.main(["tune", *argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("edu3d tune") and message in err, err


# ---- a real tuning -------------------------------------------------------------------------------
def test_a_real_tuning_measures_every_candidate_and_grades_the_model(capsys):
    """Two ranks, 6 candidates, 1 warm-up and 2 timed steps each, in one launch."""
    code = cli.main(["tune", "--gpus", "2", *SMALL, "--top", "6", "--steps", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    rep = json.loads(out)  # stdout is exactly the report
    assert {"model", "world_size", "device", "candidates", "skipped", "spearman", "winner",
            "misranked", "cluster", "memory_measured"} <= set(rep)
    assert rep["world_size"] == 2 and rep["device"] == "cpu"
    cands = rep["candidates"]
    assert len(cands) >= 6 and len({c["label"] for c in cands}) == len(cands)
    for c in cands:
        m = c["measured"]
        assert m["step_s"] > 0 and m["tokens_per_s"] > 0 and m["peak_bytes"] > 0, c
        assert m["tokens_per_s"] == pytest.approx(8 * 32 / m["step_s"])
        assert m["steps_timed"] == 2 and math.isfinite(m["loss"])
        assert c["predicted_step_s"] > 0 and c["predicted_bytes"] > 0
        assert c["command"].startswith("edu3d train ") and c["setup"]["dp"] * c["setup"][
            "tp"] * c["setup"]["pp"] == 2
        # the tracked tensors are what the planner counts: the same order of size
        assert 0.3 < m["peak_bytes"] / c["predicted_bytes"] < 3, c
    assert len({autotune.layout_key(setup(**c["setup"]))
                for c in cands}) == 3  # dp2, tp2, pp2
    assert -1 <= rep["spearman"] <= 1
    assert rep["winner"] == min(cands, key=lambda c: c["measured"]["step_s"])["label"]
    assert rep["misranked"] in {c["label"] for c in cands}
    for i in range(1, len(cands) + 1):  # progress, one line per candidate, on stderr
        assert f"candidate {i}/{len(cands)}: " in err
    table = ranking.format_table(rep)
    assert "winner: " + rep["winner"] in table and "Spearman rho = " in table
    assert "misranked most: " + rep["misranked"] in table


def test_a_failing_candidate_loses_only_itself():
    """A rank of the second candidate dies: the first keeps its figures, the third runs in a
    second launch."""
    base = Run.of(layers=2, d_model=32, seq=32)
    cands = autotune.plan(base, 2, top=3, steps=1)["candidates"]
    cands[1]["options"]["inject_fault"] = {"rank": 1, "step": 1, "kind": "exit"}
    lines: list[str] = []
    autotune.measure(cands, 2, warmup=0, progress=lines.append, timeout=300)
    assert "measured" in cands[0] and "measured" in cands[2], lines
    assert "measured" not in cands[1] and "rank 1" in cands[1]["error"], lines
    assert any("2/3" in line and "failed" in line for line in lines), lines
    grade = ranking.grade(cands, None)
    assert grade["winner"] in (cands[0]["label"], cands[2]["label"])


# ---- the chapter's chart and control, from a recorded report -------------------------------------
def test_every_knob_position_redraws_the_chart():
    from edu3d.course.ch07_memory_tune import METRICS, describe, points
    from edu3d.widgets.panels.ch07_memory import tune_controls
    from edu3d.widgets.tuning import VIEWS, tune_figure
    from tests.test_charts_grammar import tune_report

    rep = tune_report()
    ctl = tune_controls(rep)
    seen = set()
    for metric in METRICS:
        for view in VIEWS:
            for who in [None, *ctl.labels()]:
                ctl.redraw(metric=metric, view=view, candidate=who)
                fig = ctl.figure
                assert fig is not None and ctl.message, (metric, view, who)
                seen.add(fig.to_json())
                assert (who is None) or who in ctl.message
    assert len(seen) == len(METRICS) * len(VIEWS) * (1 + len(ctl.labels()))  # all differ
    pts = points(rep, "step time")
    assert pts["labels"] == ["dp2 zero1", "dp1 tp2", "dp1 pp2"]  # the failed one is left out
    assert pts["spearman"] == pytest.approx(ranking.spearman([1.6, 1.64, 1.73], [25, 240, 26]))
    assert pts["misranked"] == "dp1 tp2" and pts["winner"] == "dp2 zero1"
    assert "Spearman ρ = +0.50" in tune_figure(pts).layout.title.text
    assert "failed: RankError" in describe(rep, "dp2 zero3")
    assert "rerun alone: edu3d train --dp 2 --zero 0" in describe(rep, "dp2 zero1")
    ctl.redraw(candidate="not a candidate")  # a stale choice after a new tuning: none
    assert ctl.state["candidate"] == ""  # none ("" : a None value shows an empty box)
    with pytest.raises(ValueError):
        points(rep, "nope")


# ---- the model's grade, with a stubbed predictor and stubbed measurements -----------------------
class Stub:
    """What edu3d.plan.step.predict returns, as far as the tuner reads it: a step time
    that grows with the micro-batch count and tensor parallelism."""

    def __init__(self, spec, run, profile):
        self.step_time = 0.01 * run.microbatches * run.layout.tp + 0.001 * run.parallel.zero
        self.parts = {"compute": self.step_time}


def test_tune_grades_the_model_it_was_given(monkeypatch):
    from edu3d.bench import bench_tune_model, predicted

    monkeypatch.setattr(predicted, "predict", Stub)

    def measure(cands, gpus, warmup, progress=None, timeout=600):
        for c in cands:  # median: twice the prediction, one out of order; fastest: exact
            step = 2 * c["predicted_step_s"] * (3 if c is cands[0] else 1)
            c["measured"] = {"step_s": step, "fastest_s": c["predicted_step_s"],
                             "tokens_per_s": 1.0,
                             "peak_bytes": 1, "steps_timed": 1, "loss": 1.0}

    monkeypatch.setattr(autotune, "measure", measure)
    rep = autotune.tune("tiny", 2, top=6, layers=2, d_model=32, seq=32)
    cands = rep["candidates"]
    assert rep["profile"] == "cpu-reference" and "run edu3d calibrate" in rep["profile_note"]
    assert all(c["error"] == pytest.approx(-0.5) for c in cands[1:])
    assert cands[0]["error"] == pytest.approx(1 / 6 - 1)
    assert rep["median_error"] == pytest.approx(0.5)
    table = ranking.format_table(rep)
    assert "median error 50%" in table and "predicted with the cpu-reference profile" in table
    fastest = bench_tune_model.grade(cands, "fastest_s")
    assert fastest["median_error"] == pytest.approx(0.0) and fastest["met"]
    assert not bench_tune_model.grade(cands, "step_s")["met"]  # 50 % off
    assert "goal met" in bench_tune_model.verdict("fastest step", fastest, len(cands))


def test_the_profile_a_tuner_predicts_with(monkeypatch, tmp_path):
    from edu3d.bench import predicted
    from edu3d.plan.hardware import HARDWARE_DIR, ProfileError

    monkeypatch.setenv("EDU3D_PROFILES", str(tmp_path))
    profile, note = predicted.profile_for(None, "cpu")
    assert profile.name == "cpu-reference" and profile.cores and "edu3d calibrate" in note
    assert predicted.profile_for(None, "cuda")[0].name == "h100-sxm"
    mine = json.loads((HARDWARE_DIR / "cpu-reference.json").read_text())
    mine["name"] = "this-machine"
    (tmp_path / "this-machine.json").write_text(json.dumps(mine))
    profile, note = predicted.profile_for(None, "cpu")
    assert profile.name == "this-machine" and note is None
    (tmp_path / "this-machine.json").write_text("{")
    with pytest.raises(ProfileError, match="cannot read"):  # a broken calibration is said
        predicted.profile_for(None, "cpu")
    with pytest.raises(ProfileError, match="unknown hardware profile 'nope'"):
        predicted.profile_for("nope", "cpu")
