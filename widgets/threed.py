"""3D parallelism: the capstone's pictures and the knobs that redraw them.

After reading this file you should know how to read chapter 06's charts:

* :func:`timeline_3d` — **lane = rank** (all 8 of dp2-tp2-pp2), x = time since the shown
  step's first event. The compute lane is coloured by operation (forward blue, backward
  orange, optimizer vermillion; hatched grey = idle); the communication sub-lane under it is
  coloured by **axis**: TP's all-reduces (inside every forward and backward), PP's sends and
  receives (between them), DP/ZeRO's reduce-scatter and all-gather (at the end of the step).
* :func:`memory_per_rank` — bytes per rank stacked by category (parameters, gradients,
  optimizer state, activations), measured, with the estimate as a ghost marker.
* :class:`Controls` — sliders for dp, tp, pp, ZeRO stage, schedule and micro-batches redraw
  the *simulated* pipeline (:func:`edu3d.schedules.simulate.simulate`) and the per-rank
  memory estimate at once; "run it" launches the real run and draws it over the simulation.
  The figures come from plain functions (:func:`simulated_pipeline`, :func:`memory_estimate`),
  so a notebook without a frontend shows the default static figures.
"""

from __future__ import annotations

from edu3d.widgets import style
from edu3d.widgets.timeline import add_bars, idle_gaps, lanes

#: communication colours by axis, and the legend's words for them
AXIS_COLORS = {"tp": style.YELLOW, "pp": style.SEND, "dp": "#882255", "world": style.GREY}
AXIS_NAMES = {"tp": "TP all-reduce (tensor group)", "pp": "PP send/recv (pipeline group)",
              "dp": "DP/ZeRO reduce-scatter + all-gather", "world": "grad-norm all-reduce"}
MEMORY_COLORS = {"params": style.BLUE, "grads": style.ORANGE, "optimizer": style.GREEN,
                 "activations": style.PURPLE}
CATEGORIES = tuple(MEMORY_COLORS)
SIM_COSTS_US = {"F": 1000.0, "B": 2000.0, "I": 1000.0, "W": 1000.0, "p2p": 50.0}


# ---- the timeline of one step ------------------------------------------------------------------
def step_slice(events: list[dict], step: int) -> list[dict]:
    """The compute and comm events of ``step``, shifted so its first event starts at 0."""
    evs = [e for e in events if e.get("step") == step and e.get("lane") in ("compute", "comm")
           and "t1" in e]
    origin = min((e["t0"] for e in evs), default=0.0)
    return [{**e, "t0": e["t0"] - origin, "t1": e["t1"] - origin} for e in evs]


def timeline_3d(events: list[dict], step: int, *, title: str | None = None,
                takeaway: str | None = None):
    """Every rank's lanes for one step: compute by operation, communication by axis."""
    import plotly.graph_objects as go

    evs = step_slice(events, step)
    fig = go.Figure()
    if not evs:
        return style.frame(fig, title or f"3D step {step}", "no events recorded for this step",
                           x="time since the step's first event (ms)")
    where = lanes([e["rank"] for e in evs], {e["lane"] for e in evs})
    add_bars(fig, idle_gaps(evs), where, name="idle", color="rgba(0,0,0,0)",
             pattern=style.IDLE_PATTERN, text=False)
    compute_ops = list(dict.fromkeys(e["op"] for e in evs if e["lane"] == "compute"))
    names = {"F": "forward (F)", "B": "backward (B)", "I": "input grad (I)",
             "W": "weight grad (W)", "optimizer": "optimizer step"}
    for op in compute_ops:
        sel = [e for e in evs if e["lane"] == "compute" and e["op"] == op]
        add_bars(fig, sel, where, name=names.get(op, op), color=style.op_color(op))
    groups = list(dict.fromkeys(e.get("group") or "world" for e in evs if e["lane"] == "comm"))
    for g in sorted(groups, key=lambda g: list(AXIS_COLORS).index(g) if g in AXIS_COLORS else 9):
        sel = [e for e in evs if e["lane"] == "comm" and (e.get("group") or "world") == g]
        add_bars(fig, sel, where, name=AXIS_NAMES.get(g, f"{g} collective"),
                 color=AXIS_COLORS.get(g, style.GREY), text=False)
    style.frame(fig, title or f"All {len(set(e['rank'] for e in evs))} ranks, step {step}",
                takeaway or "TP's all-reduces sit inside every F and B, PP's sends between "
                "them, DP/ZeRO's reduce-scatter and all-gather at the end of the step.",
                x="time since the step's first event (ms)",
                height=max(300, 130 + 30 * len(where.tickvals)))
    fig.update_layout(barmode="overlay", bargap=0, hoverlabel={"align": "left"},
                      uniformtext={"minsize": 8, "mode": "hide"})
    fig.update_yaxes(tickvals=where.tickvals, ticktext=where.ticktext, range=where.extent[::-1],
                     showgrid=False, zeroline=False)
    end = max(e["t1"] for e in evs) / 1e3
    fig.update_xaxes(range=[0, end * 1.01 or 1.0])
    return fig


# ---- memory per rank ---------------------------------------------------------------------------
def memory_per_rank(measured: dict[int, dict], estimate: dict[int, dict] | None = None, *,
                    title: str = "Memory per rank", takeaway: str | None = None):
    """Stacked bars per rank (KiB): params, grads, optimizer state, activations; the
    estimate's total as a ghost diamond over each bar."""
    import plotly.graph_objects as go

    ranks = sorted(measured)
    x = [f"rank {r}" for r in ranks]
    fig = go.Figure()
    for cat in CATEGORIES:
        fig.add_bar(x=x, y=[measured[r].get(cat, 0) / 1024 for r in ranks], name=cat,
                    marker_color=MEMORY_COLORS[cat],
                    hovertemplate=f"{cat}: " + "%{y:.1f} KiB<extra>%{x}</extra>")
    if estimate:
        fig.add_scatter(x=x, y=[sum(estimate[r].get(c, 0) for c in CATEGORIES) / 1024
                                for r in ranks],
                        mode="markers", name="estimate (total)",
                        marker={"symbol": "diamond-open", "size": 14, "color": style.BLACK,
                                "line": {"width": 2}},
                        hovertemplate="estimate %{y:.1f} KiB<extra>%{x}</extra>")
    style.frame(fig, title, takeaway or "Each rank holds 1/tp of its stage; ZeRO-1 splits "
                "the optimizer state over dp.", x="rank", y="memory (KiB)")
    fig.update_layout(barmode="stack", height=380)
    return fig


# ---- the estimator behind the controls ---------------------------------------------------------
_COUNTS: dict[str, tuple] = {}


def _param_counts(config) -> tuple[tuple[str, int], ...]:
    """(serial name, numel) of every parameter of ``config``'s GPT (built once per config)."""
    from edu3d.model.gpt import GPT

    key = repr(config)
    if key not in _COUNTS:
        _COUNTS[key] = tuple((n, p.numel()) for n, p in GPT(config, seed=0).named_parameters())
    return _COUNTS[key]


def replicated(name: str) -> bool:
    """Parameters TP keeps whole on every rank: LayerNorms, the position embedding and the
    row-parallel layers' biases (added once, after the all-reduce)."""
    return (".ln" in name or name.startswith(("ln_f", "pos_emb"))
            or name.endswith("proj.bias"))


def stage_params(config, pp: int, vpp: int = 1, tp: int = 1) -> list[float]:
    """Parameters one rank holds of each global stage (uniform cut) with TP degree ``tp``:
    embeddings on the first stage, the final LayerNorm and LM head on the last."""
    from edu3d.schedules.partition import partition

    parts = partition(config, pp, vpp)
    out = [0.0] * len(parts)
    for name, n in _param_counts(config):
        n = n if replicated(name) else n / tp
        if name.startswith("blocks."):
            layer = int(name.split(".")[1])
            out[next(s for s, (a, b) in enumerate(parts) if a <= layer < b)] += n
        elif name.startswith(("ln_f", "lm_head")):
            out[-1] += n
        else:
            out[0] += n
    return out


def memory_estimate(config, dp: int, tp: int, pp: int, zero: int, m: int,
                    schedule: str = "1f1b", vpp: int = 1,
                    global_batch: int = 8) -> dict[int, dict]:
    """Estimated bytes per rank after a step: the planner's count
    (:mod:`edu3d.plan.estimate`, fp32 AdamW), exact for this GPT. A rank holds its stages'
    parameters, cut by tp except the replicated ones, with ZeRO sharding each unit's flat
    buffer (padded to a multiple of dp) over the dp ranks; its activations are what each
    layer of its stages saves per micro-batch, times the micro-batches the schedule keeps in
    flight (replayed)."""
    from edu3d.plan import estimate as plan_memory
    from edu3d.distributed.mesh import Layout
    from edu3d.model.shapes import spec_from_config

    layout = Layout(dp=dp, tp=tp, pp=pp, vpp=vpp)
    spec = spec_from_config(config)
    st = plan_memory.Setup(dp=dp, tp=tp, pp=pp, vpp=vpp, zero=zero, microbatches=m,
                           micro_batch=max(global_batch // (dp * m), 1), schedule=schedule)
    acts = plan_memory.activations_per_rank(spec, st)
    out = {}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        est = plan_memory.state_per_rank(spec, st, c.pp, c.dp, at="rest")
        est["activations"] = acts[c.pp]
        out[rank] = est
    return out


def simulate_schedule(pp: int, m: int, schedule: str, vpp: int = 1):
    from edu3d.schedules.actions import build
    from edu3d.schedules.simulate import Costs, simulate

    return simulate(build(schedule, pp, m, vpp), pp, Costs(**SIM_COSTS_US))


def simulated_pipeline(pp: int, m: int, schedule: str, vpp: int = 1, measured=None, *,
                     title: str | None = None):
    """The schedule simulated (F = 1 ms, B = 2 ms); with ``measured`` (pipeline events of one
    dp/tp coordinate, ranks renumbered 0..pp-1) the run is drawn over it instead."""
    from edu3d.widgets.pipeline import _add_schedule, compare_figure

    if measured:
        return compare_figure([{"name": schedule, "pp": pp, "m": m, "vpp": vpp,
                                "events": measured}],
                              title=title or f"{schedule}, pp={pp}, m={m}: measured over "
                              "the simulation", memory=False)
    import plotly.graph_objects as go
    from edu3d.schedules.simulate import bubble_formula

    sim = simulate_schedule(pp, m, schedule, vpp)
    evs = [{k: v for k, v in e.items() if k != "sim"} for e in sim.events]
    fig = go.Figure()
    where = _add_schedule(fig, evs, [], 1, list(range(pp)), show_legend=True)
    style.frame(fig, title or f"Simulated {schedule}: pp={pp}, m={m}"
                + (f", v={vpp}" if vpp > 1 else ""),
                f"bubble simulated {sim.bubble:.1%}, " + (
                    f"1F1B's formula {bubble_formula('1f1b', pp, m):.1%} (ZB-H1 has no "
                    "closed form: about a third of it)" if schedule == "zb-h1" else
                    f"formula {bubble_formula(schedule, pp, m, vpp):.1%}") + "; hatched = idle",
                x="time (ms, a forward = 1 ms, a backward = 2 ms)",
                height=max(240, 140 + 40 * len(where.tickvals)))
    fig.update_layout(barmode="overlay", bargap=0, uniformtext={"minsize": 8, "mode": "hide"})
    fig.update_yaxes(tickvals=where.tickvals, ticktext=where.ticktext,
                     range=where.extent[::-1], showgrid=False, zeroline=False)
    fig.update_xaxes(rangemode="tozero")
    return fig


def pipeline_view(events: list[dict], layout, dp: int = 0, tp: int = 0) -> list[dict]:
    """The events of the pipeline through (dp, tp), ranks renumbered by stage: what
    :func:`simulated_pipeline` draws over its simulation."""
    out = []
    for e in events:
        c = layout.coords(e["rank"])
        if c.dp == dp and c.tp == tp and (e["lane"] == "mem" or e["op"] in
                                           ("F", "B", "I", "W", "send", "recv")):
            out.append({**e, "rank": c.pp})
    return out


# ---- the controls ------------------------------------------------------------------------------
DEFAULT = {"dp": 2, "tp": 2, "pp": 2, "zero": 1, "schedule": "1f1b", "microbatches": 4}


class Controls:
    """Knobs for a 3D layout that redraw the simulated pipeline and the memory estimate.

    ``state`` holds the current choice; :meth:`redraw` (called by every widget) rebuilds
    ``pipeline_fig`` and ``memory_fig``; :meth:`run` launches the real run (world size at
    most 8) and draws it over the simulation. ``widget`` builds the ipywidgets box lazily.
    """

    def __init__(self, default: dict | None = None, config=None):
        from edu3d.course import lesson_args
        from edu3d.train.options import config_from_args

        self.state = {**DEFAULT, **(default or {})}
        self.config = config or config_from_args(lesson_args())
        self.message = ""
        self.result = None
        self._box = self._out = None
        self.redraw()

    @property
    def vpp(self) -> int:
        return 2 if self.state["schedule"] == "interleaved" else 1

    def problem(self) -> str | None:
        """Why the current choice cannot run (None if it can)."""
        from edu3d.distributed.mesh import Layout, LayoutError

        s = self.state
        try:
            Layout(dp=s["dp"], tp=s["tp"], pp=s["pp"], vpp=self.vpp).validate(
                config=self.config, global_batch=8, microbatches=s["microbatches"])
        except (LayoutError, ValueError) as exc:
            return str(exc)
        if s["schedule"] == "interleaved" and s["microbatches"] % s["pp"]:
            return "interleaved needs micro-batches that are a multiple of pp"
        return None

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        bad = self.problem()
        self.message = bad or ""
        if bad is None:
            self.pipeline_fig = simulated_pipeline(s["pp"], s["microbatches"], s["schedule"],
                                                 self.vpp)
            est = memory_estimate(self.config, s["dp"], s["tp"], s["pp"], s["zero"],
                                  s["microbatches"], s["schedule"], self.vpp)
            self.estimate = est
            self.memory_fig = memory_per_rank(
                {r: {k: v for k, v in e.items()} for r, e in est.items()},
                title=f"Memory per rank, estimated: dp={s['dp']} tp={s['tp']} pp={s['pp']} "
                      f"ZeRO-{s['zero']}",
                takeaway="params/tp per stage; ZeRO-1 divides the optimizer by dp, -2 also "
                         "the grads, -3 everything; activations x micro-batches in flight.")
        self._show()

    def run(self, timeout: float = 300):
        """Launch the real run of the current layout and draw it over the simulation."""
        from edu3d.course.ch06_3d_parallelism import capstone
        from edu3d.launch import launch
        from edu3d.distributed.mesh import Layout

        s = self.state
        layout = Layout(dp=s["dp"], tp=s["tp"], pp=s["pp"], vpp=self.vpp)
        if self.problem() or layout.world_size > 8:
            self.message = self.problem() or "the real run is limited to 8 ranks"
            self._show()
            return None
        self.message = f"running {layout.world_size} ranks ..."
        self._show()
        run = launch(capstone, layout.world_size, kwargs={
            "steps": 2, "zero": s["zero"], "microbatches": s["microbatches"],
            "schedule": s["schedule"], "vpp": self.vpp},
            layout=layout, timeout=timeout, echo=False)
        self.result = run
        events = run.events()
        self.pipeline_fig = simulated_pipeline(s["pp"], s["microbatches"], s["schedule"],
                                             self.vpp, pipeline_view(events, layout))
        self.memory_fig = memory_per_rank({r["rank"]: r["memory"] for r in run.results},
                                          self.estimate, title="Memory per rank, measured")
        self.message = f"ran {layout.world_size} ranks in {run.elapsed_s:.0f} s"
        self._show()
        return run

    # ---- ipywidgets (only when asked for) ------------------------------------------------------
    @property
    def widget(self):
        if self._box is None:
            import ipywidgets as w

            s = self.state

            def choices(values, key):
                return sorted({*values, s[key]})

            knobs = {
                "dp": w.Dropdown(options=choices([1, 2, 4, 8], "dp"), value=s["dp"],
                                 description="dp"),
                "tp": w.Dropdown(options=choices([1, 2, 4], "tp"), value=s["tp"],
                                 description="tp"),
                "pp": w.Dropdown(options=choices([1, 2, 4], "pp"), value=s["pp"],
                                 description="pp"),
                "zero": w.IntSlider(min=0, max=3, value=s["zero"], description="ZeRO"),
                "schedule": w.Dropdown(options=["gpipe", "1f1b", "interleaved", "zb-h1"],
                                       value=s["schedule"], description="schedule"),
                "microbatches": w.IntSlider(min=1, max=8, value=s["microbatches"],
                                            description="micro-batches"),
            }
            for key, knob in knobs.items():
                knob.observe(lambda ch, key=key: self.redraw(**{key: ch["new"]}), "value")
            button = w.Button(description="run it", button_style="primary")
            button.on_click(lambda _: self.run())
            self._out = w.Output()
            self._box = w.VBox([w.HBox(list(knobs.values())[:3]),
                                w.HBox(list(knobs.values())[3:] + [button]), self._out])
            self._box.add_class("edu3d-controls")  # what the browser test turns
            self._show()
        return self._box

    def _show(self) -> None:
        style.show_in(self._out, self.message, self.pipeline_fig, self.memory_fig)


def controls(default: dict | None = None) -> Controls:
    """The chapter's controls; display ``controls().widget`` in JupyterLab, or show the
    static ``pipeline_fig`` / ``memory_fig`` without a frontend."""
    return Controls(default)
