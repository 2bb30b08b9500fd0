"""The 3D mesh as a cube of ranks, with the groups the ranks really formed.

After reading this file you should be able to look at a layout ``Layout(dp, tp, pp)`` and see:

* every rank as a point at its coordinates (x = tp, y = dp, z = pp), labelled with its global
  rank: TP varies fastest, so TP partners are neighbouring rank numbers, PP partners the
  farthest apart;
* the groups along one dimension as coloured lines joining their members (each rank takes
  its group's colour): a TP, DP or PP group is a line along that axis, a model-parallel
  (MP = tp x pp) group is a plane at one dp coordinate. A dropdown switches between the
  dimensions;
* under HSDP (``hsdp=R`` replica groups) the dp coordinate splits in two: the y axis is the
  rank's place inside its replica group (the *shard* coordinate) and the z axis stacks the
  replica groups (inside each pipeline stage), so a **shard** group (ZeRO shards over it) is
  a line along y and a **replicate** group (the ranks holding the same shard, which
  all-reduce it) a line along z.

The cube is drawn from a *report*: what each rank of a live run said about itself (its
coordinates, and the members of each of its groups as proven by an all-gather over that
group, see :func:`edu3d.course.ch00_launching_ranks.mesh_report`). Without a report it draws what the layout
predicts; the title says which. With a report, the prediction is drawn as grey rings
around where each rank should sit, and the title counts how many groups agree
(:func:`agreement`).
"""

from __future__ import annotations

import plotly.graph_objects as go

from edu3d.config.layout import Layout
from edu3d.widgets import style

DIMS = ("tp", "dp", "pp", "mp")
HSDP_DIMS = ("shard", "replicate")
DIM_NAMES = {"tp": "TP groups", "dp": "DP groups", "pp": "PP groups",
             "mp": "MP groups (tp x pp)", "shard": "HSDP shard groups",
             "replicate": "HSDP replicate groups"}


def dims_of(hsdp: int = 1, dim: str = "tp") -> tuple[str, ...]:
    """The dimensions drawn: HSDP's two groups too under replica groups (or when asked)."""
    return DIMS + (HSDP_DIMS if hsdp > 1 or dim in HSDP_DIMS else ())


def predicted_report(layout: Layout, hsdp: int = 1, dims: tuple = DIMS) -> list[dict]:
    """What :func:`edu3d.course.ch00_launching_ranks.mesh_report` would return on every rank,
    from the layout alone (``dims``: the groups listed, under ``hsdp`` replica groups)."""
    return [{"rank": r, "coords": layout.coords(r)._asdict(),
             "groups": {d: layout.group_of(r, d, hsdp) for d in dims}}
            for r in range(layout.world_size)]


def groups_from(report: list[dict], dim: str) -> list[list[int]]:
    """The distinct groups along ``dim`` that the ranks reported, sorted by first member."""
    return sorted({tuple(r["groups"][dim]) for r in report}, key=lambda g: (g[0], g))


def agreement(layout: Layout, report: list[dict], hsdp: int = 1,
              dims: tuple = DIMS) -> tuple[int, int]:
    """(predicted groups whose every member reported exactly that group, groups predicted),
    over every dimension: equal numbers mean the live groups are exactly the formula's."""
    said = {r["rank"]: r["groups"] for r in report}
    same = total = 0
    for d in dims:
        for members in groups_from(predicted_report(layout, hsdp, dims), d):
            total += 1
            same += all(list(said.get(m, {}).get(d, [])) == list(members) for m in members)
    return same, total


def _neighbours(pa: tuple, pb: tuple, points: list[tuple]) -> bool:
    """Whether ``pa`` and ``pb`` differ along one axis with no other point between them."""
    axes = [k for k in range(3) if pa[k] != pb[k]]
    if len(axes) != 1:
        return False
    k = axes[0]
    lo, hi = sorted((pa[k], pb[k]))
    return not any(lo < c[k] < hi and all(c[j] == pa[j] for j in range(3) if j != k)
                   for c in points)


def _edges(members: list[int], pos: dict) -> tuple[list, list, list]:
    """Line segments between neighbouring members (a line for 1D groups, a grid for MP
    planes), separated by ``None`` so one trace draws them all."""
    xs, ys, zs = [], [], []
    points = [pos[m] for m in members]
    for i, a in enumerate(members):
        for b in members[i + 1:]:
            pa, pb = pos[a], pos[b]
            if _neighbours(pa, pb, points):
                for p in (pa, pb):
                    xs.append(p[0])
                    ys.append(p[1])
                    zs.append(p[2])
                xs.append(None)
                ys.append(None)
                zs.append(None)
    return xs, ys, zs


def _takeaway(layout: Layout, dim: str) -> str:
    if dim == "tp":
        return "TP partners are neighbouring ranks (stride 1): they talk every layer."
    if dim == "dp":
        return (f"DP partners are {layout.tp} rank(s) apart (stride tp): they all-reduce "
                f"gradients once per step.")
    if dim == "pp":
        return (f"PP partners are {layout.tp * layout.dp} rank(s) apart (stride tp*dp): "
                f"they pass activations stage to stage.")
    if dim == "shard":
        return "ZeRO shards within a replica group (y): gathers and reduce-scatters stay there."
    if dim == "replicate":
        return ("The ranks holding the same shard across the replica groups (z): one "
                "all-reduce of the gradient shard per step.")
    return "An MP group holds one whole model replica: all tp x pp ranks with the same dp."


def mesh_figure(layout: Layout, report: list[dict] | None = None, *, dim: str = "tp",
                title: str | None = None, hsdp: int = 1):
    """The dp x tp x pp cube with its groups; ``dim`` is the dimension shown first; under
    ``hsdp`` replica groups, the dp axis split into shard (y) and replica (z) coordinates.

    ``report``: per-rank dicts ``{"rank", "coords": {"pp","dp","tp"}, "groups": {"tp": [...],
    "dp": [...], "pp": [...], "mp": [...]}}`` as returned by a live run of
    :func:`edu3d.course.ch00_launching_ranks.mesh_report` (``RunResult.results``).
    """
    dims = dims_of(hsdp, dim)
    if dim not in dims:
        raise ValueError(f"dim {dim!r} must be one of {', '.join(dims)}")
    live = report is not None
    report = sorted(report if live else predicted_report(layout, hsdp, dims),
                    key=lambda r: r["rank"])
    if len(report) != layout.world_size:
        raise ValueError(f"the report has {len(report)} ranks but {layout} has "
                         f"{layout.world_size}; pass the results of a run with this layout")
    shard = layout.hsdp_sizes(hsdp)[0] // layout.cp  # dp ranks of one replica group

    def where(c: dict) -> tuple:  # (tp, shard coordinate, pp x replica group)
        return c["tp"], c["dp"] % shard, c["pp"] * hsdp + c["dp"] // shard

    pos = {r["rank"]: where(r["coords"]) for r in report}

    fig = go.Figure()
    owner, line_colors = [], []  # per group trace: its dimension and colour
    rank_colors = {}  # dim -> colour of each rank's group along dim (for the rank markers)
    size = max(8, 20 - 2 * max(layout.shape))
    if live:  # the prediction as grey rings around where each rank should sit
        predicted = {p["rank"]: p for p in predicted_report(layout, hsdp, dims)}
        rings = [where(p["coords"]) for p in predicted.values()]
        for d in dims:
            fig.add_trace(go.Scatter3d(
                x=[c[0] for c in rings], y=[c[1] for c in rings], z=[c[2] for c in rings],
                mode="markers",
                name="predicted (grey rings)",
                marker={"symbol": "circle-open", "size": size + 14,
                        "color": style.rgba(style.GREY, 0.8), "line": {"width": 4}},
                hovertext=[f"predicted: rank {r} in {d.upper()} group {p['groups'][d]}"
                           for r, p in predicted.items()], hoverinfo="text", visible=d == dim))
            owner.append(d)
            line_colors.append(style.rgba(style.GREY, 0.8))
    for d in dims:
        rank_colors[d] = [None] * len(report)
        for i, members in enumerate(groups_from(report, d)):
            color = style.group_color(i)
            for m in members:
                rank_colors[d][m] = color
            xs, ys, zs = _edges(list(members), pos)
            fig.add_trace(go.Scatter3d(
                x=xs, y=ys, z=zs, mode="lines", name=f"{d.upper()} group {i}: {list(members)}",
                line={"color": color, "width": 10}, hoverinfo="name", visible=d == dim))
            owner.append(d)
            line_colors.append(color)

    hover = [f"<b>rank {r['rank']}</b><br>pp={r['coords']['pp']} dp={r['coords']['dp']} "
             f"tp={r['coords']['tp']}<br>" +
             "<br>".join(f"{d.upper()} {r['groups'][d]}" for d in dims) for r in report]
    fig.add_trace(go.Scatter3d(
        x=[pos[r["rank"]][0] for r in report], y=[pos[r["rank"]][1] for r in report],
        z=[pos[r["rank"]][2] for r in report], mode="markers",
        text=[str(r["rank"]) for r in report], name="ranks", showlegend=False,
        marker={"size": size, "color": rank_colors[dim],
                "line": {"color": "#333333", "width": 2}},
        hovertext=hover, hoverinfo="text"))
    owner.append(None)

    if live:
        same, total = agreement(layout, report, hsdp, dims)
        source = (f"reported by the live ranks, {same} of {total} as predicted (grey rings)"
                  if same == total else f"reported by the live ranks: only {same} of {total} "
                  "as predicted (grey rings)")
    else:
        source = "predicted from the layout"
    head = title or (f"{layout.world_size} ranks as {layout}"
                     + (f", {hsdp} replica groups" if hsdp > 1 else "") + f": groups {source}")

    def view(d):
        visible = [o is None or o == d for o in owner]
        # restyle takes one value per trace: group traces keep their colour, the rank
        # markers (last trace) take the colour of their group along d
        colors = [*line_colors, rank_colors[d]]
        return {"label": DIM_NAMES[d], "method": "update",
                "args": [{"visible": visible, "marker.color": colors},
                         {"title.text": style.title_text(head, _takeaway(layout, d))}]}

    style.frame(fig, head, _takeaway(layout, dim), height=560)
    split = hsdp > 1 or dim in HSDP_DIMS
    axis = {"x": ("tp", layout.tp), "y": ("dp shard" if split else "dp", shard),
            "z": ("pp x replica group" if split and layout.pp > 1 else
                  "replica group" if split else "pp", layout.pp * hsdp)}
    fig.update_layout(
        scene={f"{a}axis": {"title": {"text": f"{label} coordinate"},
                            "tickvals": list(range(n)), "range": [-0.4, n - 0.6]}
               for a, (label, n) in axis.items()}
        # an eye direction parallel to no cube diagonal, so no two ranks hide each other
        | {"aspectmode": "cube",
           # rank numbers as scene annotations: drawn over the 3D scene, never hidden by it
           "annotations": [{"x": p[0], "y": p[1], "z": p[2], "text": f"<b>{rank}</b>",
                            "showarrow": False, "font": {"color": "white", "size": 13}}
                           for rank, p in pos.items()],
           "camera": {"eye": {"x": 2.0, "y": -1.0, "z": 0.6}}},
        updatemenus=[{"type": "dropdown", "buttons": [view(d) for d in dims],
                      "active": dims.index(dim), "x": 0.0, "xanchor": "left",
                      "y": 1.0, "yanchor": "top"}],
        legend={"title": {"text": "groups"}},
    )
    return fig
