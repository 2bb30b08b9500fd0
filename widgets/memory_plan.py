"""Chapter 07's planner picture: the bytes of every pipeline rank, against the GPU's memory.

After reading this file you should know how to read the charts:

* :func:`stage_bars` — **one bar per pipeline rank**, stacked by category: weights (blue),
  gradients (orange), optimizer state (green), activations (purple), communication buffers
  (sand). The dashed line is the GPU's usable memory; the title says whether the fullest
  rank fits. The planner's estimate is hatched (theory, as in every chart); with a
  measurement each rank gets a second bar beside it, the measured bytes, solid.
* :func:`zero_stages` — the model state per GPU under ZeRO stages 0-3 (the ZeRO paper's
  figure 1).

The chapter's knobs that redraw these bars are :mod:`edu3d.widgets.panels.ch07_memory`.
"""

from __future__ import annotations

import plotly.graph_objects as go

from edu3d.plan.fit import size_text
from edu3d.plan.formulas import zero_bytes
from edu3d.widgets import style

COLORS = {"params": style.BLUE, "grads": style.ORANGE, "optimizer": style.GREEN,
          "activations": style.PURPLE, "comm": style.SAND, "transient": style.GREY}
NAMES = {"params": "weights", "grads": "gradients", "optimizer": "optimizer state",
         "activations": "activations", "comm": "comm buffers",
         "transient": "loss-backward peak"}


def _unit(nbytes: float) -> tuple[str, float]:
    for name, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return name, size
    return "bytes", 1.0


def stage_bars(estimate: dict, measured: dict[int, dict] | None = None, *,
               gpu_mem_gb: float | None = None, usable: float = 0.9, title: str | None = None,
               takeaway: str | None = None):
    """Stacked bars per pipeline rank from a planner estimate (``per_stage``), hatched as
    theory is everywhere, with solid measured bars beside them when ``measured`` (pp rank ->
    bytes by category) is given."""
    rows = estimate["per_stage"]
    n = len(rows)
    x = [f"pp rank {r['pp_rank']}" + (" (first)" if r["pp_rank"] == 0 and n > 1 else "")
         + (" (last)" if r["pp_rank"] == n - 1 and n > 1 else "") for r in rows]
    top = max([estimate["total_bytes"]] + [sum(m.values()) for m in (measured or {}).values()])
    if gpu_mem_gb:
        top = max(top, usable * gpu_mem_gb * 1e9)
    unit, size = _unit(top)
    fig = go.Figure()
    groups = [("estimate", {r["pp_rank"]: r for r in rows})]
    if measured:
        groups.append(("measured", measured))
    for label, data in groups:
        base = [0.0] * n
        for cat in COLORS:
            ys = [data.get(r["pp_rank"], {}).get(cat, 0.0) / size for r in rows]
            if not any(ys):
                continue
            fig.add_bar(x=x, y=ys, base=list(base), name=f"{NAMES[cat]} ({label})",
                        offsetgroup=label,  # the planner's numbers read as theory, alone too
                        marker=style.estimate_marker(COLORS[cat]) if label == "estimate"
                        else style.measured_marker(COLORS[cat]),
                        legendgroup=cat, hovertemplate=f"{label} {NAMES[cat]}: "
                        "%{y:.3f} " + unit + "<extra>%{x}</extra>")
            base = [b + y for b, y in zip(base, ys)]
    verdict = ""
    if gpu_mem_gb:
        limit = usable * gpu_mem_gb * 1e9
        fits = estimate["total_bytes"] <= limit
        gpu = size_text(gpu_mem_gb * 1e9)
        verdict = f" — fits in {gpu}" if fits else f" — does NOT fit in {gpu}"
        fig.add_hline(y=limit / size, line={"dash": "dash", "color": style.BLACK},
                      annotation_text=f"usable: {usable:.0%} of {gpu}",
                      annotation_position="top left")
    style.frame(fig, (title or "Memory per pipeline rank") + verdict,
                takeaway or ("The first stage holds the embedding and the most micro-batches "
                             "in flight; the last the head and its logits." if n > 1 else
                             "One rank holds every layer: its weights, their gradients and "
                             "optimizer state, and the activations of the micro-batch in "
                             "flight."),
                x="pipeline rank", y=f"memory ({unit})")
    fig.update_layout(barmode="group", height=420)
    return fig


def zero_stages(psi: float, dp: int, *, gpu_mem_gb: float | None = None,
                bytes_per=(2, 2, 12), title: str | None = None):
    """Bytes per GPU of the model's state under ZeRO stages 0-3 over ``dp`` ranks (the ZeRO
    paper's figure 1: ``16Ψ``, ``4Ψ + KΨ/N``, ``2Ψ + (2+K)Ψ/N``, ``(4+K)Ψ/N``)."""
    rows = [zero_bytes(psi, dp, z, *bytes_per) for z in range(4)]
    x = ["no ZeRO", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    fig = go.Figure()
    for cat in ("params", "grads", "optimizer"):
        fig.add_bar(x=x, y=[r[cat] / 1e9 for r in rows], name=NAMES[cat],
                    marker_color=COLORS[cat],
                    hovertemplate=NAMES[cat] + ": %{y:.1f} GB<extra>%{x}</extra>")
    if gpu_mem_gb:
        fig.add_hline(y=gpu_mem_gb, line={"dash": "dash", "color": style.BLACK},
                      annotation_text=f"one GPU: {gpu_mem_gb:g} GB",
                      annotation_position="top right")
    style.frame(fig, title or f"{psi / 1e9:.2f} B parameters over dp={dp}: state per GPU",
                "Each stage shards one more category over the data-parallel ranks; the "
                "activations come on top.", x="ZeRO stage", y="memory per GPU (GB)")
    fig.update_layout(barmode="stack", height=400)
    return fig
