"""The bubble measured in a live run agrees with the formula.

Two pipeline ranks run the real engine, schedule and messages on balanced stages of known
cost (:class:`edu3d.course.ch05_pipeline_parallel.TimedStage`: forward 40 ms, backward 80 ms, spent waiting,
so the two ranks do not slow each other down on a 2-core machine; a split backward spends
40 ms in I and 40 ms in W, so ZBV and DualPipeV run with F = I = W, halved per chunk).
The bubble of a step is the idle share of the ranks' time between its first compute start and
its last compute end; the smallest over the four steps after the warm-up step must be
within 5 percentage points of (p-1)/(m+p-1) for 1F1B and GPipe, (p-1)/(v·m+p-1) for
interleaved 1F1B and (p-1)/(6m+p-1) for ZBV and DualPipeV; the simulator's replay of the
step's own measured action times is printed beside it. What is left between them is message latency and the engine's Python
between actions, which the formula assumes to be zero. The least-disturbed step is the one
compared because another process's load only ever adds idle time: a rank woken late leaves
its partner waiting (CI, with the other test worker busy, once measured a median of 0.176
for 1F1B where the formula says 0.111). (With the real GPT on this shared 2-core machine
the ranks also slow each other down; chapter 05 shows both.)
"""

from __future__ import annotations

from edu3d.launch import launch
from edu3d.config.layout import Layout
from edu3d.course.ch05_pipeline_parallel import measured_bubbles, replay_bubble, run_timed
from edu3d.schedules.simulate import bubble_formula

RUNS = [dict(name="1f1b", m=8), dict(name="interleaved", m=8, vpp=2), dict(name="gpipe", m=8),
        dict(name="zbv", m=8), dict(name="dualpipev", m=8)]


def test_measured_bubble_matches_formula():
    res = launch(run_timed, 2, args=(RUNS,), kwargs=dict(steps=5, f_ms=40, b_ms=80, w_ms=40),
                 layout=Layout(pp=2), timeout=240, echo=False)
    events = res.events()
    report = []
    for run in res.results[0]:
        bubbles = measured_bubbles(events, run["steps"][1:])
        measured = min(bubbles)
        step = run["steps"][1:][bubbles.index(measured)]
        formula = bubble_formula(run["name"], 2, run["m"], run.get("vpp", 1))
        replay = replay_bubble(events, step, run["name"], 2, run["m"], run.get("vpp", 1))
        report.append((run["name"], measured, formula))
        print(f"{run['name']} p=2 m={run['m']}: measured {measured:.3f}, replay of its action "
              f"times {replay:.3f}, formula {formula:.3f}")
    assert all(abs(measured - formula) <= 0.05 for _, measured, formula in report), report
    # peak in-flight micro-batches measured by the engine: m for GPipe, at most p for 1F1B
    peaks = {run["name"]: [r[i]["peak_in_flight"] for r in res.results]
             for i, run in enumerate(res.results[0])}
    assert peaks["gpipe"] == [8, 8] and max(peaks["1f1b"]) <= 2
