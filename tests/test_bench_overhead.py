"""``edu3d bench overhead`` runs both sides on the same model and data (the ratio itself is
a measurement, never a test: it depends on how busy the machine is)."""

import pytest

from edu3d.bench import bench_overhead
from edu3d.commands.bench import BENCHMARKS, benchmark


def test_both_sides_train_the_same_model_and_the_report_has_the_spread():
    rep = bench_overhead.run_benchmark(reps=2, model="tiny", steps=3, json_out=True)
    row = rep["results"][0]
    assert rep["benchmark"] == "overhead" and rep["world_size"] == 1
    assert row["loss_diff"] < 1e-5  # the same steps, computed two ways
    assert row["pair_ratio_min"] <= row["pair_ratio_median"] <= row["pair_ratio_max"]
    assert row["ratio"] == pytest.approx(row["edu3d_s"] / row["reference_s"])
    assert row["cpu_ratio"] > 0


def test_registered_and_one_process_only():
    assert benchmark("overhead") is bench_overhead.run_benchmark
    assert "overhead" in BENCHMARKS
    with pytest.raises(ValueError, match="use -n 1"):
        bench_overhead.run_benchmark(nprocs=2)
