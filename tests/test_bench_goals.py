"""``edu3d bench goals``: the speed goals no test asserts, measured against each goal (a shape
check, not a timing: whether a goal is met depends on the machine, so no test looks)."""

from __future__ import annotations

import pytest

from edu3d.bench import bench_goals
from edu3d.bench.harness import format_table
from edu3d.commands.bench import BENCHMARKS, benchmark


def _goal(name: str) -> bench_goals.Goal:
    return next(g for g in bench_goals.GOALS if g.name == name)


def test_two_cheap_goals_are_measured_and_reported_against_their_goal():
    goals = [_goal("divisors of a billion"), _goal("a 5000-digit number refused")]
    rep = benchmark("goals")(goals=goals)
    assert BENCHMARKS["goals"] == "edu3d.bench.bench_goals:run_benchmark"
    assert [r["name"] for r in rep["results"]] == [g.name for g in goals]
    for row, goal in zip(rep["results"], goals):
        assert row["edu3d_s"] > 0 and row["reference_s"] == goal.goal_s
        assert row["ratio"] == pytest.approx(row["edu3d_s"] / goal.goal_s)
        assert row["met"] == (row["edu3d_s"] <= goal.goal_s) and row["clock"] == "cpu"
    table = format_table(rep).splitlines()
    assert all(line.endswith(("  met", "  MISSED")) for line in table[2:]), table


def test_a_goal_that_ends_another_way_measured_nothing():
    """A launcher goal waits for a given error; a run that failed otherwise is refused."""
    wrong = bench_goals.Goal("fails otherwise", 1.0, "wall", "",
                             "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n"
                             "    out['said'] = str(e)", says="rank 3 failed")
    with pytest.raises(RuntimeError, match="ended another way: 'division by zero'"):
        bench_goals.row(wrong)


def test_every_goal_has_a_goal_and_a_clock():
    assert len({g.name for g in bench_goals.GOALS}) == len(bench_goals.GOALS)
    assert all(g.goal_s > 0 and g.clock in ("cpu", "wall", "latency", "overhead")
               for g in bench_goals.GOALS)
    assert sum(g.name.startswith("plan ") for g in bench_goals.GOALS) == len(bench_goals.PLANS)
