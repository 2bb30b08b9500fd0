"""Compute/communication overlap in data parallelism, drawn from a live run's trace.

After reading this file you should be able to read a DP step on a timeline: per rank a compute
lane (forward blue, backward orange) and a communication sub-lane (all-reduce yellow, one bar
per bucket, from its launch to the moment the step waited for it). With buckets in reverse
order the first all-reduces start while backward is still running; with buckets in forward
order the first bucket holds the embedding, whose gradient is the last one backward produces,
so every all-reduce waits for the end of backward.
"""

from __future__ import annotations

import plotly.graph_objects as go

from edu3d.widgets import style
from edu3d.widgets.timeline import step_events, timeline_figure


def overlap_figure(events: list[dict], case: str, step: int, takeaway: str | None = None):
    """The timeline of one DP step of ``case`` (see :func:`edu3d.course.ch02_data_parallel.compare_versions`)."""
    evs = step_events(events, step, case=case)
    return timeline_figure(evs, title=f"One data-parallel step: {case}, step {step}",
                           takeaway=takeaway, idle=False,
                           ops=["F", "B", "all_reduce"])


def bucket_timeline_figure(sim: dict, measured: list[dict] | None = None, *, bucket_mb: float,
                           reverse: bool, title: str | None = None):
    """One DP step with gradient buckets: the simulation
    (:func:`edu3d.course.ch02_data_parallel.simulate_dp_step`), solid alone and a ghost under a
    run's step (:func:`~edu3d.widgets.timeline.step_events`). A simulated all-reduce
    is the bucket's time on the link; a measured one runs from its launch to the moment the
    step waited for it. Tint = bucket (later buckets lighter). ``title`` replaces the one
    that names the buckets' size and order."""
    def exposed(evs):
        b_end = max(e["t1"] for e in evs if e["op"] == "B")
        end = max(e["t1"] for e in evs)
        return b_end / 1e3, (end - b_end) / 1e3

    nb = len(sim["buckets"])
    during = launched_during_backward(sim["launch_log"], sim["grads"])
    order = "reverse (overlap on)" if reverse else "forward (overlap off)"
    takeaway = (f"{nb} bucket(s), {during} launched during backward; simulated: backward ends "
                f"at {sim['backward_end_s'] * 1e3:.1f} ms, then {sim['exposed_s'] * 1e3:.1f} ms "
                "of communication nobody hid")
    # alone, the simulation is the picture (solid); under a measurement it is the ghost
    events = list(sim["events"]) if measured else [{k: v for k, v in e.items() if k != "sim"}
                                                   for e in sim["events"]]
    if measured:
        b_end, tail = exposed(measured)
        takeaway += (f"<br>measured: backward ends at {b_end:.1f} ms, then {tail:.1f} ms (ghost ="
                     " simulation with the run's compute times; a measured bar ends when the "
                     "step waited for it)")
        events += measured
    fig = timeline_figure(events, title=title or f"Buckets of {bucket_mb:g} MB in {order} order, "
                          + ("measured over the simulation" if measured else "simulated"),
                          takeaway=takeaway, idle=False, ops=["F", "B", "all_reduce"])
    if measured:
        fig.update_layout(margin={"t": 110})
    return fig


def launched_during_backward(launch_log: list, total_grads: int) -> int:
    """How many buckets were launched before the last gradient of backward was ready."""
    return sum(1 for _, seen in launch_log if seen < total_grads)


def traffic_figure(measured: dict[str, float], formula: dict[str, float], unit: str = "Ψ"):
    """Measured traffic per configuration (bars) next to the formula (ghost bars)."""
    names = list(measured)
    fig = go.Figure([
        go.Bar(x=names, y=[formula[n] for n in names], name="formula",
               marker=style.estimate_marker(style.OLIVE),
               text=[f"{formula[n]:g}{unit}" for n in names], textposition="outside"),
        go.Bar(x=names, y=[measured[n] for n in names], name="measured (trace)",
               marker_color=style.OLIVE, width=0.4,
               text=[f"{measured[n]:.3f}{unit}" for n in names], textposition="inside")])
    style.frame(fig, "Bytes moved per rank per step", "measured from the trace, in units of "
                "Ψ = parameters × 4 bytes; padding explains the last digits",
                x="configuration", y=f"traffic ({unit})")
    fig.update_layout(barmode="overlay")
    return fig


def compression_figure(errors: dict):
    """Loss per step with each compression hook (see
    :func:`edu3d.course.ch02_data_parallel.compression_error`), uncompressed as the reference line."""
    fig = go.Figure()
    for i, (name, r) in enumerate(errors.items()):
        fig.add_trace(go.Scatter(
            x=list(range(1, len(r["losses"]) + 1)), y=r["losses"], mode="lines+markers",
            name=f"{name} (weights differ by {r['param_rel_diff']:.1e})",
            line={"color": style.BLACK if name == "none" else style.group_color(i),
                  "width": 3 if name == "none" else 1.5}))
    style.frame(fig, "Training with compressed gradients",
                "16-bit casts are indistinguishable; int8 and top-k trade accuracy for bytes",
                x="step", y="loss (nats)")
    return fig
