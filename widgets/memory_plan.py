"""Chapter 07's planner picture: the bytes of every pipeline rank, against the GPU's memory.

After reading this file you should know how to read the chart and turn its knobs:

* :func:`stage_bars` — **one bar per pipeline rank**, stacked by category: weights (blue),
  gradients (orange), optimizer state (green), activations (purple), communication buffers
  (sand). The dashed line is the GPU's usable memory; the title says whether the fullest
  rank fits. With a measurement, each rank gets two bars: the planner's estimate as a ghost
  (translucent) and the measured bytes beside it, solid.
* :class:`Controls` — a model (the course's presets or a real one), the sequence length,
  micro-batch size and count, dp/tp/pp, ZeRO stage, recomputation, precision, schedule and
  the GPU's memory redraw the estimate at once (:func:`edu3d.plan.estimate.estimate`); "measure
  it" launches the tiny model in the chosen layout (:func:`edu3d.course.ch07_memory_plan.run`,
  8 ranks at most, fp32) and puts the measured bars beside the estimate. Without a frontend
  (nbval, exported HTML) the default figure is drawn statically (:attr:`Controls.figure`).
"""

from __future__ import annotations

from edu3d.widgets import style

COLORS = {"params": style.BLUE, "grads": style.ORANGE, "optimizer": style.GREEN,
          "activations": style.PURPLE, "comm": style.SAND, "transient": style.GREY}
NAMES = {"params": "weights", "grads": "gradients", "optimizer": "optimizer state",
         "activations": "activations", "comm": "comm buffers",
         "transient": "loss-backward peak"}
DEFAULT = dict(model="tiny", seq=None, micro_batch=2, microbatches=2, dp=2, tp=1, pp=2,
               zero=1, recompute="none", precision="fp32", schedule="1f1b", sp=False,
               gpu_mem_gb=0.01)


def _unit(nbytes: float) -> tuple[str, float]:
    for name, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return name, size
    return "bytes", 1.0


def stage_bars(estimate: dict, measured: dict[int, dict] | None = None, *,
               gpu_mem_gb: float | None = None, usable: float = 0.9, title: str | None = None,
               takeaway: str | None = None):
    """Stacked bars per pipeline rank from a planner estimate (``per_stage``), measured bars
    beside them when ``measured`` (pp rank -> bytes by category) is given."""
    import plotly.graph_objects as go

    rows = estimate["per_stage"]
    n = len(rows)
    x = [f"pp rank {r['pp_rank']}" + (" (first)" if r["pp_rank"] == 0 and n > 1 else "")
         + (" (last)" if r["pp_rank"] == n - 1 and n > 1 else "") for r in rows]
    top = max([estimate["total_bytes"]] + [sum(m.values()) for m in (measured or {}).values()])
    if gpu_mem_gb:
        top = max(top, usable * gpu_mem_gb * 1e9)
    unit, size = _unit(top)
    fig = go.Figure()
    groups = [("estimate", {r["pp_rank"]: r for r in rows}, 0.35 if measured else 1.0)]
    if measured:
        groups.append(("measured", measured, 1.0))
    for label, data, opacity in groups:
        base = [0.0] * n
        for cat in COLORS:
            ys = [data.get(r["pp_rank"], {}).get(cat, 0.0) / size for r in rows]
            if not any(ys):
                continue
            fig.add_bar(x=x, y=ys, base=list(base), name=f"{NAMES[cat]} ({label})"
                        if measured else NAMES[cat], offsetgroup=label,
                        marker={"color": COLORS[cat], "opacity": opacity},
                        legendgroup=cat, hovertemplate=f"{label} {NAMES[cat]}: "
                        "%{y:.3f} " + unit + "<extra>%{x}</extra>")
            base = [b + y for b, y in zip(base, ys)]
    verdict = ""
    if gpu_mem_gb:
        limit = usable * gpu_mem_gb * 1e9
        fits = estimate["total_bytes"] <= limit
        verdict = (f" — fits in {gpu_mem_gb:g} GB" if fits else
                   f" — does NOT fit in {gpu_mem_gb:g} GB")
        fig.add_hline(y=limit / size, line={"dash": "dash", "color": style.BLACK},
                      annotation_text=f"usable: {usable:.0%} of {gpu_mem_gb:g} GB",
                      annotation_position="top left")
    style.frame(fig, (title or "Memory per pipeline rank") + verdict,
                takeaway or "The first stage holds the embedding and the most micro-batches "
                            "in flight; the last the head and its logits.",
                x="pipeline rank", y=f"memory ({unit})")
    fig.update_layout(barmode="group", height=420)
    return fig


def zero_stages(psi: float, dp: int, *, gpu_mem_gb: float | None = None,
                bytes_per=(2, 2, 12), title: str | None = None):
    """Bytes per GPU of the model's state under ZeRO stages 0-3 over ``dp`` ranks (the ZeRO
    paper's figure 1: ``16Ψ``, ``4Ψ + KΨ/N``, ``2Ψ + (2+K)Ψ/N``, ``(4+K)Ψ/N``)."""
    import plotly.graph_objects as go

    from edu3d.plan.formulas import zero_bytes

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


class Controls:
    """Knobs for a model and a layout that redraw the planner's estimate; "measure it"
    runs the tiny model in that layout and draws what every rank held beside it."""

    def __init__(self, default: dict | None = None):
        self.state = {**DEFAULT, **(default or {})}
        self.message = ""
        self.measured = None
        self.valid = False
        self._box = self._out = None
        self.redraw()

    def setup(self):
        """``(spec, setup)`` of the current choice (``ValueError`` when it cannot work)."""
        from edu3d.plan.estimate import Setup, validate
        from edu3d.model.shapes import spec_from

        s = self.state
        spec = spec_from(s["model"], seq_len=s["seq"])
        st = Setup(dp=s["dp"], tp=s["tp"], pp=s["pp"], zero=s["zero"] if s["dp"] > 1 else 0,
                   microbatches=s["microbatches"], micro_batch=s["micro_batch"],
                   schedule=s["schedule"], sp=s["sp"] and s["tp"] > 1,
                   recompute=s["recompute"], precision=s["precision"])
        validate(spec, st)
        return spec, st

    def redraw(self, **changes) -> None:
        from edu3d.plan.estimate import estimate

        self.state.update(changes)
        self.measured = None
        try:
            spec, st = self.setup()
        except ValueError as err:
            self.message, self.valid = str(err), False
            self._show()
            return
        self.message, self.valid = "", True
        self.estimate = estimate(spec, st)
        s = self.state
        self.figure = stage_bars(
            self.estimate, gpu_mem_gb=s["gpu_mem_gb"],
            title=f"{spec.name}: dp={st.dp} tp={st.tp} pp={st.pp} ZeRO-{st.zero}, "
                  f"{st.microbatches}x{st.micro_batch} seq, {st.recompute} recompute")
        self._show()

    def argv(self) -> list[str]:
        """``edu3d train``'s options for the current layout on the tiny model (fp32)."""
        s, (_, st) = self.state, self.setup()
        out = ["--model", "tiny", "--dp", str(st.dp), "--tp", str(st.tp), "--pp", str(st.pp),
               "--zero", str(st.zero), "--microbatches", str(st.microbatches),
               "--global-batch", str(st.global_batch), "--schedule", st.schedule,
               "--recompute", st.recompute]
        if s["seq"]:
            out += ["--seq", str(s["seq"])]
        return out + (["--sp"] if st.sp else [])

    def measure(self, timeout: float = 300):
        """Launch the tiny model in the current layout; draw the measured bytes (the fullest
        rank of each pipeline stage, after one step) beside the planner's, at rest."""
        from edu3d.course.ch07_memory_plan import options, run
        from edu3d.plan.estimate import estimate, from_train_args

        s = self.state
        problem = None
        if s["model"] != "tiny" or s["precision"] != "fp32":
            problem = "measure it runs the tiny model in fp32: choose model tiny, precision fp32"
        elif s["dp"] * s["tp"] * s["pp"] > 8:
            problem = "the real run is limited to 8 ranks"
        if problem is None:
            try:
                argv = self.argv()
                options(argv)
            except (ValueError, SystemExit) as err:
                problem = f"this layout cannot run: {err}"
        if problem:
            self.message = problem
            self._show()
            return None
        self.message = f"running {s['dp'] * s['tp'] * s['pp']} ranks ..."
        self._show()
        ranks = run(argv, timeout)
        rest = estimate(*from_train_args(options(argv)), at="rest")
        measured: dict[int, dict] = {}
        for r in ranks:
            pp = r["coord"][0]
            if pp not in measured or sum(r["bytes"].values()) > sum(measured[pp].values()):
                measured[pp] = r["bytes"]
        self.measured = measured
        self.figure = stage_bars(
            rest, measured, gpu_mem_gb=s["gpu_mem_gb"],
            title="Measured (solid) beside the planner (ghost), after one step",
            takeaway="Weights, gradients and optimizer state to the byte; activations are "
                     "the step's peak, within a few bytes.")
        self.message = f"measured {len(ranks)} ranks"
        self._show()
        return measured

    # ---- ipywidgets (only when asked for) ------------------------------------------------------
    @property
    def widget(self):
        if self._box is None:
            import ipywidgets as w

            from edu3d.model.shapes import PRESETS

            s = self.state
            knobs = {
                "model": w.Dropdown(options=list(PRESETS), value=s["model"],
                                    description="model"),
                "seq": w.Dropdown(options=[("preset", None), 32, 64, 128, 1024, 2048, 4096,
                                           8192], value=s["seq"], description="sequence"),
                "micro_batch": w.Dropdown(options=[1, 2, 4, 8], value=s["micro_batch"],
                                          description="micro-batch"),
                "microbatches": w.IntSlider(min=1, max=16, value=s["microbatches"],
                                            description="micro-batches"),
                "dp": w.Dropdown(options=[1, 2, 4, 8, 16, 32, 64], value=s["dp"],
                                 description="dp"),
                "tp": w.Dropdown(options=[1, 2, 4, 8], value=s["tp"], description="tp"),
                "pp": w.Dropdown(options=[1, 2, 4, 8, 16], value=s["pp"], description="pp"),
                "zero": w.IntSlider(min=0, max=3, value=s["zero"], description="ZeRO"),
                "recompute": w.Dropdown(options=["none", "selective", "full"],
                                        value=s["recompute"], description="recompute"),
                "precision": w.Dropdown(options=["fp32", "bf16", "fp16"],
                                        value=s["precision"], description="precision"),
                "schedule": w.Dropdown(options=["gpipe", "1f1b", "zb-h1"],
                                       value=s["schedule"], description="schedule"),
                "sp": w.Checkbox(value=s["sp"], description="sequence parallel"),
                "gpu_mem_gb": w.FloatLogSlider(value=s["gpu_mem_gb"], base=10, min=-3,
                                               max=2.3, description="GPU GB"),
            }
            for key, knob in knobs.items():
                knob.observe(lambda ch, key=key: self.redraw(**{key: ch["new"]}), "value")
            button = w.Button(description="measure it", button_style="primary")
            button.on_click(lambda _: self.measure())
            self._out = w.Output()
            items = list(knobs.values())
            self._box = w.VBox([w.HBox(items[:4]), w.HBox(items[4:8]),
                                w.HBox(items[8:] + [button]), self._out])
            self._box.add_class("edu3d-controls")  # what the browser test turns
            self._show()
        return self._box

    def _show(self) -> None:
        style.show_in(self._out, self.message, *([self.figure] if self.valid else []))


def controls(default: dict | None = None) -> Controls:
    """The chapter's planner controls; display ``controls().widget`` in JupyterLab, or the
    static ``figure`` without a frontend."""
    return Controls(default)
