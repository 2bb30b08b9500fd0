"""Chapter 03's panel: ZeRO's stage and N, predicted for all four stages, then measured.

After reading this file you should know what the knobs change: the stage and the number of
data-parallel ranks N redraw the sharding map, the memory per rank (the paper's formula as a
ghost, the planner's exact count solid) and the traffic per step (2Ψ, 3Ψ) for all four
stages, the chosen one marked (:func:`edu3d.course.ch03_zero.zero_prediction`); "run it"
trains at that stage on N ranks (:func:`edu3d.course.ch02_data_parallel.compare_versions`)
and adds the measured bars (:func:`edu3d.course.ch03_zero.zero_measured`).

:class:`GradReduceControls` (the chapter's last section) picks a ZeRO stage, its
``--grad-reduce`` mode and a model: the planner's gradient bytes and bytes on the wire over
m = 1, 2, 4, 8 micro-batches, every case at once, the chosen one lit; "run it" measures all
of them in one launch (:mod:`edu3d.course.ch03_zero_reduce`).

:class:`HsdpControls` (HSDP, ``--hsdp R``) picks R and the ZeRO stage: the cube of 4 ranks
with its shard and replicate groups (:func:`edu3d.widgets.mesh3d.mesh_figure`) and the bytes
per group and state per rank for every R, the chosen one marked; "run it" trains every R at
that stage in one launch and draws what the ranks sent, held and joined
(:mod:`edu3d.course.ch03_zero_hsdp`).
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch03_zero as ch03
from edu3d.course.ch02_data_parallel import compare_versions
from edu3d.widgets.panels.panel import MAX_RUN_RANKS, Panel, choices
from edu3d.widgets.zero import (hsdp_figure, sharding_map_figure, zero_memory_figure,
                                zero_traffic_figure)
from edu3d.course import ch03_zero_hsdp as ch03h
from edu3d.course import ch03_zero_reduce as ch03r
from edu3d.config.layout import Layout
from edu3d.widgets.mesh3d import mesh_figure
from edu3d.plan.zero_modes import GRAD_REDUCE
from edu3d.widgets.grad_reduce import grad_reduce_figure


class ZeroControls(Panel):
    """Chapter 03: ZeRO stage and the number of data-parallel ranks N."""

    title = "ZeRO: choose a stage and N; 'run it' trains 2 steps on N ranks"
    FIGURES = ("sharding_fig", "memory_fig", "traffic_fig")
    N_CHOICES = (2, 4, 8)

    def __init__(self, stage: int = 1, n: int = 4, config=None, steps: int = 2):
        super().__init__({"stage": stage, "n": n})
        self.config = config or ch03.course_config()
        self.steps = steps
        self.redraw()

    def _draw(self, measured: dict | None = None) -> None:
        pred = self.prediction
        self.sharding_fig = sharding_map_figure(measured and measured["units"] or pred["units"],
                                                pred["n"], pred["stage"], menu=False)
        self.memory_fig = zero_memory_figure(pred, measured)
        self.traffic_fig = zero_traffic_figure(pred, measured)

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        self.prediction = ch03.zero_prediction(self.config, s["n"], s["stage"])
        self._draw()
        self.say("")

    def run(self, timeout: float = 300):
        """Train ``steps`` steps at the chosen stage on N ranks (and the serial model on rank
        0) and draw the measured memory and traffic over the prediction."""
        s = self.state
        if self.refuse(None if s["n"] <= MAX_RUN_RANKS else
                       f"the real run is limited to {MAX_RUN_RANKS} ranks on this machine"):
            return None
        self.say(f"running ZeRO-{s['stage']} on {s['n']} ranks, {self.steps} steps "
                 "(and the serial model on rank 0) ...")
        run = self.launch(compare_versions, s["n"], args=(ch03.zero_versions(s["stage"]),),
                          kwargs={"steps": self.steps, "global_batch": 16}, progress=False,
                          timeout=timeout)
        if run is None:
            return None
        m = self.result = ch03.zero_measured(run, s["stage"], self.steps)
        self._draw(m)
        self.say(f"ran ZeRO-{s['stage']} on {s['n']} ranks in {run.elapsed_s:.0f} s; "
                 f"loss equals the serial model's within 1e-5: {m['loss_rel_err'] < 1e-5}")
        return m

    def knobs(self) -> dict:
        s = self.state
        return {"stage": w.Dropdown(options=[("0 (plain DP)", 0), ("1 (optimizer)", 1),
                                             ("2 (+ gradients)", 2), ("3 (+ parameters)", 3)],
                                    value=s["stage"], description="ZeRO stage",
                                    style={"description_width": "initial"}),
                "n": w.Dropdown(options=choices(self.N_CHOICES, s["n"]), value=s["n"],
                                description="N (dp ranks)",
                                style={"description_width": "initial"})}


def zero_controls(**default) -> ZeroControls:
    """Chapter 03's panel; display ``.widget`` in JupyterLab (``.figures`` without one)."""
    return ZeroControls(**default)


# ---- the last section: ZeRO-2/3 reducing per micro-batch or per step (issue 26) ----------
GRAD_REDUCE_MODELS = ("tiny", "small")  # what two CPU ranks train in seconds


class GradReduceControls(Panel):
    """Chapter 03: ZeRO stage, ``--grad-reduce`` mode and model size over ``m``."""

    title = "ZeRO under gradient accumulation: choose a stage, a mode and a model"
    FIGURES = ("figure",)

    ALL = -1  # the stage knob's "all": every case lit

    def __init__(self, stage: int = ALL, grad_reduce: str = "per-microbatch",
                 model: str = "tiny", measured: list[dict] | None = None, dp: int = 2):
        super().__init__({"stage": stage, "grad_reduce": grad_reduce, "model": model})
        self.dp = dp
        self.measured = {model: measured} if measured else {}
        self.redraw()

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        self.rows = ch03r.table(self.measured.get(s["model"]), self.dp, s["model"])
        lit = None if s["stage"] == self.ALL else (s["stage"], s["grad_reduce"])
        self.figure = grad_reduce_figure(self.rows, lit)
        self.say(ch03r.agreement(self.rows) if s["model"] in self.measured else "")

    def run(self, timeout: float = 300):
        """One step of every case at every m on ``dp`` ranks, in one launch."""
        s = self.state
        self.say(f"running {len(ch03r.CASES) * len(ch03r.MICROBATCHES)} one-step runs of "
                 f"the {s['model']} model on {self.dp} ranks ...")
        runs = ch03r.sweep(self.dp, s["model"])
        res = self.launch(ch03r.measure, self.dp, args=([r[-1] for r in runs],),
                          timeout=timeout, progress=False)
        if res is None:
            return None
        self.measured[s["model"]] = self.result = ch03r.collect(res.results[0], runs)
        self.redraw()
        return self.result

    def knobs(self) -> dict:
        s = self.state
        wide = {"description_width": "initial"}
        return {"stage": w.Dropdown(options=[("all", self.ALL), ("0 (DDP)", 0), ("1", 1),
                                             ("2", 2), ("3", 3)],
                                    value=s["stage"], description="ZeRO stage", style=wide),
                "grad_reduce": w.Dropdown(options=list(GRAD_REDUCE), value=s["grad_reduce"],
                                          description="--grad-reduce", style=wide),
                "model": w.Dropdown(options=list(GRAD_REDUCE_MODELS), value=s["model"],
                                    description="model", style=wide)}


def grad_reduce_controls(**default) -> GradReduceControls:
    """The panel; display ``.widget`` in JupyterLab (``.figure`` without one)."""
    return GradReduceControls(**default)


# ---- HSDP: replica groups of ZeRO shards (issue 38) ---------------------------------------
class HsdpControls(Panel):
    """Chapter 03: HSDP's replica groups R on 4 ranks, and the ZeRO stage."""

    title = "HSDP: choose R replica groups and a stage; 'run it' trains every R on 4 ranks"
    FIGURES = ("mesh_fig", "bytes_fig")
    DP = 4

    def __init__(self, replicas: int = 2, stage: int = 3, measured=None):
        super().__init__({"replicas": replicas, "stage": stage})
        self.measured = {stage: measured} if measured is not None else {}
        self.redraw()

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        run = self.measured.get(s["stage"])
        self.rows = ch03h.table(run, ch03h.REPLICAS, self.DP, s["stage"])
        row = next(r for r in self.rows if r["R"] == s["replicas"])
        self.mesh_fig = mesh_figure(Layout(dp=self.DP), row.get("reports"), dim="shard",
                                    hsdp=s["replicas"])
        self.bytes_fig = hsdp_figure(self.rows, s["replicas"])
        self.say(ch03h.agreement(self.rows) if run is not None else "")

    def run(self, timeout: float = 300):
        """Every R at the chosen stage, two steps each, in one launch of 4 ranks."""
        s = self.state
        self.say(f"running HSDP with R = {', '.join(map(str, ch03h.REPLICAS))} at ZeRO-"
                 f"{s['stage']} on {self.DP} ranks (and the serial model on rank 0) ...")
        res = self.launch(ch03h.measure, self.DP, args=(list(ch03h.REPLICAS), s["stage"]),
                          layout=Layout(dp=self.DP), timeout=timeout, progress=False)
        if res is None:
            return None
        self.measured[s["stage"]] = self.result = res
        self.redraw()
        return self.result

    def knobs(self) -> dict:
        s = self.state
        wide = {"description_width": "initial"}
        return {"replicas": w.Dropdown(options=[(f"{r} (groups of {self.DP // r})", r)
                                                for r in ch03h.REPLICAS],
                                       value=s["replicas"], description="R (--hsdp)",
                                       style=wide),
                "stage": w.Dropdown(options=[("1", 1), ("2", 2), ("3", 3)], value=s["stage"],
                                    description="ZeRO stage", style=wide)}


def hsdp_controls(**default) -> HsdpControls:
    """The panel; display ``.widget`` in JupyterLab (``.figures`` without one)."""
    return HsdpControls(**default)
