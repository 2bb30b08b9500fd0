"""Chapter 13's panels: who computes what, the merge, and what each exchange costs.

After reading this file you should know what the knobs change:

* :class:`BlockControls` (section 1): the cp degree, the split and the sequence length redraw
  the score-owner map and the work per rank at once (the formula and the ring's block rule);
  "run it" launches ``cp`` ranks of ring attention and draws their counters beside them;
* :class:`MergeControls` (section 3): where the keys are cut and which numbers redraw the
  merge of one query's two partial results; the button draws new numbers;
* :class:`ExchangeControls` (section 4): cp, the sequence and the heads redraw the bytes
  ring, all-gather and Ulysses send per layer (formulas; Ulysses left out, with the reason,
  when cp does not divide the heads); "run it" launches the three exchanges on cp ranks and
  draws the measured bytes;
* :class:`ScaleControls` (section 5): one layer's measured activations against s and cp, and
  the same law at Llama 3 8B's size: tp and the context length redraw its activations per GPU
  for each cp degree; "run it" measures the layer again.

Every takeaway that states a number or a comparison is computed from the data drawn.
"""

from __future__ import annotations

import ipywidgets as w

from edu3d.course import ch13_context_parallelism as ch13
from edu3d.parallel.cp import IMPLS, check, positions, work
from edu3d.widgets.context import (activation_figure, exchange_figure, merge_figure,
                                   scale_figure, score_blocks_figure)
from edu3d.widgets.panels.panel import MAX_RUN_RANKS, Panel, choices

HEAD_DIM = ch13.LESSON["head_dim"]


class BlockControls(Panel):
    """cp, split and sequence length -> the score-owner map and the work per rank."""

    FIGURES = ("fig",)

    def __init__(self, default: dict | None = None):
        super().__init__({"cp": 4, "split": "zigzag", "seq_len": 32, **(default or {})})
        self.fig = None
        self.redraw()

    def problem(self) -> str | None:
        s = self.state
        try:
            check(s["seq_len"], s["cp"], s["split"])
        except ValueError as exc:
            return f"{exc} (or another cp)"
        return None

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        bad = self.problem()
        if bad is None:
            self.fig = score_blocks_figure(
                ch13.owner_map(s["seq_len"], s["cp"], s["split"]), s["cp"], s["split"],
                work(s["seq_len"], s["cp"], s["split"]),
                ch13.ring_block_work(s["seq_len"], s["cp"], s["split"]))
        self.say(bad or "")

    def run(self, timeout: float = 120):
        s = self.state
        reason = self.problem() or (
            "cp=1 has no ring: choose cp 2 or more" if s["cp"] < 2 else None) or (
            f"the real run is limited to {MAX_RUN_RANKS} ranks: choose a smaller cp"
            if s["cp"] > MAX_RUN_RANKS else None)
        if self.refuse(reason):
            return None
        self.say(f"running ring attention on {s['cp']} ranks ...")
        run = self.launch(ch13.work_run, s["cp"], args=(s["seq_len"], s["split"]),
                          timeout=timeout)
        if run is None:
            return None
        self.result = run
        measured = [run.results[r] for r in range(s["cp"])]
        self.fig = score_blocks_figure(
            ch13.owner_map(s["seq_len"], s["cp"], s["split"]), s["cp"], s["split"],
            work(s["seq_len"], s["cp"], s["split"]),
            ch13.ring_block_work(s["seq_len"], s["cp"], s["split"]), measured)
        self.say(f"measured per rank: {measured}")
        return run

    def knobs(self) -> dict:
        s = self.state
        return {"cp": w.Dropdown(options=choices([1, 2, 4, 8], s["cp"]), value=s["cp"],
                                 description="cp"),
                "split": w.Dropdown(options=["zigzag", "plain"], value=s["split"],
                                    description="split"),
                "seq_len": w.Dropdown(options=choices([16, 32, 48, 64], s["seq_len"]),
                                      value=s["seq_len"], description="seq_len")}


class MergeControls(Panel):
    """Where the keys are cut, and which random numbers -> one query's merge."""

    FIGURES = ("fig",)
    button = "new numbers"
    button_style = ""
    tooltip = "draw other random queries, keys and values"

    def __init__(self, default: dict | None = None):
        super().__init__({"cut": 4, "seed": 0, **(default or {})})
        self.fig = self.demo = None
        self.redraw()

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        self.demo = ch13.merge_demo(cut=self.state["cut"], seed=self.state["seed"])
        self.fig = merge_figure(self.demo)
        self.say("")

    def run(self):
        self.redraw(seed=self.state["seed"] + 1)
        self.sync_knobs()

    def knobs(self) -> dict:
        return {"cut": w.IntSlider(min=1, max=7, value=self.state["cut"],
                                   description="keys cut at"),
                "seed": w.IntSlider(min=0, max=99, value=self.state["seed"],
                                    description="numbers")}


class ExchangeControls(Panel):
    """cp, sequence, heads -> the bytes each exchange sends per layer (section 4)."""

    FIGURES = ("bytes_fig",)

    def __init__(self, default: dict | None = None):
        super().__init__({"cp": 4, "seq_len": 32, "heads": 4, **(default or {})})
        self.bytes_fig = None
        self.redraw()

    def impls(self) -> list[str]:
        """The implementations the current cp can run (Ulysses needs cp to divide heads)."""
        return [i for i in IMPLS if i != "ulysses" or self.state["heads"] % self.state["cp"]
                == 0]

    def formulas(self) -> dict:
        s = self.state
        f = ch13.impl_formulas(s["seq_len"], s["cp"], s["heads"] * HEAD_DIM)
        return {i: f[i] for i in self.impls()}

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        s = self.state
        note = "" if "ulysses" in self.impls() else (
            f"Ulysses left out: it gives each rank heads/cp heads, and cp={s['cp']} does not "
            f"divide heads={s['heads']} (Ulysses degrees: "
            f"{ch13.ulysses_degrees(s['heads'])}); raise heads or lower cp")
        self.bytes_fig = exchange_figure(None, self.formulas(), cp=s["cp"])
        self.say(note)

    def run(self, timeout: float = 120):
        s = self.state
        if self.refuse(f"the real run is limited to {MAX_RUN_RANKS} ranks: choose a smaller cp"
                       if s["cp"] > MAX_RUN_RANKS else None):
            return None
        try:
            positions(s["seq_len"], s["cp"], 0)
        except ValueError as err:
            self.refuse(f"{err} (the seq_len knob)")
            return None
        self.say(f"running ring, all-gather and Ulysses on {s['cp']} ranks ...")
        run = self.launch(ch13.exchange_run, s["cp"], args=(s["seq_len"], s["heads"],
                                                            tuple(self.impls())),
                          timeout=timeout)
        if run is None:
            return None
        self.result = run
        measured = ch13.impl_bytes(run.events(), rank=0)
        self.bytes_fig = exchange_figure({i: measured[i] for i in self.impls()},
                                         self.formulas(), run.results[0], cp=s["cp"])
        self.say(f"ran {s['cp']} ranks in {run.elapsed_s:.0f} s")
        return run

    def knobs(self) -> dict:
        s = self.state
        return {"cp": w.Dropdown(options=choices([2, 4, 8, 16], s["cp"]), value=s["cp"],
                                 description="cp"),
                "seq_len": w.Dropdown(options=choices([32, 64, 128, 256], s["seq_len"]),
                                      value=s["seq_len"], description="seq_len"),
                "heads": w.Dropdown(options=choices([1, 2, 4, 8], s["heads"]),
                                    value=s["heads"], description="heads")}


class ScaleControls(Panel):
    """Section 5: one layer's measured activations against s and cp (``sweep``, rows of
    :func:`~edu3d.course.ch13_context_parallelism.activation_sweep`), and the same law at
    Llama 3 8B's size: tp and the context length redraw its activations per GPU; "run it"
    measures the tiny layer again on 4 ranks."""

    FIGURES = ("memory_fig", "scale_fig")

    def __init__(self, sweep: list[dict], default: dict | None = None):
        super().__init__({"tp": 1, "context_k": 128, **(default or {})})
        self.sweep = sweep
        self.memory_fig = self.scale_fig = None
        self.redraw()

    def redraw(self, **changes) -> None:
        self.state.update(changes)
        tp, tokens = self.state["tp"], self.state["context_k"] * 1024
        self.memory_fig = activation_figure(self.sweep, extra=ch13.ring_extra_bytes)
        self.scale_fig = scale_figure(ch13.playbook_scale(tp=tp, model={"seq_len": tokens}),
                                      name=f"Llama 3 8B, tp={tp}", seq_len=tokens)
        self.say("")

    def run(self, timeout: float = 120):
        self.say("measuring one layer's activations on 4 ranks ...")
        run = self.launch(ch13.activation_sweep, 4, timeout=timeout)
        if run is None:
            return None
        self.result, self.sweep = run, run.results[0]
        self.redraw()
        self.say(f"measured {len(self.sweep)} settings in {run.elapsed_s:.0f} s")
        return run

    def knobs(self) -> dict:
        s = self.state
        return {"tp": w.Dropdown(options=choices([1, 2, 4, 8], s["tp"]), value=s["tp"],
                                 description="8B's tp"),
                "context_k": w.Dropdown(options=choices([32, 128, 512, 1024], s["context_k"]),
                                        value=s["context_k"], description="8B's context (k)")}


def block_controls(default: dict | None = None) -> BlockControls:
    """Section 1's controls; display ``.widget`` in JupyterLab, ``.fig`` without one."""
    return BlockControls(default)


def merge_controls(default: dict | None = None) -> MergeControls:
    """Section 3's controls."""
    return MergeControls(default)


def exchange_controls(default: dict | None = None) -> ExchangeControls:
    """Section 4's controls."""
    return ExchangeControls(default)


def scale_controls(sweep: list[dict], default: dict | None = None) -> ScaleControls:
    """Section 5's controls, drawn from the measured ``sweep`` first."""
    return ScaleControls(sweep, default)
