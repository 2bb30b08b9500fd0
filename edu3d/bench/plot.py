"""``edu3d bench plot FILE -o out.png``: one picture of the benchmarks a user kept.

After reading this file you should understand what each panel draws from the CSV that
``edu3d bench NAME --csv FILE`` appends to (:mod:`edu3d.bench.records`), and when it is left
out (a panel is drawn only when the file has its metric):

* **throughput per layout** (``tokens_per_s``): edu3d's tokens/s beside the reference's,
  one pair of bars per benchmark case, on a log scale (cases differ by orders of magnitude);
* **scaling with world size** (``tokens_per_s`` of a case measured at two or more world
  sizes): tokens/s against ranks, edu3d solid, the reference dashed;
* **communication share** (``comm_share_<group>``): edu3d's step as one bar of 100 %,
  stacked by the share each process group had an operation in flight, the rest of the step
  beside it (overlapped communication counts as communication: it is the time the group is
  busy, not the time lost);
* **ratio against PyTorch** (``step_s`` whose reference is one of PyTorch's implementations,
  its name mentioning torch): edu3d's step time over PyTorch's, with the 1.0 line: left of it
  edu3d is faster. Rows measured against a baseline of edu3d's own (``cp`` against data
  parallelism, ``ep`` against the dense model) stay in the CSV and in the throughput panel.

A case is a benchmark's row name at a layout; when the file holds several runs of the same
case, the last one appended is drawn (a file is a history; the picture is its latest state).
Drawing is matplotlib's Agg backend on a :class:`~matplotlib.figure.Figure` of its own: no
display and no global pyplot state.
"""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator

from edu3d.bench.records import COMM_SHARE, RecordsError, read

TITLES = {"tokens": "Throughput per layout (tokens/s, edu3d beside the reference)",
          "scaling": "Scaling with world size (tokens/s against ranks)",
          "comm": "Communication share of edu3d's step (rank 0, one traced step)",
          "ratio": "edu3d against PyTorch's implementation (step-time ratio; < 1: edu3d faster)"}
EDU3D, REFERENCE, REST = "#2a6fb0", "#9a9a9a", "#e4e4e4"
GROUP_COLOURS = ("#d9822b", "#3c9a5f", "#a64ca6", "#c23b3b", "#6b8e23", "#4b6ab5")
FORMATS = (".png", ".svg", ".pdf")
LEGEND = dict(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside, not over


def series(row: dict) -> str:
    """A case's name without its layout's words (``cp2 ring`` at ``cp2`` -> ``ring``), so the
    same case at another world size is the same series."""
    drop = set(row["layout"].split("-")) | {row["layout"]}
    words = [w for w in row["case"].split() if w not in drop]
    return " ".join(words) or row["case"]


def label(row: dict) -> str:
    """``layout · benchmark · case`` (the world size added when the layout does not say it)."""
    ranks = "" if str(row["world_size"]) in row["layout"] else f" ({row['world_size']} ranks)"
    return f"{row['layout']}{ranks} · {row['benchmark']} · {series(row)}"


def readable(value: float, _=None) -> str:
    """A tick label people read: 850, 1.5k, 12k, 3.2M."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def log_axis(axis) -> None:
    """A log scale with 1-2-5 ticks labelled in plain numbers (not powers of ten)."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(readable))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def is_pytorch(reference: str) -> bool:
    """Whether a reference is PyTorch's own implementation (its name says torch)."""
    return "torch" in reference.lower()


def latest(rows: list[dict]) -> list[dict]:
    """The last row appended of each (benchmark, case, layout, world size, metric)."""
    last = {}
    for r in rows:
        last[(r["benchmark"], r["case"], r["layout"], r["world_size"], r["metric"])] = r
    return sorted(last.values(), key=lambda r: (r["benchmark"], r["world_size"], r["case"]))


def panels(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows of each panel the file has data for (panel names as :data:`TITLES`)."""
    rows = latest(rows)
    tokens = [r for r in rows if r["metric"] == "tokens_per_s"]
    sizes: dict[tuple, set] = {}
    for r in tokens:
        sizes.setdefault((r["benchmark"], series(r)), set()).add(r["world_size"])
    found = {
        "tokens": tokens,
        "scaling": [r for r in tokens if len(sizes[(r["benchmark"], series(r))]) > 1],
        "comm": [r for r in rows if r["metric"].startswith(COMM_SHARE)],
        "ratio": [r for r in rows if r["metric"] == "step_s" and r["ratio"] is not None
                  and is_pytorch(r["reference"])]}
    return {k: v for k, v in found.items() if v}


def draw_tokens(ax, rows: list[dict]) -> None:
    labels = [label(r) for r in rows]
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [r["value"] for r in rows], height=0.4, color=EDU3D,
            label="edu3d")
    refs = [r["reference_value"] or 0 for r in rows]
    ax.barh([y + 0.2 for y in ys], refs, height=0.4, color=REFERENCE,
            label="reference: PyTorch's\n(cp, ep: edu3d's dp, dense)")
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    log_axis(ax.xaxis)
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlabel("tokens/s (log scale; higher is faster)")
    ax.legend(**LEGEND)


def draw_scaling(ax, rows: list[dict]) -> None:
    lines: dict[tuple, list[dict]] = {}
    for r in rows:
        lines.setdefault((r["benchmark"], series(r)), []).append(r)
    for i, ((bench, name), pts) in enumerate(sorted(lines.items())):
        pts.sort(key=lambda r: r["world_size"])
        colour = GROUP_COLOURS[i % len(GROUP_COLOURS)]
        xs = [r["world_size"] for r in pts]
        ax.plot(xs, [r["value"] for r in pts], "o-", color=colour, label=f"{bench} · {name}")
        refs = [(x, r["reference_value"]) for x, r in zip(xs, pts) if r["reference_value"]]
        if refs:
            ax.plot(*zip(*refs), "s--", color=colour, alpha=0.6,
                    label=f"{bench} · {name} (reference)")
    sizes = sorted({r["world_size"] for r in rows})
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_yscale("log")
    log_axis(ax.yaxis)
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("tokens/s (log scale)")
    ax.legend(**LEGEND)
    ax.grid(alpha=0.3)


def draw_comm(ax, rows: list[dict]) -> None:
    bars: dict[str, dict[str, float]] = {}
    for r in rows:
        bars.setdefault(label(r), {})[r["metric"].removeprefix(COMM_SHARE)] = r["value"]
    groups = sorted({g for shares in bars.values() for g in shares})
    names = list(bars)
    ys = list(range(len(names)))
    left = [0.0] * len(names)
    for i, g in enumerate(groups):
        widths = [100 * bars[n].get(g, 0.0) for n in names]
        ax.barh(ys, widths, left=left, color=GROUP_COLOURS[i % len(GROUP_COLOURS)],
                label=f"{g} group in flight")
        left = [a + b for a, b in zip(left, widths)]
    rest = [max(0.0, 100 - a) for a in left]
    ax.barh(ys, rest, left=left, color=REST, label="rest of the step")
    ax.set_yticks(ys, names)
    for y, used in enumerate(left):
        ax.text(min(used, 100) + 1, y, f"{used:.0f} %", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(100, *left) + 12)
    ax.set_xlabel("% of one edu3d step (time with an operation of the group in flight)")
    ax.legend(**LEGEND)


def draw_ratio(ax, rows: list[dict]) -> None:
    ratios = [r["ratio"] for r in rows]
    ys = list(range(len(rows)))
    ax.barh(ys, ratios, color=[EDU3D if q <= 1 else "#d9822b" for q in ratios])
    ax.set_yticks(ys, [label(r) for r in rows])
    ax.axvline(1.0, color="black", linewidth=1.2, linestyle="--",
               label="1.0: as fast as PyTorch")
    for y, q in enumerate(ratios):
        ax.text(q, y, f" {q:.2f}", va="center", fontsize=8,
                bbox=dict(facecolor="white", edgecolor="none", pad=0.3, alpha=0.8))
    ax.invert_yaxis()
    ax.set_xlim(0, max(1.25, max(ratios) * 1.15))
    ax.set_xlabel("edu3d step time / PyTorch's step time (lower is faster)")
    ax.legend(**LEGEND)


DRAW = {"tokens": draw_tokens, "scaling": draw_scaling, "comm": draw_comm, "ratio": draw_ratio}


def figure(rows: list[dict], source: str = "") -> Figure:
    """The figure of the CSV's rows: one subplot per panel with data, titled by
    :data:`TITLES`. Raises :class:`~edu3d.bench.records.RecordsError` when nothing is
    drawable."""
    found = panels(rows)
    if not found:
        raise RecordsError(f"{source or 'the CSV'}: nothing to draw (no tokens_per_s, "
                           f"{COMM_SHARE}<group> or step_s with a reference)")
    heights = [2.6 if k == "scaling" else 0.9 + 0.32 * len({label(r) for r in v})
               for k, v in found.items()]
    fig = Figure(figsize=(11, sum(heights) + 1.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(found), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, (kind, panel_rows) in zip(axes, found.items()):
        DRAW[kind](ax, panel_rows)
        ax.set_title(TITLES[kind], fontsize=11)
        ax.tick_params(axis="y", labelsize=8)
    machines = sorted({r["machine"] for r in rows})
    commits = sorted({r["git_commit"] for r in rows})
    fig.suptitle(f"edu3d bench {source}, machine {'; '.join(machines)}\n"
                 f"torch {', '.join(sorted({r['torch_version'] for r in rows}))}, "
                 f"commit {', '.join(commits)}; latest run of each case", fontsize=10)
    return fig


def draw(csv_path: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Draw the CSV at ``csv_path`` into ``out`` (.png, .svg or .pdf); the panels' titles."""
    out = Path(out)
    if out.suffix.lower() not in FORMATS:
        raise RecordsError(f"-o {out}: must end in {', '.join(FORMATS)}")
    if not out.parent.is_dir():
        raise RecordsError(f"-o {out}: folder {out.parent} does not exist; create it first")
    fig = figure(read(csv_path), Path(csv_path).name)
    fig.savefig(out, dpi=80, pil_kwargs={"optimize": True} if out.suffix.lower() == ".png" else None)
    return [ax.get_title() for ax in fig.axes]
