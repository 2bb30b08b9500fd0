"""Chapter 11's quiz panel: the picture behind each review question, with its knobs.

After reading this file you should know what each review picture shows and where its
numbers come from (all of them computed by edu3d at once, no run needed):

* ``ring`` — bytes one rank sends per byte all-reduced, against N (edu3d's ring plan);
* ``zero`` — the model state per GPU under ZeRO stages 0-3 over N ranks (``16Ψ`` ...);
* ``activations`` — one layer's activations against the TP degree: TP, TP+SP, TP+SP with
  selective recomputation (Korthikanti et al.);
* ``tp`` — the planner's step time by part for the fastest layout at each TP degree: TP's
  all-reduces explode once the group leaves the node;
* ``bubble`` — the bubble fraction against the micro-batches, simulated, over the formula;
* ``in_flight`` — micro-batches each pipeline rank keeps alive (replayed schedules);
* ``layout`` — the planner's fastest fitting layouts for a model and a cluster.

:class:`Controls` puts them behind one panel: the first knob picks a question (and sets the
other knobs to that question's case); "measure it" launches the tiny GPT on the CPU
(``edu3d.launch.api.launch``) for the pipeline and ZeRO pictures and draws the measurement over
the theory.
"""

from __future__ import annotations

from edu3d.widgets import style

PICTURES = ("ring", "zero", "activations", "tp", "bubble", "in_flight", "layout")
MODELS = ("gpt2-xl", "llama2-7b", "llama2-13b", "llama2-70b", "gpt3-175b")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
PART_COLORS = {"compute": style.BLUE, "bubble": style.GREY, "tp": style.YELLOW,
               "pp": style.SEND, "dp": "#882255"}


def _spec(model: str):
    from edu3d.model.shapes import spec_from

    return spec_from(model)


# ---- the pictures ------------------------------------------------------------------------------
def ring_figure(n: int = 8):
    """Bytes a rank sends per byte of the buffer, from edu3d's ring plan, N = 2..16."""
    import plotly.graph_objects as go

    from edu3d.distributed.algorithms import ring_plan

    ns = list(range(2, 17))
    fig = go.Figure()
    for phases, name, color in ((("reduce_scatter", "all_gather"), "all-reduce", style.BLUE),
                                (("reduce_scatter",), "reduce-scatter (or all-gather)",
                                 style.ORANGE)):
        y = [sum(t.src == 0 for t in ring_plan(k, phases)) / k for k in ns]
        fig.add_scatter(x=ns, y=y, name=name, mode="lines+markers", line={"color": color})
    sent = sum(t.src == 0 for t in ring_plan(n)) / n
    fig.add_scatter(x=[n], y=[sent], name=f"N = {n}: {sent:.3g}·S", mode="markers",
                    marker={"size": 14, "symbol": "star", "color": style.VERMILLION})
    return style.frame(fig, f"Ring all-reduce over N = {n}: each rank sends {sent:.3g}·S",
                       "2(N-1)/N·S per rank: the traffic hardly grows with N, the steps do.",
                       x="ranks N", y="bytes sent per rank (× buffer size S)")


def zero_figure(model: str = "llama2-7b", n: int = 8, gpu_mem_gb: float = 80):
    from edu3d.widgets.memory_plan import zero_stages

    psi = _spec(model).num_params()
    return zero_stages(psi, n, gpu_mem_gb=gpu_mem_gb,
                       title=f"{model} ({psi / 1e9:.2f} B parameters) over dp = {n}: "
                             "state per GPU")


def activations_figure(model: str = "gpt3-175b"):
    import plotly.graph_objects as go

    from edu3d.plan.formulas import activation_bytes_per_layer as act

    sp = _spec(model)
    kw = dict(d_ff=sp.ff, kv_heads=sp.kv_heads, mlp=sp.mlp)
    s, h, a = sp.seq_len, sp.d_model, sp.n_heads
    ts = [t for t in (1, 2, 4, 8, 16) if a % t == 0]
    fig = go.Figure()
    for name, extra, color in (("TP", {}, style.ORANGE), ("TP + SP", {"sp": True}, style.BLUE),
                               ("TP + SP + selective recompute",
                                {"sp": True, "recompute": "selective"}, style.GREEN)):
        fig.add_scatter(x=ts, y=[act(s, 1, h, a, t=t, **extra, **kw) / 1e6 for t in ts],
                        name=name, mode="lines+markers", line={"color": color})
    serial = act(s, 1, h, a, **kw) / 1e6
    fig.add_hline(y=serial, line={"dash": "dash", "color": style.BLACK},
                  annotation_text=f"serial: {serial:,.0f} MB", annotation_position="top right")
    fig.update_xaxes(type="log", tickvals=ts)
    fig.update_yaxes(type="log")
    return style.frame(fig, f"{model}: one layer's activations (s = {s}, b = 1, 16-bit)",
                       "TP alone leaves 10sbh whole on every rank; SP splits them too; "
                       "selective recomputation drops the 5as/h attention term.",
                       x="tensor-parallel degree", y="activations per layer and sequence (MB)")


def _parts_bars(fig, rows, labels) -> None:
    for part, color in PART_COLORS.items():
        fig.add_bar(x=labels, y=[r["time"][part] for r in rows], name=part,
                    marker_color=color, hovertemplate=f"{part}: " + "%{y:.2f} s<extra></extra>")
    fig.update_layout(barmode="stack")


def _label(st) -> str:
    return (f"dp{st.dp}·tp{st.tp}·pp{st.pp}" + (f" Z{st.zero}" if st.zero else "")
            + ("" if st.recompute == "none" else f" {st.recompute[:3]}") + f" b{st.micro_batch}")


def _search(model: str, gpus: int):
    from edu3d.course.ch11_review import plan

    return plan(model, gpus)


def tp_figure(model: str = "llama2-7b", gpus: int = 16):
    """The fastest layout (that fits, if any does) at each TP degree, step time by part."""
    import plotly.graph_objects as go

    rows = _search(model, gpus)
    best = {}
    for r in rows:  # sorted: fitting first, fastest first
        best.setdefault(r["setup"].tp, r)
    tps = sorted(best)
    fig = go.Figure()
    _parts_bars(fig, [best[t] for t in tps], [f"tp={t}" + ("" if best[t]["fits"] else
                                                            " (no fit)") for t in tps])
    return style.frame(fig, f"{model} on {gpus} GPUs: the fastest layout at each TP degree",
                       "TP's 4 all-reduces per layer ride NVLink inside a node of 8; beyond "
                       "it they cross InfiniBand and dominate the step.",
                       x="tensor-parallel degree (best layout for it)", y="step time (s)")


def schedulable(schedule: str, pp: int, m: int) -> bool:
    """Whether edu3d's schedules build for ``m`` micro-batches: interleaved wants a multiple
    of ``p``; ZB-H1 groups micro-batches like PyTorch (``m // max(1, m // p)`` must divide)."""
    if schedule == "interleaved":
        return m % pp == 0
    if schedule == "zb-h1":
        return m % max(1, m // pp) == 0
    return m >= 1


def bubble_figure(schedule: str = "1f1b", pp: int = 4, m: int = 8, measured: float | None = None):
    """The simulated bubble against the micro-batches, over the formula."""
    import plotly.graph_objects as go

    from edu3d.course.ch11_review import bubble
    from edu3d.schedules import bubble_formula

    ms = [k for k in range(1, max(32, m) + 1) if schedulable(schedule, pp, k)]
    fig = go.Figure()
    ref = "1f1b" if schedule == "zb-h1" else schedule
    fig.add_scatter(x=ms, y=[bubble_formula(ref, pp, k, 2) for k in ms], mode="lines",
                    name=f"formula ({'1F1B' if schedule == 'zb-h1' else schedule})",
                    line={"color": style.GREY, "dash": "dash"})
    fig.add_scatter(x=ms, y=[bubble(schedule, pp, k, 2) for k in ms], mode="markers",
                    name=f"{schedule} simulated", marker={"color": style.BLUE, "size": 8})
    if m in ms:
        b = bubble(schedule, pp, m, 2)
        fig.add_scatter(x=[m], y=[b], mode="markers", name=f"m = {m}: {b:.1%}",
                        marker={"size": 16, "symbol": "star", "color": style.VERMILLION})
    if measured is not None:
        fig.add_scatter(x=[m], y=[measured], mode="markers", name=f"measured: {measured:.1%}",
                        marker={"size": 14, "symbol": "diamond", "color": style.BLACK})
    fig.update_yaxes(tickformat=".0%", rangemode="tozero")
    v = ", v = 2" if schedule == "interleaved" else ""
    return style.frame(fig, f"{schedule}, p = {pp}{v}: the bubble against the micro-batches",
                       "(p-1)/(v·m+p-1): more micro-batches (or chunks) shrink the idle share; "
                       "ZB-H1 fills it with weight gradients.",
                       x="micro-batches m", y="bubble (share of the step)")


def in_flight_figure(schedule: str = "1f1b", pp: int = 4, m: int = 8):
    import plotly.graph_objects as go

    from edu3d.plan.estimate import in_flight

    fig = go.Figure()
    for i, name in enumerate(dict.fromkeys(["gpipe", "1f1b", schedule])):
        v = 2 if name == "interleaved" else 1
        if not schedulable(name, pp, m):
            continue
        fig.add_bar(x=[f"pp rank {r}" for r in range(pp)], y=list(in_flight(name, pp, m, v)),
                    name=name, marker_color=style.GROUP_COLORS[i])
    return style.frame(fig, f"Micro-batches kept alive per pipeline rank: p = {pp}, m = {m}",
                       "GPipe keeps all m; 1F1B at most p on the first rank, one less per "
                       "rank down the pipe.", x="pipeline rank",
                       y="activations held at the peak (micro-batches)")


def layout_figure(model: str = "llama2-13b", gpus: int = 16, top: int = 8):
    import plotly.graph_objects as go

    rows = [r for r in _search(model, gpus) if r["fits"]][:top]
    fig = go.Figure()
    if not rows:
        return style.frame(fig, f"{model} on {gpus} GPUs: no layout fits",
                           "add GPUs, or memory per GPU")
    _parts_bars(fig, rows, [_label(r["setup"]) for r in rows])
    return style.frame(fig, f"{model} on {gpus} GPUs of 80 GB: the planner's fastest layouts",
                       f"first: {_label(rows[0]['setup'])}; ZeRO-1 over dp is free, PP adds a "
                       "small bubble, TP pays four all-reduces per layer.",
                       x="layout (Z = ZeRO stage, sel = selective recompute, b = micro-batch)",
                       y="estimated step time (s)")


def zero_measured_figure(rows: list[dict]):
    """Rank 0's state measured per ZeRO stage beside the planner's count (KiB)."""
    import plotly.graph_objects as go

    x = [f"ZeRO-{r['zero']}" for r in rows]
    fig = go.Figure()
    fig.add_bar(x=x, y=[r["estimate"] / 1024 for r in rows], name="estimate",
                marker={"color": style.GREEN, "opacity": style.GHOST_OPACITY})
    fig.add_bar(x=x, y=[r["measured"] / 1024 for r in rows], name="measured",
                marker_color=style.GREEN)
    return style.frame(fig, f"edu3d's tiny GPT over dp = {rows[0]['dp']}: rank 0's state, "
                            "measured", "weights + gradients + Adam state shrink stage by "
                       "stage, as the formula says.", x="ZeRO stage", y="state on rank 0 (KiB)")


def picture(state: dict):
    """The figure of the panel's current ``state``."""
    kind = state["picture"]
    if kind == "ring":
        return ring_figure(state["n"])
    if kind == "zero":
        return zero_figure(state["model"], state["n"])
    if kind == "activations":
        return activations_figure(state["model"])
    if kind == "tp":
        return tp_figure(state["model"], state["gpus"])
    if kind == "bubble":
        return bubble_figure(state["schedule"], state["pp"], state["m"])
    if kind == "in_flight":
        return in_flight_figure(state["schedule"], state["pp"], state["m"])
    if kind == "layout":
        return layout_figure(state["model"], state["gpus"])
    raise ValueError(f"unknown picture {kind!r}; choose one of {', '.join(PICTURES)}")


# ---- the panel ---------------------------------------------------------------------------------
DEFAULT = {"question": "bubble_1f1b", "picture": "bubble", "schedule": "1f1b", "pp": 4, "m": 8,
           "n": 8, "model": "llama2-7b", "gpus": 16}


class Controls:
    """"Quiz me": pick a question, see its picture, turn its knobs.

    ``state`` holds the choice; :meth:`redraw` rebuilds ``figure`` at once; :meth:`measure`
    launches the tiny GPT for the pipeline and ZeRO pictures; ``widget`` builds the
    ipywidgets box lazily.
    """

    def __init__(self, default: dict | None = None):
        from edu3d.course.ch11_review import BANK

        self.bank = BANK
        self.state = {**DEFAULT, **BANK[(default or DEFAULT).get("question", "bubble_1f1b")]
                      .picture, **(default or {})}
        self.message = ""
        self.measured = None
        self._box = self._out = None
        self._knobs: dict = {}
        self._syncing = False
        self.redraw()

    def problem(self) -> str | None:
        s = self.state
        if s["picture"] in ("bubble", "in_flight") and not schedulable(s["schedule"], s["pp"],
                                                                       s["m"]):
            return (f"{s['schedule']} cannot group m={s['m']} micro-batches over pp={s['pp']}: "
                    "use a multiple of pp")
        return None

    def redraw(self, **changes) -> None:
        if "question" in changes and changes["question"] != self.state["question"]:
            changes = {**self.bank[changes["question"]].picture, **changes}
        self.state.update(changes)
        self.measured = None
        q = self.bank[self.state["question"]]
        self.message = self.problem() or f"{q.title[:3].strip()} · {q.topic}: see " \
                                          f"notebooks/{q.chapter}"
        if not self.problem():
            self.figure = picture(self.state)
        self._sync_knobs()
        self._show()

    def measure(self, timeout: float = 300):
        """Run the tiny GPT for the current picture and draw it over the theory."""
        s = self.state
        if s["picture"] == "bubble":
            return self._measure_bubble(timeout)
        if s["picture"] == "zero":
            return self._measure_zero(timeout)
        self.message = (f"the {s['picture']} picture is edu3d's estimate at real sizes; pick a "
                        "pipeline-bubble or ZeRO question to measure a run")
        self._show()
        return None

    def _measure_bubble(self, timeout: float):
        from edu3d.course.ch06_3d_parallelism import capstone
        from edu3d.launch import launch
        from edu3d.distributed.mesh import Layout
        from edu3d.schedules.simulate import bubble_of
        from edu3d.widgets.threed import pipeline_view

        s = self.state
        vpp = 2 if s["schedule"] == "interleaved" else 1
        # the tiny GPT has 4 layers and a global batch of 8: p*v <= 4 and m divides 8
        pp = 2 if s["pp"] < 4 or vpp > 1 else 4
        m = max(k for k in (1, 2, 4, 8) if k <= max(s["m"], pp) and k % (pp if vpp > 1 else 1)
                == 0)
        self.message = f"running pp={pp}, m={m} on {pp} ranks ..."
        self._show()
        layout = Layout(pp=pp, vpp=vpp)
        run = launch(capstone, pp, kwargs={"steps": 2, "zero": 0, "microbatches": m,
                                           "schedule": s["schedule"], "vpp": vpp},
                     layout=layout, timeout=timeout, echo=False)
        events = [e for e in pipeline_view(run.events(), layout) if e.get("step") == 2]
        self.measured = bubble_of(events)
        self.state.update(pp=pp, m=m)
        self._sync_knobs()
        self.figure = bubble_figure(s["schedule"], pp, m, self.measured)
        self.message = (f"measured on {pp} CPU ranks: bubble {self.measured:.1%} (message "
                        "latency and Python overhead add to the theory)")
        self._show()
        return self.measured

    def _measure_zero(self, timeout: float):
        from edu3d.course import lesson_args
        from edu3d.course.ch06_3d_parallelism import capstone
        from edu3d.launch import launch
        from edu3d.distributed.mesh import Layout
        from edu3d.train.options import config_from_args
        from edu3d.widgets.threed import memory_estimate

        dp = min(max(self.state["n"], 2), 4)
        config = config_from_args(lesson_args())
        rows = []
        for zero in range(4):
            self.message = f"running dp={dp} ZeRO-{zero} ..."
            self._show()
            run = launch(capstone, dp, kwargs={"steps": 1, "zero": zero, "microbatches": 1},
                         layout=Layout(dp=dp), timeout=timeout, echo=False)
            mem = next(r["memory"] for r in run.results if r["rank"] == 0)
            est = memory_estimate(config, dp, 1, 1, zero, 1)[0]
            state = ("params", "grads", "optimizer")
            rows.append({"zero": zero, "dp": dp, "measured": sum(mem[c] for c in state),
                         "estimate": sum(est[c] for c in state)})
        self.measured = rows
        self.figure = zero_measured_figure(rows)
        self.message = f"measured on {dp} CPU ranks, the tiny GPT in fp32 (4 + 4 + 8 bytes)"
        self._show()
        return rows

    # ---- ipywidgets (only when asked for) ------------------------------------------------------
    def _sync_knobs(self) -> None:
        style.sync_knobs(self)

    def _turned(self, key: str, value) -> None:
        if not self._syncing:
            self.redraw(**{key: value})

    @property
    def widget(self):
        if self._box is None:
            import ipywidgets as w

            s = self.state
            self._knobs = {
                "question": w.Dropdown(options=[(q.title, q.key) for q in self.bank.values()],
                                       value=s["question"], description="question",
                                       layout={"width": "460px"}),
                "schedule": w.Dropdown(options=list(SCHEDULES), value=s["schedule"],
                                       description="schedule"),
                "pp": w.IntSlider(min=2, max=8, value=s["pp"], description="stages p"),
                "m": w.IntSlider(min=1, max=64, value=s["m"], description="micro-batches"),
                "n": w.Dropdown(options=sorted({1, 2, 4, 8, 16, 32, 64, s["n"]}),
                                value=s["n"], description="ranks N"),
                "model": w.Dropdown(options=sorted({*MODELS, s["model"]}), value=s["model"],
                                    description="model"),
                "gpus": w.Dropdown(options=sorted({8, 16, 32, 64, s["gpus"]}),
                                   value=s["gpus"], description="GPUs"),
            }
            for key, knob in self._knobs.items():
                knob.observe(lambda ch, key=key: self._turned(key, ch["new"]), "value")
            button = w.Button(description="measure it", button_style="primary")
            button.on_click(lambda _: self.measure())
            self._out = w.Output()
            k = list(self._knobs.values())
            self._box = w.VBox([w.HBox([k[0], button]), w.HBox(k[1:4]), w.HBox(k[4:]),
                                self._out])
            self._box.add_class("edu3d-controls")  # what the browser test turns
            self._show()
        return self._box

    def _show(self) -> None:
        style.show_in(self._out, self.message, *([] if self.problem() else [self.figure]))


def controls(default: dict | None = None) -> Controls:
    """The review's quiz panel; display ``controls().widget`` in JupyterLab, or show the
    static ``figure`` without a frontend."""
    return Controls(default)
