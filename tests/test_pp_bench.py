"""``edu3d bench pp`` runs and reports in edu3d/bench/harness.py's JSON shape (timing is not tested:
a test's verdict must not depend on how busy the machine is)."""

from edu3d.bench.bench_pp import REFERENCE, run_benchmark


def test_bench_pp_reports_and_both_compute_the_same():
    rep = run_benchmark(2, True, m=2, layers=2, d_model=32, seq=16, rows=1, reps=1, warmup=0)
    assert rep["benchmark"] == "pp" and rep["world_size"] == 2
    (row,) = rep["results"]
    assert row["reference"] == REFERENCE and row["ratio"] > 0
    assert row["max_grad_rel_diff"] < 1e-5
