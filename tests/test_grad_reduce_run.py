"""A run's ZeRO-2/3 memory and traffic under ``--grad-reduce`` equal the planner's.

Two ranks on gloo train one step of the tiny GPT with ZeRO-2 and ZeRO-3, reducing per
micro-batch and per step, at m = 1 and 4 micro-batches, in one launch. ``Trainer.stats()``
reports the peak bytes held between compute actions by category and the bytes sent per
collective kind; the planner (:func:`edu3d.plan.estimate.state_per_rank` at the peak,
:func:`edu3d.plan.zero_modes.dp_wire_bytes`) must give the same numbers to the byte.
"""

from __future__ import annotations

import functools

import pytest

from edu3d.course import ch03_zero_reduce as ch03r

CASES = tuple(c for c in ch03r.CASES if c[1] >= 2)
MS = (1, 4)


@functools.lru_cache(maxsize=None)
def _rows():
    return ch03r.table(ch03r.run(2, "tiny", CASES, MS, timeout=300), 2, "tiny", CASES, MS)


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("mode", ["per-microbatch", "per-step"])
def test_measured_gradient_bytes_equal_the_planners(zero, mode):
    for r in _rows():
        if (r["zero"], r["grad_reduce"]) != (zero, mode):
            continue
        where = f"ZeRO-{zero} {mode} m={r['m']}"
        assert r["grads_measured"] == r["grads"], where
        assert r["params_measured"] == r["params"], where
        assert r["wire_measured"] == pytest.approx(r["wire"], abs=0.5), where


def test_the_modes_differ_as_the_formulas_say():
    rows = {(r["zero"], r["grad_reduce"], r["m"]): r for r in _rows()}
    for zero in (2, 3):
        mb, ps = rows[(zero, "per-microbatch", 4)], rows[(zero, "per-step", 4)]
        # per-step holds the full gradients beside the shard: (1 + 1/N) / (1/N) = 3x at N = 2
        assert ps["grads_measured"] == pytest.approx(3 * mb["grads_measured"], rel=0.01)
        one = rows[(zero, "per-step", 1)]
        assert rows[(zero, "per-microbatch", 1)]["grads_measured"] == one["grads_measured"]
        assert rows[(zero, "per-microbatch", 1)]["wire_measured"] == one["wire_measured"]
        # per micro-batch: m reduce-scatters (ZeRO-3: m x (2 all-gathers + 1 reduce-scatter))
        want = 5 / 2 if zero == 2 else 4
        assert mb["wire_measured"] / ps["wire_measured"] == pytest.approx(want, rel=1e-6)
    assert "8 runs: gradient bytes equal the planner's in 8, bytes on the wire in 8" == \
        ch03r.agreement(_rows())


def test_the_chart_and_its_panel():
    from edu3d.widgets.grad_reduce import grad_reduce_figure
    from edu3d.widgets.panels.ch03_zero import GradReduceControls

    rows = _rows()
    fig = grad_reduce_figure(rows, (2, "per-microbatch"))
    names = {t.name for t in fig.data}
    assert {"ZeRO-2 per-microbatch", "ZeRO-3 per-step",
            "ZeRO-2 per-microbatch (measured)"} <= names
    lines = [t for t in fig.data if t.mode == "lines"]
    marks = [t for t in fig.data if t.mode == "markers"]
    assert len(lines) == len(marks) == 2 * len(CASES)  # both panels, every case
    assert "ZeRO-2 per-microbatch holds 33% of per-step's gradient bytes and sends 2.5x" \
        in fig.layout.title.text  # from the run's numbers: 1/N of (1 + 1/N), (m + 1)/2
    ctl = GradReduceControls(stage=3, grad_reduce="per-step")
    assert not any(t.mode == "markers" for t in ctl.figure.data)  # nothing measured yet
    assert all(t.opacity >= 0.5 for t in GradReduceControls().figure.data)  # "all": every case lit
    for stage in range(4):
        for mode in ("per-microbatch", "per-step"):
            for model in ("tiny", "small"):
                ctl.redraw(stage=stage, grad_reduce=mode, model=model)
                lit = [t for t in ctl.figure.data if t.opacity and t.opacity > 0.5]
                assert lit, (stage, mode, model)
    knobs = ctl.knobs()
    assert knobs["grad_reduce"].options == ("per-microbatch", "per-step")
    assert knobs["model"].options == ("tiny", "small")


def test_with_a_pipeline_the_fullest_rank_is_the_planners():
    """dp=2 x pp=2 (1F1B, 4 micro-batches): ``Trainer.stats()``'s fullest rank holds what the
    planner's fullest (pipeline rank, dp rank) holds at the peak, in both modes."""
    from edu3d.course.ch07_memory_plan import measure_many, options
    from edu3d.config.layout import Layout
    from edu3d.launch import launch
    from edu3d.plan import estimate as plan_memory

    argvs = [["--dp", "2", "--pp", "2", "--zero", str(z), "--microbatches", "4",
              "--global-batch", "8", "--grad-reduce", g] for z in (2, 3) for g in ch03r.MODES]
    res = launch(measure_many, 4, args=(argvs,), layout=Layout(dp=2, pp=2), echo=False,
                 timeout=300, name="grad-reduce-pp").results
    cats = ("params", "grads", "optimizer")
    for i, a in enumerate(argvs):
        st = options(a)
        spec = plan_memory.spec_of(st)
        planned = [plan_memory.state_per_rank(spec, st, pp, dp, at="peak")
                   for pp, dp, _ in (res[r][i]["coord"] for r in range(4))]
        fullest = max(planned, key=lambda d: sum(d.values()))
        got = res[0][i]["mem_bytes"]
        assert {c: got[c] for c in cats} == {c: fullest[c] for c in cats}, a
