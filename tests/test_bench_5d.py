"""``edu3d bench ep`` and ``edu3d bench cp`` run, and their bytes are the formulas': the
all-to-all's measured remote share of the token matrix against (EP-1)/EP, and the ring,
all-gather and Ulysses bytes on the cp group exactly. (Times are reported, never asserted.)"""

import pytest

from edu3d.bench.bench_5d import run_cp_benchmark, run_ep_benchmark
from edu3d.bench.harness import format_table


def test_bench_ep_bytes_against_formula():
    rep = run_ep_benchmark(nprocs=2, reps=1, json_out=True)
    row = rep["results"][0]
    assert f"a2a bytes per step: {row['a2a_bytes']:,.0f} measured, " \
           f"{row['a2a_bytes_formula']:,.0f} by the formula" in format_table(rep)  # printed too
    assert row["edu3d_s"] > 0 and row["reference_s"] > 0
    assert 0 < row["a2a_share_of_step"] < 1
    assert row["a2a_bytes"] == pytest.approx(row["a2a_bytes_formula"], rel=0.25)
    assert row["remote_share"] == pytest.approx(row["remote_share_formula"], abs=0.2)


def test_bench_cp_bytes_equal_formula():
    rep = run_cp_benchmark(nprocs=2, reps=1, json_out=True)
    rows = rep["results"]
    assert format_table(rep).count("cp bytes per step:") == 3  # the table prints them
    assert [r["name"] for r in rows] == ["cp2 ring", "cp2 allgather", "cp2 ulysses"]
    for r in rows:
        assert r["cp_bytes"] == pytest.approx(r["cp_bytes_formula"], rel=1e-9), r["name"]
        assert 0 < r["cp_share_of_step"] < 1
