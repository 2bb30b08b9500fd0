"""The performance model against every published measured run (edu3d/plan/data/
published_runs.json): the errors ``edu3d plan --validate`` prints, held here so that a change
to the model or a profile that makes them worse fails. Every row counts; the rows the model
misses by more than 30 % are named, each with its reason (``validate.KNOWN_MISSES``), and no
other row may join them. Torch-free; one validation (a few CPU seconds) shared by the tests."""

from __future__ import annotations

import functools
import json
import math

import pytest

from edu3d.plan import validate
from edu3d.plan.published import RUNS_FILE, RunError


@functools.lru_cache(maxsize=None)
def rows():
    return tuple(validate.validate())


def test_every_published_row_is_predicted():
    got = rows()
    assert len(got) == len(validate.load_runs()) >= 25
    assert len({r.framework for r in got}) >= 4
    for r in got:
        assert math.isfinite(r.error) and r.predicted > 0, r.id
        assert sum(r.prediction.parts.values()) == pytest.approx(r.prediction.step_time)


def test_throughput_errors():
    """Issue 35 asks for 15 % median and 30 % worst: both hold (worst 26.7 %, Megatron's 32B
    at TP 8), and nanotron's host-bound and one-GPU-per-node rows are within 20 %."""
    summary = validate.summary(list(rows()))
    assert summary["overall"]["throughput"]["median"] <= 0.09
    assert summary["overall"]["throughput"]["worst"] <= 0.30
    for framework, s in summary.items():
        assert s["throughput"]["median"] <= 0.30, framework
    assert summary["nanotron"]["throughput"]["median"] <= 0.07
    assert summary["nanotron"]["throughput"]["worst"] <= 0.20
    beyond = {r.id for r in rows() if abs(r.error) > 0.30}
    assert beyond <= set(validate.KNOWN_MISSES), beyond - set(validate.KNOWN_MISSES)
    assert not beyond


def test_memory_errors_where_published():
    """Issue 35 asks for 10 % median: it holds (FSDP2's root unit and torchtitan's compiled
    loss counted); torchtitan's 2D/pipelined fp8 runs stay under-counted by up to 30 %."""
    mem = validate.summary(list(rows()))["overall"]["memory"]
    assert mem["rows"] >= 30 and mem["median"] <= 0.10 and mem["worst"] <= 0.35


def test_the_table_says_what_it_assumed_and_why_a_row_is_missed(monkeypatch):
    got = list(rows())
    monkeypatch.setattr(validate, "KNOWN_MISSES", {got[0].id: "a reason the source explains"})
    text = validate.table(got)
    assert f"  {got[0].id}: a reason the source explains" in text
    assert "assumed micro_batch: micro-batch not published: 1 sequence" in text
    assert text.splitlines()[-1].startswith("torchtitan ")


def test_llama3_pipeline_cut_is_the_papers():
    """Sec. 3.3.2: one layer fewer on the first and last stages leaves the first model chunk
    only the embedding and the last only the head, so a chunk holds one layer: 126 + 2
    pieces on 16 ranks x 8 chunks. The planner weighs that cut (partition 'ends')."""
    from edu3d.schedules.partition import planner_cut
    llama = [r for r in validate.load_runs() if r.framework == "meta-internal"]
    assert len(llama) == 3
    for row in llama:
        run, _, assumed = validate.run_of(row)
        assert "vpp" not in assumed and run.layout.vpp == 8 and run.parallel.partition == "ends"
        parts = planner_cut(126, run.layout, run.parallel)
        assert parts[0] == (0, 0) and parts[-1] == (126, 126)
        assert all(b - a == 1 for a, b in parts[1:-1]) and len(parts) == 128
    errors = {r.id: r.error for r in rows() if r.framework == "meta-internal"}
    assert all(-0.2 < e < 0 for e in errors.values()), errors


def test_a_bad_partition_is_refused_in_one_line(tmp_path):
    data = json.loads(RUNS_FILE.read_text())
    row = next(r for r in data if r["layout"].get("partition") == "ends")
    row["layout"]["partition"] = "end"
    bad = tmp_path / "runs.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(RunError) as err:
        validate.validate(runs_file=bad)
    assert str(err.value) == (f"run {row['id']}: layout.partition 'end': choose one of "
                              "uniform, ends (absent: uniform)")


def test_a_bad_table_row_is_refused_in_one_line(tmp_path):
    data = json.loads(RUNS_FILE.read_text())
    data[0]["model"]["n_heads"] = 7  # no longer divides d_model
    bad = tmp_path / "runs.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(RunError) as err:
        validate.validate(runs_file=bad)
    assert str(err.value).startswith(f"run {data[0]['id']}: model.n_heads 7 must divide")
    assert "\n" not in str(err.value)
