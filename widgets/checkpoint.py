"""Pictures of checkpoints and failures: who writes which numbers, what a reshard reads, a save
beside the training steps, a run recovering.

After reading this file you should understand how chapter 08's charts are drawn from what
runs left behind:

* :func:`owners` turns a checkpoint's manifest (every rank's piece placements,
  :mod:`edu3d.ckpt.reshard`) into a map of the full tensor saying which rank wrote each number;
  :func:`piece_map` draws it, :func:`reshard_map` draws a source and a target layout side by
  side, and :func:`reads` counts, for each rank of the target, how many numbers it takes
  from each rank of the source (the files it must open);
* :func:`save_timeline` puts a checkpoint's snapshot and its (background) write under each
  rank's training steps, from the run's trace events;
* :func:`recovery_curve` draws the recovered run's loss over the uninterrupted run's ghost,
  with the failure and the steps redone from the checkpoint marked;
* the chapter's knobs (the layouts, the tensor and its kind) are
  :mod:`edu3d.widgets.panels.ch08_checkpoints`.
"""

from __future__ import annotations

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from edu3d.ckpt import reshard
from edu3d.widgets import style


def layout_name(manifest: dict) -> str:
    lay = manifest["layout"]
    parts = [f"{k}{lay[k]}" for k in ("dp", "tp", "pp") if lay.get(k, 1) > 1] or ["serial"]
    return "-".join(parts) + (f" ZeRO-{lay['zero']}" if lay.get("zero") else "")


def tensors(manifest: dict, kind: str = "param") -> list[str]:
    """The tensor names a manifest holds pieces of, in the model's order of first appearance."""
    names: dict = {}
    for info in manifest["files"].values():
        for p in info["pieces"]:
            if p["kind"] == kind:
                names.setdefault(p["name"], None)
    return list(names)


def owners(manifest: dict, name: str, kind: str = "param") -> torch.Tensor:
    """A tensor of the full shape holding, for each number, the rank whose file holds it
    (-1: no file does, a hole)."""
    grid = None
    for info in manifest["files"].values():
        for place in info["pieces"]:
            if place["name"] != name or place["kind"] != kind:
                continue
            if grid is None:
                grid = torch.full(place["shape"], -1, dtype=torch.int32)
            lo, hi = place["flat"]
            reshard.write(grid, place, torch.full((hi - lo,), info["rank"], dtype=torch.int32))
    if grid is None:
        raise KeyError(f"the checkpoint holds no {kind} piece of {name}")
    return grid


def _as_2d(grid: torch.Tensor) -> torch.Tensor:
    return grid.reshape(1, -1) if grid.dim() == 1 else grid.reshape(grid.shape[0], -1)


def _heatmap(grid: torch.Tensor, ranks: list[int], name: str):
    grid2 = _as_2d(grid)
    n = max(ranks) + 1 if ranks else 1
    scale = []
    for r in range(n):  # a discrete colour per rank: flat steps of the scale
        c = style.group_color(r)
        scale += [[r / n, c], [(r + 1) / n, c]]
    return go.Heatmap(z=grid2.numpy().astype("int16"), zmin=0, zmax=n, colorscale=scale, showscale=False,
                      name=name, hovertemplate="row %{y}, column %{x}: rank %{z}<extra></extra>")


def _legend(fig, counts: dict[int, int], total: int, **where) -> None:
    for r, k in sorted(counts.items()):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers",
                                 marker={"symbol": "square", "size": 12,
                                         "color": style.group_color(r)},
                                 name=f"rank {r}: {k:,} of {total:,}", showlegend=True),
                      **where)


def _counts(grid: torch.Tensor) -> dict[int, int]:
    values, counts = torch.unique(grid, return_counts=True)
    return {int(v): int(c) for v, c in zip(values, counts) if v >= 0}


def piece_map(manifest: dict, name: str, kind: str = "param", *, title: str | None = None):
    """The full tensor ``name`` coloured by the rank that wrote each number."""
    grid = owners(manifest, name, kind)
    counts = _counts(grid)
    holes = int((grid < 0).sum())
    fig = go.Figure(_heatmap(grid, list(counts), name))
    _legend(fig, counts, grid.numel())
    shape = "x".join(map(str, grid.shape))
    takeaway = ("every number written once, by one rank" if not holes else
                f"{holes} numbers in no file: a shard is missing")
    style.frame(fig, title or f"{name} ({kind}, {shape}) in a {layout_name(manifest)} "
                f"checkpoint, step {manifest['step']}", takeaway,
                x="column (element index)", y="row (element index)", height=360)
    fig.update_yaxes(autorange="reversed")
    return fig


def reads(source: dict, target: dict, name: str, kind: str = "param") -> dict[int, dict[int, int]]:
    """``{target rank: {source rank: numbers}}``: what each rank of the target layout reads
    from each source rank's file to fill the pieces it writes in ``target``."""
    src = owners(source, name, kind)
    out: dict[int, dict[int, int]] = {}
    for info in target["files"].values():
        for place in info["pieces"]:
            if place["name"] != name or place["kind"] != kind:
                continue
            wanted = reshard.read(src, place)
            row = out.setdefault(info["rank"], {})
            for r, k in _counts(wanted).items():
                row[r] = row.get(r, 0) + k
    return dict(sorted(out.items()))


def reshard_map(source: dict, target: dict, name: str, kind: str = "param"):
    """``name`` as the source layout wrote it (left) and as the target layout holds it
    (right); the takeaway lists which source files each target rank opens."""
    src, dst = owners(source, name, kind), owners(target, name, kind)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.08,
                        subplot_titles=(f"saved by {layout_name(source)}",
                                        f"loaded by {layout_name(target)}"))
    fig.add_trace(_heatmap(src, list(_counts(src)), "source"), row=1, col=1)
    fig.add_trace(_heatmap(dst, list(_counts(dst)), "target"), row=1, col=2)
    _legend(fig, {r: k for r, k in _counts(src).items()} | _counts(dst), src.numel(),
            row=1, col=1)
    plan = reads(source, target, name, kind)
    said = "; ".join(f"rank {t} <- " + ", ".join(f"{s}" for s in row)
                     for t, row in plan.items())
    style.frame(fig, f"Resharding {name} ({kind}): {layout_name(source)} into "
                f"{layout_name(target)}", f"files each target rank opens: {said}", height=400)
    fig.update_layout(margin={"t": 110})  # the subplot titles sit under the takeaway
    for col in (1, 2):
        fig.update_xaxes(title_text="column (element index)", row=1, col=col)
        fig.update_yaxes(title_text="row (element index)", autorange="reversed", row=1, col=col)
    return fig


def save_timeline(events: list[dict], *, title: str | None = None):
    """Each rank's training steps (one bar per step, from its first to its last event) and,
    on a lane beneath, the checkpointer's ``ckpt_blocked`` (what the step waited: the
    snapshot, and the writes unless ``--async-save``) and ``ckpt_write`` (in the background
    under ``--async-save``), as :class:`edu3d.ckpt.checkpointer.Checkpointer` traces them."""
    real = [e for e in events if not e.get("sim")]
    t_zero = min(e["t0"] for e in real)
    steps: dict = {}
    for e in real:
        if "step" in e and not e["op"].startswith("ckpt"):
            key = (e["rank"], e["step"])
            a, b = steps.get(key, (e["t0"], e["t1"]))
            steps[key] = (min(a, e["t0"]), max(b, e["t1"]))
    ranks = sorted({r for r, _ in steps})
    fig = go.Figure()
    rows = {}
    for i, r in enumerate(ranks):
        rows[(r, "train")], rows[(r, "ckpt")] = f"rank {r} training", f"rank {r} checkpoint"
    colors = {"step": style.BLUE, "ckpt_blocked": style.VERMILLION, "ckpt_write": style.SKY}
    names = {"step": "training step", "ckpt_blocked": "save: the step waits (snapshot)",
             "ckpt_write": "save: written in the background"}
    bars = {k: ([], [], [], []) for k in colors}
    for (r, s), (a, b) in sorted(steps.items()):
        xs, base, ys, text = bars["step"]
        xs.append((b - a) / 1e3), base.append((a - t_zero) / 1e3), ys.append(rows[(r, "train")])
        text.append(f"step {s}")
    for e in real:
        if e["op"] in ("ckpt_blocked", "ckpt_write") and e["rank"] in ranks:
            xs, base, ys, text = bars[e["op"]]
            xs.append((e["t1"] - e["t0"]) / 1e3), base.append((e["t0"] - t_zero) / 1e3)
            ys.append(rows[(e["rank"], "ckpt")]), text.append(f"step {e.get('step', '')}")
    for op, (xs, base, ys, text) in bars.items():
        if xs:
            # only the steps are labelled: a save's bars are too short for upright text
            fig.add_trace(go.Bar(x=xs, base=base, y=ys, orientation="h", name=names[op],
                                 text=text if op == "step" else None, textposition="inside",
                                 insidetextanchor="middle", textangle=0,
                                 marker_color=colors[op], customdata=text,
                                 hovertemplate="%{customdata}: %{base:.1f} ms + %{x:.1f} ms"
                                               "<extra>" + names[op] + "</extra>"))
    order = [rows[(r, k)] for r in ranks for k in ("train", "ckpt")]
    waited = sum(bars["ckpt_blocked"][0]) / max(len(ranks), 1)
    wrote = sum(bars["ckpt_write"][0]) / max(len(ranks), 1)
    style.frame(fig, title or "Checkpoint saves beside the training steps",
                f"per rank, the steps waited {waited:.0f} ms for their saves; "
                f"{wrote:.0f} ms of writing ran beside them",
                x="time since the run's aligned start (ms)", height=140 + 40 * len(order))
    fig.update_layout(barmode="overlay", margin={"l": 140},
                      legend={"orientation": "h", "y": -0.25, "x": 0},
                      yaxis={"categoryorder": "array", "categoryarray": order[::-1]})
    return fig


def recovery_curve(clean: list[dict], recovered: list[dict], fault_step: int,
                   resumed_at: int, *, what: str = "rank 1 killed"):
    """The recovered run's loss (markers) over the uninterrupted run's (ghost line)."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[r["step"] for r in clean], y=[r["loss"] for r in clean],
                             mode="lines", name="uninterrupted run",
                             line={"color": style.GREY, "width": 10},
                             opacity=style.GHOST_OPACITY))
    fig.add_trace(go.Scatter(x=[r["step"] for r in recovered], y=[r["loss"] for r in recovered],
                             mode="markers", name="recovered run",
                             marker={"color": style.BLUE, "size": 9}))
    fig.add_vrect(x0=resumed_at + 0.5, x1=fault_step + 0.5, fillcolor=style.ORANGE,
                  opacity=0.15, line_width=0,
                  annotation_text=f"{what} at step {fault_step}; "
                                  + (f"step {fault_step}" if resumed_at + 1 == fault_step else
                                     f"steps {resumed_at + 1}-{fault_step}")
                                  + f" redone from the checkpoint of step {resumed_at}",
                  annotation_position="top left")
    same = [r["loss"] for r in recovered] == [r["loss"] for r in clean]
    style.frame(fig, "A rank dies, the run restarts from its last checkpoint",
                "the recovered losses lie on the uninterrupted run's, "
                + ("bit for bit" if same else "but NOT bit for bit"),
                x="step", y="loss (nats)", height=360)
    fig.update_xaxes(dtick=1)  # steps are whole numbers
    return fig
