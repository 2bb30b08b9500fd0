"""Chapter 13 (context parallelism) and exercise 13: the course's numbers against live ranks,
the charts and panels, and the cp_merge grader honest both ways (the solution passes every
check, the untouched stub fails every check, and each classic mistake fails its check)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from edu3d.course import ch13_context_parallelism as ch13
from edu3d.course import ch13_context_parallelism_grade as grader, grading
from edu3d.course import ch13_context_parallelism_ring as ring
from edu3d.course.targets import best
from edu3d.config.layout import Layout
from edu3d.launch import launch
from edu3d.parallel.cp import work
from edu3d.plan import formulas

CHECKS = (grader.check_merge, grader.check_merge_is_safe, grader.check_positions,
          grader.check_ring)


# ---- the numbers without ranks ------------------------------------------------------------
@pytest.mark.parametrize("split", ["zigzag", "plain"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_owner_map_counts_the_causal_work(cp, split):
    owner = ch13.owner_map(32, cp, split)
    counts = [sum(row.count(r) for row in owner) for r in range(cp)]
    assert counts == work(32, cp, split)
    blocks = ch13.ring_block_work(32, cp, split)
    assert all(b >= c for b, c in zip(blocks, counts)) and sum(blocks) <= 32 * 32


def test_zigzag_balances_the_ring_and_plain_does_not():
    assert ch13.imbalance(ch13.ring_block_work(32, 4, "zigzag")) == 1.0
    assert ch13.ring_block_work(32, 4, "plain") == [48, 112, 176, 240]


def test_merge_demo_is_exact_and_the_average_is_not():
    demo = ch13.merge_demo()
    assert demo["error"] < 1e-6 and demo["average_error"] > 1e-3
    assert abs(demo["weight_a"] + demo["weight_b"] - 1) < 1e-6


def test_formulas_scale_as_designed():
    f2, f4 = ch13.impl_formulas(64, 2, 32), ch13.impl_formulas(64, 4, 32)
    kv = 2 * 64 * 32 * 4
    assert f4["allgather"]["backward"] == 3 / 4 * kv  # (cp-1)/cp of all K, V
    assert f4["ring"]["forward"] - 3 * (64 // 4) * 8 == 3 / 4 * kv  # the same K, V, in steps
    assert f4["ulysses"]["backward"] == pytest.approx(3 / 4 * 4 * 64 * 32 / 4 * 4)
    assert f2["ulysses"]["backward"] == f2["allgather"]["backward"] / 1  # cp/2 = 1: equal
    assert ch13.ulysses_degrees(4) == [1, 2, 4]
    rows = ch13.playbook_scale()
    assert [r["cp"] for r in rows] == [1, 2, 4, 8, 16]
    assert rows[0]["total_gb"] == pytest.approx(16 * rows[-1]["total_gb"])
    assert 700 < rows[0]["total_gb"] < 780  # Llama 3 8B at 128k, selective, 16-bit


# ---- live: one launch for the attention lesson, one for the memory sweep --------------------
@functools.lru_cache(maxsize=None)
def _lesson():
    run = launch(ch13.attention_lesson, 4, kwargs={"repeats": 1}, layout=Layout(dp=4),
                 timeout=120, echo=False, name="ch13")
    return run.results, run.events()


def test_lesson_is_exact_and_the_counter_matches_the_block_rule():
    results, _ = _lesson()
    assert max(max(r["errors"].values()) for r in results) < 1e-5
    for cp in (2, 4):
        for split in ("zigzag", "plain"):
            measured = [results[r]["work"][(cp, split)] for r in range(cp)]
            assert measured == ch13.ring_block_work(32, cp, split), (cp, split)


def test_traced_bytes_equal_the_formulas_and_the_ring_steps_read_right():
    _, events = _lesson()
    for rank in range(4):
        assert ch13.impl_bytes(events, rank) == ch13.impl_formulas(32, 4, 32), rank
    steps = ring.ring_steps(events, step=1)
    kinds = {}
    for row in steps:
        kinds[(row["rank"], row["phase"], row["kind"])] = \
            kinds.get((row["rank"], row["phase"], row["kind"]), 0) + 1
        assert row["peer"] == (row["rank"] + 1) % 4
    for r in range(4):
        assert kinds[(r, "forward", "K,V")] == 3 and kinds[(r, "backward", "dK,dV")] == 4
        assert kinds[(r, "backward", "K,V")] == 3


def test_the_planners_ring_bytes_are_the_traced_ones():
    """Issue 40, item 5: the planner (plan.formulas.cp_bytes) counts what the ring sends per
    layer, 3cp-2 K,V chunks (cp-1 forward, cp-1 again and cp of dK,dV backward), measured on
    every rank; the positions that travel with them are edu3d's own extra."""
    _, events = _lesson()
    s, cp, h = 32, 4, 32
    positions = 2 * (cp - 1) * (s // cp) * 8
    want = formulas.cp_bytes("ring", s, 1, h, cp, value_bytes=ch13.VALUE_BYTES)
    for rank in range(cp):
        sent = ch13.impl_bytes(events, rank)["ring"]
        assert sent["forward"] + sent["backward"] - positions == want, rank


def test_activation_sweep_equals_the_formula_plus_the_rings_extras():
    rows = launch(ch13.activation_sweep, 4, kwargs={"seq_lens": (32, 64)},
                  layout=Layout(dp=4), timeout=120, echo=False, name="ch13-mem").results[0]
    assert {(r["seq_len"], r["cp"]) for r in rows} == {(s, c) for s in (32, 64)
                                                        for c in (1, 2, 4)}
    for r in rows:
        assert r["measured"] == r["formula"] + ch13.ring_extra_bytes(r), r


# ---- charts and panels ------------------------------------------------------------------
def test_charts_have_titles_units_and_named_legends():
    from edu3d.widgets import context, style

    figs = [
        context.score_blocks_figure(ch13.owner_map(16, 2, "plain"), 2, "plain",
                                    work(16, 2, "plain"), ch13.ring_block_work(16, 2, "plain"),
                                    [1, 2]),
        context.ring_steps_figure([{"rank": 0, "phase": "forward", "ring_step": 0,
                                    "kind": "K,V", "peer": 1, "bytes": 8, "t0": 5.0,
                                    "t1": 9.0}], 2),
        context.merge_figure(ch13.merge_demo()),
        context.exchange_figure(None, ch13.impl_formulas(32, 4, 32), cp=4),
        context.activation_figure([{"seq_len": 32, "cp": 1, "measured": 2, "formula": 2}]),
        context.scale_figure(ch13.playbook_scale()),
    ]
    for fig in figs:
        assert fig.layout.title.text and "<br>" in fig.layout.title.text  # takeaway line
        for t in fig.data:
            if style.shows_in_legend(fig, t):
                assert t.name and not t.name.startswith("trace")


def test_panels_redraw_every_knob_and_refuse_with_a_knob_named():
    from edu3d.widgets.panels import ch13_context_parallelism as panels

    blocks = panels.block_controls()
    for cp in (1, 2, 4, 8):
        for split in ("zigzag", "plain"):
            blocks.redraw(cp=cp, split=split, seq_len=32)
            assert blocks.fig is not None and not blocks.message
    blocks.redraw(cp=4, split="zigzag", seq_len=12)  # not a knob value: the rule still holds
    assert "seq_len" in blocks.message
    blocks.redraw(seq_len=32, cp=1)
    assert blocks.run() is None and "cp" in blocks.message
    merge = panels.merge_controls()
    merge.run()
    assert merge.state["seed"] == 1 and merge.demo["error"] < 1e-6
    costs = panels.exchange_controls()
    costs.redraw(cp=8, heads=4)
    assert "ulysses" not in costs.formulas() and "cp" in costs.message
    costs.redraw(cp=4)
    assert "ulysses" in costs.formulas() and not costs.message
    costs.redraw(cp=16)
    assert costs.run() is None and "cp" in costs.message


# ---- exercise 13: the grader is honest both ways -------------------------------------------
def test_the_solution_passes_every_check():
    sol = grading.load("cp_merge", solutions=True)
    for check in CHECKS:
        assert check(sol), check.__name__


def test_the_untouched_stub_fails_every_check(monkeypatch, capsys):
    monkeypatch.delenv("EDU3D_SOLUTIONS", raising=False)
    monkeypatch.delenv("EDU3D_SUBMISSION", raising=False)
    stub = grading.load("cp_merge", solutions=False)
    for check in CHECKS:
        with pytest.raises(NotImplementedError):
            check(stub)
    assert grading.unfinished("cp_merge", "merge") and grading.unfinished(
        "cp_merge", "zigzag_positions")
    verdicts = [grading.check(c.__name__, lambda c=c: c(stub), requires=req)
                for c, req in zip(CHECKS, ("cp_merge.merge", "cp_merge.merge",
                                           "cp_merge.zigzag_positions", "cp_merge.merge"))]
    assert not any(verdicts)
    assert capsys.readouterr().out.count("FAIL ") == len(CHECKS)


def _wrong(**replace):
    sol = grading.load("cp_merge", solutions=True)
    return SimpleNamespace(**{"merge": sol.merge, "zigzag_positions": sol.zigzag_positions,
                              **replace})


def _average(oa, la, ob, lb):
    return (oa.float() + ob.float()) / 2, torch.logaddexp(la.float(), lb.float())


def _no_inf_guard(oa, la, ob, lb):
    la, lb = la.float(), lb.float()
    lse = torch.logaddexp(la, lb)
    return (torch.exp(la - lse).unsqueeze(-1) * oa.float()
            + torch.exp(lb - lse).unsqueeze(-1) * ob.float(), lse)


def _plain(s, cp, r):
    n = s // cp
    return list(range(r * n, (r + 1) * n))


def _off_by_one(s, cp, r):
    n = s // (2 * cp)
    return [p for c in (r, 2 * cp - r) for p in range(c * n, (c + 1) * n)]


@pytest.mark.parametrize("wrong, check, message", [
    (dict(merge=_average), grader.check_merge, "the merged output is off"),
    (dict(merge=_average), grader.check_ring, "differs from full attention"),
    (dict(merge=_no_inf_guard), grader.check_merge_is_safe, "nan values"),
    (dict(zigzag_positions=_plain), grader.check_positions, "expected"),
    (dict(zigzag_positions=_off_by_one), grader.check_positions, "expected"),
    (dict(zigzag_positions=_off_by_one), grader.check_ring, "exactly once"),
], ids=["average", "average-ring", "no-inf-guard", "plain-split", "mirror-off-by-one",
        "mirror-off-by-one-ring"])
def test_classic_mistakes_fail_their_check(wrong, check, message):
    with pytest.raises(AssertionError, match=message):
        check(_wrong(**wrong))


def test_the_design_turns_on_the_implementation():
    """Exercise 13's design: the reference passes both jobs; keeping one implementation for
    both fails one, whatever degree and recomputation go with it (the planner's best plan of
    that implementation misses the target), and the reference with its implementation
    swapped for another fails its job."""
    sol = grading.load("cp_merge", solutions=True)
    for job in grader.JOBS:
        grader.check_design(sol, job)
    for impl in grader.IMPLS:
        missed = []
        for job in grader.JOBS:
            mine = [p for p in grader.plans(job) if p["cp_impl"] == impl]
            try:
                plan, _ = best(mine, lambda p, job=job: grader.cost(job, p),
                               grader.target(job).memory)
                grader.check_design(SimpleNamespace(cp_plan=lambda j, p=plan: p), job)
            except (AssertionError, ValueError):
                missed.append(job)
        assert missed, f"{impl} on every job passes: the implementation does not matter"
    for job in grader.JOBS:
        for impl in set(grader.IMPLS) - {sol.cp_plan(job)["cp_impl"]}:
            plan = {**sol.cp_plan(job), "cp_impl": impl}
            with pytest.raises(AssertionError, match="slower than the target"):
                grader.check_design(SimpleNamespace(cp_plan=lambda j, p=plan: p), job)


def test_the_panels_captions_are_their_bars_at_every_knob_position():
    """Issue 42: chapter 13's cost panel said "Ulysses sends least" after leaving Ulysses out
    (cp=8, 4 heads), and a printed imbalance of 1.67 stood beside a subtitle of 1.73. At
    every position of the exchange and block panels' knobs, the takeaway names only drawn
    implementations, the least and most by the drawn bars, and the block panel's ratios are
    its bars' busiest over their mean, each labelled with what it measures."""
    import re

    from edu3d.widgets.panels import ch13_context_parallelism as panels

    ctl = panels.exchange_controls()
    for cp in (2, 4, 8, 16):
        for heads in (1, 2, 4, 8):
            for seq_len in (32, 256):
                ctl.redraw(cp=cp, heads=heads, seq_len=seq_len)
                fig = ctl.bytes_fig
                drawn = {}
                for bar in fig.data:  # the formula's forward and backward bars
                    for impl, kib in zip(bar.x, bar.y):
                        drawn[impl] = drawn.get(impl, 0.0) + kib
                said = fig.layout.title.text
                named = re.search(r"(\w+) sends least per rank \(([\d.]+) KiB.*\), (\w+) the "
                                  r"most \(([\d.]+) KiB\)", said)
                assert named, said
                least, low, most, high = named.groups()
                assert {least, most} <= set(drawn), (cp, heads, said)
                assert ("ulysses" in drawn) == (heads % cp == 0), (cp, heads)
                assert least == min(drawn, key=drawn.get) and low == f"{drawn[least]:.1f}"
                assert most == max(drawn, key=drawn.get) and high == f"{drawn[most]:.1f}"
    blocks = panels.block_controls()
    for cp in (2, 4, 8):
        for split in ("plain", "zigzag"):
            for seq_len in (32, 64):
                blocks.redraw(cp=cp, split=split, seq_len=seq_len)
                bars = {b.name: list(b.y) for b in blocks.fig.data if b.type == "bar"}
                said = re.search(r"([\d.]+)x the causal entries, ([\d.]+)x what the ring "
                                 r"computes", blocks.fig.layout.title.text)
                assert said, blocks.fig.layout.title.text
                ratio = lambda ys: max(ys) / (sum(ys) / len(ys))  # noqa: E731
                assert said.groups() == (f"{ratio(bars['causal entries (formula)']):.2f}",
                                         f"{ratio(bars['ring computes (theory)']):.2f}")
