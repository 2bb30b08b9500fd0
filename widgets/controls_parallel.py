"""Control panels for chapters 03 (ZeRO), 04 (tensor parallelism) and 05 (pipelines).

After reading this file you should know what each panel's knobs change and what its button
measures. Every panel follows :class:`edu3d.widgets.threed.Controls`: a ``state`` dict,
:meth:`redraw` rebuilding plain plotly figures from a formula or a simulation at once, a
:meth:`run` that launches the real ranks (:func:`edu3d.launch.api.launch`) and draws the
measurement over the prediction, and a lazily built ``widget``. Without a frontend the
chapter shows the default figures (``ctl.figures``).

* :class:`ZeroControls` — stage and N: the sharding map, the memory per rank (the paper's
  formula as a ghost, the planner's exact count solid) and the traffic per step (2Ψ, 3Ψ) for
  all four stages, the chosen one marked; "run it" trains at that stage on N ranks and adds
  the measured bars.
* :class:`TPControls` — tp, split and SP: each rank's shards of one ``X·W`` (cut here as the
  ranks will cut them), one layer's collectives (count and bytes per rank on a ring) and its
  activation memory per rank; "run it" runs the real layer on tp ranks.
* :class:`PipelineControls` — schedule, pp, m and vpp: the simulated Gantt with the bubble
  formula beside the simulated bubble, and the bubble against m; a setting that cannot run
  shows why instead of a figure; "run it" runs the live pipeline and draws it over the
  simulation.
"""

from __future__ import annotations

import abc

from edu3d.course import controls_parallel as cp
from edu3d.widgets import style

CAT_COLORS = {"params": style.BLUE, "grads": style.ORANGE, "optimizer": style.VERMILLION}
OP_NAMES = {"all_reduce": "all-reduce", "all_gather": "all-gather",
            "reduce_scatter": "reduce-scatter"}
KiB, MB = 1024, 1e6


class _Panel(abc.ABC):
    """The shared machinery: knobs -> :meth:`redraw`, a button -> :meth:`run`, one Output."""

    title = ""
    knob_rows: tuple = ()  # rows of knob names, in display order (the first is a Dropdown)

    def __init__(self):
        self.message = ""
        self.result = None
        self.figures: tuple = ()
        self._box = self._out = None
        self._knobs: dict = {}
        self._syncing = False

    @abc.abstractmethod
    def knobs(self, w) -> dict:
        """``{state key: ipywidget}`` in display order."""

    @abc.abstractmethod
    def redraw(self, **changes) -> None:
        """Apply ``changes`` to the state and redraw the figures at once (no launch)."""

    @abc.abstractmethod
    def run(self, timeout: float = 300):
        """Launch the real ranks for the current state and draw the measurement."""

    def _launch(self, target, nprocs: int, **kw):
        """Launch ``target``; a failed run becomes the panel's message (None returned)."""
        from edu3d.launch.api import LaunchError, launch

        try:
            return launch(target, nprocs, echo=False, progress=False, **kw)
        except LaunchError as err:
            self.message = f"the run failed: {str(err)[:500]}"
            self._show()
            return None

    @property
    def widget(self):
        if self._box is None:
            import ipywidgets as w

            knobs = self._knobs = self.knobs(w)
            for key, knob in knobs.items():
                knob.observe(lambda ch, key=key: self._changed(key, ch["new"]), "value")
            button = w.Button(description="run it", button_style="primary",
                              tooltip="launch the real ranks and draw them over the theory")
            button.on_click(lambda _: self.run())
            rows = [w.HBox([knobs[k] for k in row]) for row in self.knob_rows]
            rows[-1].children = (*rows[-1].children, button)
            self._out = w.Output()
            self._box = w.VBox([w.HTML(f"<b>{self.title}</b>"), *rows, self._out])
            self._box.add_class("edu3d-controls")
            self._show()
        return self._box

    def _changed(self, key: str, value) -> None:
        if not self._syncing:
            self.redraw(**{key: value})

    def _sync_knobs(self) -> None:
        style.sync_knobs(self)

    def _show(self) -> None:
        style.show_in(self._out, self.message, *self.figures)


def _choices(values, current):
    return sorted({*values, current})


# ---- chapter 03: ZeRO --------------------------------------------------------------------------
def zero_memory_figure(pred: dict, measured: dict | None = None):
    """Bytes per rank by category for stages 0-3 at N ranks: formula (ghost), the planner's
    exact count (solid), and a run's measurement (rank 0) at its stage."""
    import plotly.graph_objects as go

    n, chosen, psi = pred["n"], pred["stage"], pred["psi"]
    x = [f"<b>stage {s} ◀</b>" if s == chosen else f"stage {s}" for s in range(4)]
    fig = go.Figure()
    for c in CAT_COLORS:
        fig.add_bar(x=x, y=[pred["formula"][s][c] / MB for s in range(4)],
                    name=f"{c} (formula)", marker_color=CAT_COLORS[c],
                    opacity=style.GHOST_OPACITY, offsetgroup="formula", legendgroup=c,
                    hovertemplate=f"{c}, formula: " + "%{y:.3f} MB<extra>%{x}</extra>")
        fig.add_bar(x=x, y=[pred["estimate"][s][c] / MB for s in range(4)],
                    name=f"{c} (planner)", marker_color=CAT_COLORS[c], offsetgroup="planner",
                    legendgroup=c,
                    hovertemplate=f"{c}, planner: " + "%{y:.3f} MB<extra>%{x}</extra>")
    f = pred["formula"][chosen]["total"]
    e = pred["estimate"][chosen]["total"]
    line = (f"ZeRO-{chosen}: {cp.zero_formula_text(chosen)} = {f / MB:.3f} MB; planner "
            f"{e / MB:.3f} MB (padding, step counters)")
    if measured:
        got = measured["memory"][0]
        xm = [x[measured["stage"]]]
        for c in CAT_COLORS:
            fig.add_bar(x=xm, y=[got[c] / MB], name=f"{c} (measured, rank 0)",
                        marker={"color": CAT_COLORS[c], "pattern": {"shape": "x"}},
                        offsetgroup="measured", legendgroup=c,
                        hovertemplate=f"{c}, measured: " + "%{y:.3f} MB<extra>%{x}</extra>")
        totals = [m["total"] for m in measured["memory"].values()]
        line += (f"; measured {got['total'] / MB:.3f} MB "
                 f"(x {got['total'] / pred['formula'][measured['stage']]['total']:.4f} formula)"
                 + (f", the {len(totals)} ranks within {max(totals) - min(totals):,} bytes"
                    if len(totals) > 1 else ""))
    style.frame(fig, f"Memory per rank, N = {n} ranks, Ψ = {psi:,} parameters (fp32 Adam)",
                line, x="ZeRO stage (◀ = chosen)", y="memory per rank (MB)", height=430)
    fig.update_layout(barmode="stack", legend={"font": {"size": 11}})
    return fig


def zero_traffic_figure(pred: dict, measured: dict | None = None):
    """Bytes one rank moves per step for stages 0-3 (the paper's count: 2Ψ, 2Ψ, 2Ψ, 3Ψ in
    4-byte parameters), and a run's measurement at its stage."""
    import plotly.graph_objects as go

    chosen, psi = pred["stage"], pred["psi"]
    # the formula's value in the tick label: a ghost bar's own text would fade with it
    x = [f"<b>stage {s} ◀</b><br>{cp.ZERO_TRAFFIC_PSI[s]}Ψ" if s == chosen
         else f"stage {s}<br>{cp.ZERO_TRAFFIC_PSI[s]}Ψ" for s in range(4)]
    fig = go.Figure(go.Bar(
        x=x, y=[pred["traffic"][s] / MB for s in range(4)], name="formula",
        marker_color=style.OLIVE, opacity=style.GHOST_OPACITY + 0.05, offsetgroup="formula",
        customdata=[cp.ZERO_COLLECTIVES[s] for s in range(4)],
        hovertemplate="%{customdata}: %{y:.3f} MB<extra>%{x}</extra>"))
    line = f"ZeRO-{chosen}: {cp.ZERO_COLLECTIVES[chosen]} = {cp.ZERO_TRAFFIC_PSI[chosen]}Ψ"
    if measured:
        got = measured["traffic"]
        fig.add_bar(x=[x[measured["stage"]]], y=[got / MB], name="measured (trace, rank 0)",
                    marker_color=style.OLIVE, offsetgroup="measured",
                    text=[f"{got / (4 * psi):.3f}Ψ"], textposition="outside")
        line += f"; measured {got / (4 * psi):.3f}Ψ (padding: the last digits)"
    style.frame(fig, f"Traffic per rank per step, Ψ = {psi:,} parameters x 4 bytes", line,
                x="ZeRO stage (◀ = chosen)", y="bytes per step (MB)", height=360)
    fig.update_yaxes(range=[0, max(pred["traffic"].values()) / MB * 1.25])
    return fig


def zero_sharding_figure(pred: dict, units=None):
    """The sharding map at the chosen stage (the panel's dropdown replaces the figure's)."""
    from edu3d.widgets.zero import sharding_map_figure

    return sharding_map_figure(units or pred["units"], pred["n"], pred["stage"], menu=False)


class ZeroControls(_Panel):
    """Chapter 03: ZeRO stage and the number of data-parallel ranks N."""

    title = "ZeRO: choose a stage and N; 'run it' trains 2 steps on N ranks"
    knob_rows = (("stage", "n"),)
    N_CHOICES = (2, 4, 8)

    def __init__(self, stage: int = 1, n: int = 4, config=None, steps: int = 2):
        super().__init__()
        self.config = config or cp.course_config()
        self.steps = steps
        self.state = {"stage": stage, "n": n}
        self.redraw()

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        self.message = ""
        self.prediction = cp.zero_prediction(self.config, s["n"], s["stage"])
        self.sharding_fig = zero_sharding_figure(self.prediction)
        self.memory_fig = zero_memory_figure(self.prediction)
        self.traffic_fig = zero_traffic_figure(self.prediction)
        self.figures = (self.sharding_fig, self.memory_fig, self.traffic_fig)
        self._show()

    def run(self, timeout: float = 300):
        """Train ``steps`` steps at the chosen stage on N ranks (and the serial model on rank
        0) and draw the measured memory and traffic over the prediction."""
        from edu3d.course import ch02_data_parallel as dp

        s = self.state
        if s["n"] > 8:
            self.message = "the real run is limited to 8 ranks on this machine"
            self._show()
            return None
        self.message = (f"running ZeRO-{s['stage']} on {s['n']} ranks, {self.steps} steps "
                        "(and the serial model on rank 0) ...")
        self._show()
        run = self._launch(dp.compare_versions, s["n"], args=(cp.zero_versions(s["stage"]),),
                           kwargs={"steps": self.steps, "global_batch": 16}, timeout=timeout)
        if run is None:
            return None
        self.result = cp.zero_measured(run, s["stage"], self.steps)
        m = self.result
        self.sharding_fig = zero_sharding_figure(self.prediction, m["units"])
        self.memory_fig = zero_memory_figure(self.prediction, m)
        self.traffic_fig = zero_traffic_figure(self.prediction, m)
        self.figures = (self.sharding_fig, self.memory_fig, self.traffic_fig)
        self.message = (f"ran ZeRO-{s['stage']} on {s['n']} ranks in {run.elapsed_s:.0f} s; "
                        f"loss equals the serial model's within 1e-5: "
                        f"{m['loss_rel_err'] < 1e-5}")
        self._show()
        return m

    def knobs(self, w) -> dict:
        s = self.state
        return {"stage": w.Dropdown(options=[("0 (plain DP)", 0), ("1 (optimizer)", 1),
                                             ("2 (+ gradients)", 2), ("3 (+ parameters)", 3)],
                                    value=s["stage"], description="ZeRO stage",
                                    style={"description_width": "initial"}),
                "n": w.Dropdown(options=_choices(self.N_CHOICES, s["n"]), value=s["n"],
                                description="N (dp ranks)",
                                style={"description_width": "initial"})}


# ---- chapter 04: tensor parallelism ------------------------------------------------------------
def tp_collectives_figure(pred: dict, t: int, sp: bool, measured: dict | None = None):
    """One layer's collectives per phase, stacked by operation: bytes a rank sends on a ring
    (predicted ghost, measured solid), the count as the label."""
    import plotly.graph_objects as go

    fig = go.Figure()
    phases = ("forward", "backward")
    # the predicted counts in the tick labels (a ghost bar's own text would fade with it)
    x = [f"{p}<br>" + " + ".join(f"{v['count']} {OP_NAMES.get(op, op)}"
                                 for op, v in pred[p].items()) for p in phases]
    ops = list(dict.fromkeys(op for p in phases for op in pred[p]))
    if measured:
        ops += [op for p in phases for op in measured[p] if op not in ops]
    for source, data in (("predicted", pred), ("measured", measured)):
        if not data:
            continue
        for op in ops:
            color = style.op_color(op)
            counts = [data[p].get(op, {}).get("count", 0) for p in phases]
            fig.add_bar(
                x=x, y=[data[p].get(op, {}).get("ring_bytes", 0) / KiB for p in phases],
                name=f"{OP_NAMES.get(op, op)} ({source})", offsetgroup=source,
                legendgroup=op, marker={"color": color, "line": {"color": style.GREY,
                                                                 "width": 1}},
                opacity=style.GHOST_OPACITY if source == "predicted" else 1.0,
                text=[f"{n} x" if n and source == "measured" else "" for n in counts],
                textposition="inside", customdata=counts,
                hovertemplate=f"{op}, {source}: " + "%{customdata} x, %{y:.1f} KiB sent"
                              "<extra></extra>")
    total = sum(v["ring_bytes"] for p in phases for v in pred[p].values())
    line = (("SP: all-gather + reduce-scatter pairs instead of all-reduces, and 2 more "
             "all-gathers in backward" if sp else "TP: g's all-reduce after each row layer "
             "forward, f's before each column layer backward")
            + f"; predicted {total / KiB:.0f} KiB per rank")
    if measured:
        got = sum(v["ring_bytes"] for p in phases for v in measured[p].values())
        line += f", measured {got / KiB:.0f} KiB"
    style.frame(fig, f"Collectives of one layer, tp = {t}{' + SP' if sp else ''} "
                "(under each phase: the predicted count)", line, x="phase of one layer (forward / backward)",
                y="bytes one rank sends on a ring (KiB)", height=380)
    fig.update_layout(barmode="stack", legend={"font": {"size": 11}})
    return fig


def tp_memory_figure(config, batch: int, t: int, sp: bool, measured: dict | None = None,
                     tps=(1, 2, 4, 8)):
    """Activation bytes one layer keeps per rank for each tp, SP off and on: this model's
    formula (ghost bars), Korthikanti's 16-bit count (markers), a run's measurement."""
    import plotly.graph_objects as go

    x = [f"<b>tp={k} ◀</b>" if k == t else f"tp={k}" for k in tps]
    fig = go.Figure()
    for on, color in ((False, style.BLUE), (True, style.ORANGE)):
        name = "TP+SP" if on else "TP"
        preds = [cp.tp_activation_prediction(config, batch, k, on) for k in tps]
        fig.add_bar(x=x, y=[p["model_formula"] / KiB for p in preds], offsetgroup=name,
                    name=f"{name}, formula (this model, fp32)",
                    marker_color=color, opacity=0.4 if on == sp else 0.15)
        fig.add_scatter(x=x, y=[p["korthikanti_16bit"] / KiB for p in preds], mode="markers",
                        name=f"{name}, Korthikanti 16-bit", marker={
                            "symbol": "diamond-open", "size": 10, "color": color})
    mine = cp.tp_activation_prediction(config, batch, t, sp)["model_formula"]
    line = (f"tp={t}{' + SP' if sp else ''}: {mine / KiB:.1f} KiB per rank; "
            + ("SP divides everything by t" if sp else "TP leaves the LayerNorm regions whole"))
    if measured:
        name = "TP+SP" if sp else "TP"
        fig.add_bar(x=[x[list(tps).index(t)]], y=[measured["measured"] / KiB],
                    offsetgroup=name, width=0.2, name=f"{name}, measured (rank 0)",
                    marker_color=style.ORANGE if sp else style.BLUE,
                    text=[f"{measured['measured'] / KiB:.1f}"], textposition="outside")
        line += f"; measured {measured['measured'] / KiB:.1f} KiB"
    style.frame(fig, f"Activation memory of one layer per rank (s={config.seq_len}, "
                f"b={batch}, h={config.d_model}, a={config.n_heads})", line,
                x="tensor-parallel degree (◀ = chosen)", y="activations per rank (KiB)",
                height=400)
    fig.update_layout(barmode="group", legend={"font": {"size": 11}})
    return fig


class TPControls(_Panel):
    """Chapter 04: tensor-parallel degree, which split to look at, and SP on or off."""

    title = "Tensor parallelism: choose tp, the split and SP; 'run it' runs the layer on tp ranks"
    knob_rows = (("tp", "kind", "sp"),)
    TP_CHOICES = (2, 4)
    BATCH = 2

    def __init__(self, tp: int = 2, kind: str = "column", sp: bool = False, config=None):
        super().__init__()
        self.config = config or cp.tp_layer_config()
        self.state = {"tp": tp, "kind": kind, "sp": sp}
        self.redraw()

    def _figures(self, measured: dict | None = None):
        from edu3d.widgets.tensor_split import split_figure

        s = self.state
        t, kind, sp = s["tp"], s["kind"], s["sp"]
        if measured:
            split = split_figure(measured["split"], kind)
            diff = cp.split_difference(measured["split"], self.split, kind)
            split.layout.title.text += (f"<br><span style='font-size:0.85em'>measured on {t} "
                                        f"ranks; largest |measured - predicted| = "
                                        f"{diff:.1e}</span>")
            split.update_layout(margin={"t": 150}, height=split.layout.height + 30)
        else:
            split = split_figure(self.split, kind)
            split.layout.title.text = split.layout.title.text.replace(
                "<b>", "<b>Predicted: ", 1)
        self.split_fig = split
        self.comm_fig = tp_collectives_figure(self.collectives, t, sp,
                                              measured and measured["collectives"])
        self.memory_fig = tp_memory_figure(self.config, self.BATCH, t, sp,
                                           measured and measured["memory"])
        self.figures = (self.split_fig, self.comm_fig, self.memory_fig)

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        self.message = ""
        self.split = cp.tp_split_prediction(s["tp"], **cp.SPLIT)
        self.collectives = cp.tp_collectives_prediction(self.config, self.BATCH, s["tp"],
                                                        s["sp"])
        self._figures()
        self._show()

    def run(self, timeout: float = 240):
        """Run the split, one layer forward and backward, and its activation count on tp
        ranks; draw the measured shards, collectives and bytes over the prediction."""
        from edu3d.distributed.mesh import Layout

        s = self.state
        self.message = f"running {s['tp']} tensor-parallel ranks ..."
        self._show()
        run = self._launch(cp.tp_panel_run, s["tp"], args=(self.config, self.BATCH, s["sp"]),
                           layout=Layout(tp=s["tp"]), timeout=timeout)
        if run is None:
            return None
        self.result = {"split": [r["split"] for r in run.results],
                       "collectives": run.results[0]["collectives"],
                       "memory": run.results[0]["memory"]}
        self._figures(self.result)
        self.message = f"ran {s['tp']} ranks in {run.elapsed_s:.0f} s"
        self._show()
        return self.result

    def knobs(self, w) -> dict:
        s = self.state
        return {"tp": w.Dropdown(options=_choices(self.TP_CHOICES, s["tp"]), value=s["tp"],
                                 description="tp"),
                "kind": w.Dropdown(options=[("column split (all-gather)", "column"),
                                            ("row split (all-reduce)", "row")],
                                   value=s["kind"], description="split"),
                "sp": w.Checkbox(value=s["sp"], description="sequence parallelism (SP)")}


# ---- chapter 05: pipelines ---------------------------------------------------------------------
def bubble_figure(schedule: str, pp: int, m: int, vpp: int, measured: float | None = None,
                  ms=tuple(range(1, 17))):
    """Bubble fraction against m for the chosen schedule and pp: the formula (line), the
    simulation (markers), the chosen m ringed, and a run's measured bubble."""
    import plotly.graph_objects as go
    from edu3d.schedules.simulate import bubble_formula

    from edu3d.widgets.threed import SIM_COSTS_US

    # the Gantt's costs (a message 0.05 ms, a forward 1 ms), so both print the same bubble
    p2p = SIM_COSTS_US["p2p"] / SIM_COSTS_US["F"]
    curve = cp.pp_bubble_curve(schedule, pp, vpp, tuple(ms), p2p)
    label = ("(p-1)/(v·m+p-1)" if schedule == "interleaved" else "(p-1)/(m+p-1)"
             + (", 1F1B's" if schedule == "zb-h1" else ""))
    fig = go.Figure([
        go.Scatter(x=curve["m"], y=curve["formula"], mode="lines", name=f"formula {label}",
                   line={"dash": "dash", "color": style.GREY}),
        go.Scatter(x=curve["m"], y=curve["simulated"], mode="markers",
                   name="simulated (+ 0.05 ms per message)",
                   marker={"color": style.BLUE, "size": 8})])
    sim = dict(zip(curve["m"], curve["simulated"]))
    if m in sim:
        fig.add_scatter(x=[m], y=[sim[m]], mode="markers", name=f"chosen m = {m}",
                        marker={"symbol": "circle-open", "size": 18, "color": style.BLACK,
                                "line": {"width": 2}})
    line = (f"m = {m}: simulated {sim.get(m, float('nan')):.1%}, formula "
            f"{bubble_formula(schedule, pp, m, vpp):.1%}")
    if measured is not None:
        fig.add_scatter(x=[m], y=[measured], mode="markers", name="measured (live run)",
                        marker={"symbol": "x", "size": 14, "color": style.VERMILLION})
        line += f", measured {measured:.1%}"
    style.frame(fig, f"Bubble vs micro-batches: {schedule}, pp = {pp}"
                + (f", v = {vpp}" if vpp > 1 else ""), line, x="micro-batches m",
                y="bubble (share of the step)", height=340)
    fig.update_yaxes(tickformat=".0%", rangemode="tozero")
    return fig


class PipelineControls(_Panel):
    """Chapter 05: schedule, pipeline ranks, micro-batches and chunks per rank."""

    title = "Pipeline schedules: choose one; 'run it' runs it live on pp ranks"
    knob_rows = (("schedule", "pp"), ("m", "vpp"))
    PP_CHOICES = (2, 4, 8)
    VPP_CHOICES = (1, 2, 3, 4)

    def __init__(self, schedule: str = "1f1b", pp: int = 4, m: int = 8, vpp: int = 1,
                 steps: int = 2):
        super().__init__()
        self.steps = steps
        self.state = {"schedule": schedule, "pp": pp, "m": m, "vpp": vpp}
        self.redraw()

    def redraw(self, **changes) -> None:
        from edu3d.widgets.threed import simulated_pipeline

        if "schedule" in changes and "vpp" not in changes:
            # a schedule brings its own chunk count: interleaved needs v >= 2, the others 1
            interleaved = changes["schedule"] == "interleaved"
            if interleaved and self.state["vpp"] == 1:
                changes["vpp"] = 2
            elif not interleaved and self.state["vpp"] > 1:
                changes["vpp"] = 1
        self.state.update(changes)
        self._sync_knobs()
        s = self.state
        bad = cp.pp_problem(s["schedule"], s["pp"], s["m"], s["vpp"])
        if bad:
            self.message = f"cannot draw this pipeline: {bad}"
            self.figures = ()
        else:
            self.message = ""
            self.gantt_fig = simulated_pipeline(s["pp"], s["m"], s["schedule"], s["vpp"])
            self.bubble_fig = bubble_figure(s["schedule"], s["pp"], s["m"], s["vpp"])
            self.figures = (self.gantt_fig, self.bubble_fig)
        self._show()

    def run(self, timeout: float = 300):
        """Run the chosen schedule for ``steps`` steps on pp ranks; draw the last step over
        the simulation (with the measured costs) and its bubble on the curve."""
        s = self.state
        bad = cp.pp_run_problem(s["schedule"], s["pp"], s["m"], s["vpp"])
        if bad:
            self.message = f"cannot run this pipeline: {bad}"
            self._show()
            return None
        from edu3d.course.ch05_pipeline_parallel import measured_bubble, run_schedules
        from edu3d.distributed.mesh import Layout
        from edu3d.widgets.pipeline import pipeline_figure

        self.message = (f"running {s['schedule']} on {s['pp']} pipeline ranks, "
                        f"{s['m']} micro-batches, {self.steps} steps ...")
        self._show()
        kw = cp.pp_run_kwargs(s["schedule"], s["pp"], s["m"], s["vpp"], self.steps)
        run = self._launch(run_schedules, s["pp"], args=(
            [{"name": s["schedule"], "m": s["m"], "vpp": s["vpp"]}],), kwargs=kw,
            layout=Layout(pp=s["pp"]), timeout=timeout)
        if run is None:
            return None
        events, res = run.events(), run.results[0][0]
        bubble = measured_bubble(events, res["steps"])
        self.result = {"events": events, "steps": res["steps"], "bubble": bubble}
        self.gantt_fig = pipeline_figure(
            events, s["schedule"], s["pp"], s["m"], s["vpp"], step=res["steps"][-1],
            title=f"{s['schedule']} on {s['pp']} ranks, measured over the simulation")
        self.bubble_fig = bubble_figure(s["schedule"], s["pp"], s["m"], s["vpp"], bubble)
        self.figures = (self.gantt_fig, self.bubble_fig)
        self.message = f"ran {s['pp']} ranks in {run.elapsed_s:.0f} s"
        self._show()
        return self.result

    def knobs(self, w) -> dict:
        s = self.state
        return {"schedule": w.Dropdown(options=list(cp.SCHEDULES), value=s["schedule"],
                                       description="schedule"),
                "pp": w.Dropdown(options=_choices(self.PP_CHOICES, s["pp"]), value=s["pp"],
                                 description="pp"),
                "m": w.IntSlider(min=1, max=16, value=s["m"], description="micro-batches",
                                 style={"description_width": "initial"}),
                "vpp": w.Dropdown(options=_choices(self.VPP_CHOICES, s["vpp"]),
                                  value=s["vpp"], description="vpp (chunks)",
                                  style={"description_width": "initial"})}


def zero_controls(**default) -> ZeroControls:
    """Chapter 03's panel; display ``.widget`` in JupyterLab (``.figures`` without one)."""
    return ZeroControls(**default)


def tp_controls(**default) -> TPControls:
    """Chapter 04's panel; display ``.widget`` in JupyterLab (``.figures`` without one)."""
    return TPControls(**default)


def pipeline_controls(**default) -> PipelineControls:
    """Chapter 05's panel; display ``.widget`` in JupyterLab (``.figures`` without one)."""
    return PipelineControls(**default)
