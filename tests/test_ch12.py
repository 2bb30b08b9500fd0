"""Chapter 12 and exercise 12: the grader is honest both ways and catches the classic
mistakes; the chapter's measurements agree with their formulas.

* solutions pass every check of :mod:`edu3d.course.ch12_mixture_of_experts_grade`; the
  untouched stubs fail every check (``NotImplementedError``); per-token shares, top-1-only
  counts, gate means, a detached loss, a floor capacity, index-order drops and reversed ties each fail, naming the case;
* the chapter's serial runs: every step routes ``T·k`` assignments, dropless drops nothing,
  ``C = 0.5`` drops half or more, the capacity formula; one ep=2 launch: dispatch carries
  exactly ``T·k·h·4`` bytes per MoE layer on each rank, the token matrix rows add up.
"""

from __future__ import annotations

import math

import pytest
import torch

from edu3d.course import ch12_mixture_of_experts as moe
from edu3d.course import ch12_mixture_of_experts_grade as grader, grading

CHECKS = (grader.check_loss_value, grader.check_loss_grad, grader.check_capacity)


def test_solutions_pass_every_check():
    sol = grading.load("moe_routing", solutions=True)
    for check in CHECKS:
        assert check(sol)


def test_stubs_fail_every_check():
    stub = grading.load("moe_routing", solutions=False)
    for check in CHECKS:
        with pytest.raises(NotImplementedError):
            check(stub)


def test_grader_catches_the_classic_mistakes():
    from types import SimpleNamespace

    sol = grading.load("moe_routing", solutions=True)

    def per_token(probs, idx, E):  # share per token: k times too large
        return E * (torch.bincount(idx.flatten(), minlength=E).float() / len(idx)
                    * probs.mean(0)).sum()

    def gate_mean(probs, idx, E):  # P_i from the chosen gates only
        n, k = idx.shape
        f = torch.bincount(idx.flatten(), minlength=E).float() / (n * k)
        p = torch.zeros(E).index_add(0, idx.flatten(), probs.gather(1, idx).flatten()) / n
        return E * (f * p).sum()

    def detached(probs, idx, E):
        return sol.load_balancing_loss(probs.detach(), idx, E)

    def floor_cap(gates, idx, E, C):
        n, k = gates.shape
        c = math.floor(n * k / E * C)
        return sol.capacity_keep(gates, idx, E, c / (n * k / E))

    def by_index(gates, idx, E, C):
        return sol.capacity_keep(torch.ones_like(gates), idx, E, C)

    def ties_high(gates, idx, E, C):
        return sol.capacity_keep(gates.flip(0), idx.flip(0), E, C).flip(0)

    for fn, check, msg in (
            (per_token, grader.check_loss_value, r"k=2: your loss is 2\.01"),
            (gate_mean, grader.check_loss_value, r"k=1: your loss is"),
            (detached, grader.check_loss_grad, "has no gradient")):
        with pytest.raises(AssertionError, match=msg):
            check(SimpleNamespace(load_balancing_loss=fn))
    for fn, msg in ((floor_cap, r"C=1.25: expert 0 keeps 6 of its 8 assignments, edu3d keeps 7"),
                    (by_index, "not the right assignments"),
                    (ties_high, "not the right assignments")):
        with pytest.raises(AssertionError, match=msg):
            grader.check_capacity(SimpleNamespace(capacity_keep=fn))


def test_capacity_formula_and_runs():
    assert [moe.capacity(256, 2, 4, c) for c in (0.5, 1.0, 1.25, 1.1)] == [64, 128, 160, 141]
    runs = moe.capacity_runs(4, (0.0, 0.5))
    assert all(r["dropped"] == 0 for r in runs[0.0])
    assert all(r["dropped"] >= 256 for r in runs[0.5])
    assert all(sum(r["tokens_per_expert"]) == 512 for r in runs[0.0])


def test_balance_metrics():
    assert moe.imbalance([128, 128, 128, 128]) == 1.0
    assert moe.imbalance([256, 0, 0, 0]) == 4.0  # k = 1: 256 tokens, one expert: E
    assert moe.imbalance([256, 256, 0, 0]) == 2.0  # k = 2: every token on the same 2: E/k
    assert moe.switch_loss([1, 1, 1, 1], [0.25] * 4, 2) == pytest.approx(1.0)
    assert moe.switch_loss([256, 256, 0, 0], [0.5, 0.5, 0, 0], 2) == pytest.approx(2.0)
    assert moe.leaving_share([[3, 1], [1, 3]]) == pytest.approx(0.25)


def test_expert_parallel_bytes_match_the_formula():
    run = moe.launch_ep(2, steps=2)
    events = moe.label_a2a(run.events(), 4)
    f = moe.a2a_formula(128, 2, 32, 2, moe_layers=2)
    got = moe.a2a_bytes(events, 2)
    assert set(got) == {0, 1}
    for row in got.values():
        assert row["dispatch"] == f["sent"] and row["combine (bwd)"] == f["sent"]
        assert row["counts"] == 2 * 4 * 8  # 2 MoE layers, forward only: E int64 counts each
    rec = next(r for r in run.results if r["rank"] == 0)["records"][1]
    assert all(sum(row) == 128 * 2 for row in rec["ep_tokens"])
    assert sorted(r["experts"] for r in run.results) == [[0, 1], [2, 3]]


def test_the_takeaways_say_what_their_data_shows():
    """Chapter 12's computed captions: capacity (drops, distance from dropless), the scopes'
    means as drawn, memory against the dense model with the active parameters."""
    rec = lambda dropped, loss: {"dropped": dropped, "loss": loss}  # noqa: E731
    runs = {0.0: [rec(0, 4.0)] * 2, 0.5: [rec(8, 4.2)] * 2, 2.0: [rec(0, 3.95)] * 2}
    summary = moe.capacity_summary(runs, tokens=8, k=2)
    assert summary[0.5] == {"dropped_pct": 50.0, "final": 4.2, "gap": pytest.approx(0.2)}
    said = moe.capacity_takeaway(summary)
    assert said.startswith("C = 0.5 drops the most (50.0% of the assignments); C = 2 drops "
                           "nothing; the final loss lies furthest from dropless at C = 0.5")

    class Run:  # two data ranks, two steps: loads per expert of each rank's micro-batch
        results = [{"rank": 1, "loads": [[2, 2, 0, 0], [1, 1, 1, 1]]},
                   {"rank": 0, "loads": [[0, 0, 2, 2], [2, 2, 0, 0]]}]
    series = moe.scope_series(Run())
    assert series == {"whole step": [1.0, 1.5], "each rank's micro-batch (busiest)": [2.0, 2.0]}
    assert moe.scope_takeaway({"global": series}, last=2) == (
        "busiest expert / mean, last 2 steps; global: whole step 1.25, each rank's micro-batch 2.00")

    rows = [{"name": "dense", "params": 1, "grads": 1, "optimizer": 2},
            {"name": "MoE, 1 rank", "params": 40, "grads": 40, "optimizer": 80},
            {"name": "MoE ep=2, rank 0 (experts 0,1)", "params": 25, "grads": 25, "optimizer": 50},
            {"name": "MoE ep=2, rank 1 (experts 2,3)", "params": 20, "grads": 20, "optimizer": 40}]
    said = moe.memory_takeaway(rows, {"total": 10, "active": 8})
    assert said.endswith("one rank 1.25x (above); ep=2 0.78x (below)"), said


def test_the_memory_takeaway_reads_the_drawn_bars():
    """Issue 42: the memory takeaway said ep = 2 goes below the dense equivalent where its
    bar equals it. Each ratio it states is the drawn bar (the fullest rank of its degree)
    over the hatched dense-equivalent bar, with the word that comparison earns."""
    import re

    from edu3d.widgets.experts import memory_bars

    mem = lambda p: {"params": p, "grads": p, "optimizer": 2 * p}  # noqa: E731
    active = 1000
    runs = {2: [{"rank": 0, "experts": [0, 1], "memory": mem(4000)},
                {"rank": 1, "experts": [2, 3], "memory": mem(3990)}],
            4: [{"rank": r, "experts": [r], "memory": mem(3000 + r)} for r in range(4)]}
    rows = moe.memory_rows(mem(900), mem(7000), runs, active)
    fig = memory_bars(rows, title="t", takeaway=moe.memory_takeaway(rows, {"total": 9000,
                                                                          "active": active}))
    drawn = {}
    for bar in fig.data:
        for name, kib in zip(bar.y, bar.x):
            drawn[name] = drawn.get(name, 0.0) + kib
    same = next(v for n, v in drawn.items() if "16 Ψ_active" in n)
    said = dict(re.findall(r"(one rank|ep=\d+) ([\d.]+x \(\w+\))", fig.layout.title.text))
    assert set(said) == {"one rank", "ep=2", "ep=4"}, fig.layout.title.text
    for who, pick in (("one rank", "MoE, 1 rank"), ("ep=2", "MoE ep=2,"), ("ep=4", "MoE ep=4,")):
        r = round(max(v for n, v in drawn.items() if n.startswith(pick)) / same, 2)
        word = "below" if r < 1 else "equal" if r == 1 else "above"
        assert said[who] == f"{r:.2f}x ({word})", (who, said[who])
    assert said["ep=2"] == "1.00x (equal)"  # 16,000 bytes, the dense equivalent's, drawn equal
