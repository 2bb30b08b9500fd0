"""Chapter 07's recomputation numbers: what one layer keeps for backward, and what it costs.

After reading this file you should know where the chapter's recomputation table comes from.
:func:`recompute_sweep` is a launch target (``launch(recompute_sweep, 4,
layout=Layout(tp=4))``): for tp = 1, 2, 4 (sub-meshes of the launched ranks), SP off and on,
and each of ``none``, ``selective`` and ``full``, it builds one real layer of the course's
GPT (tensor-parallel, then recomputing, in :func:`~edu3d.parallel.parallelize.parallelize`'s
order) and returns per row:

* ``measured``: the bytes autograd saved during the layer's forward, counted by hooking
  every save (:func:`edu3d.distributed.meter.measure_activations`: each storage once, parameters not
  counted; a checkpointed region contributes exactly its inputs);
* ``formula``: :func:`edu3d.plan.formulas.layer_activation_bytes`, the exact count for
  this layer in fp32, and ``korthikanti``: the paper's 16-bit count
  (:func:`edu3d.plan.formulas.activation_bytes_per_layer`), with their ratio;
* ``step_ms``: the median time of a forward and backward through a stack of such layers,
  and ``slowdown``, that time over the same layout's without recomputation
  (:func:`time_modes`; a busy laptop makes these noisy, the bytes never are).
"""

from __future__ import annotations

import statistics
import time

import torch

from edu3d.distributed.meter import measure_activations
from edu3d.plan.formulas import activation_bytes_per_layer, layer_activation_bytes
from edu3d.config.layout import Layout
from edu3d.distributed.mesh import Mesh
from edu3d.model.gpt import GPT, GPTConfig
from edu3d.parallel.recompute import MODES, apply_recompute
from edu3d.parallel.tp import ops
from edu3d.parallel.tp.apply import apply_tp


def _model(config: GPTConfig, tp_group, sp: bool, mode: str, seed: int = 0) -> GPT:
    """The serial GPT made tensor-parallel over ``tp_group`` (None: serial), then recomputing."""
    model = GPT(config, seed)
    if tp_group is not None:
        apply_tp(model, tp_group, sequence_parallel=sp)
    return apply_recompute(model, mode)


def _input(config: GPTConfig, batch: int, t: int, index: int, sp: bool, seed: int = 0):
    """A deterministic residual stream ``[b, s, h]`` (this rank's ``s/t`` tokens under SP)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, config.seq_len, config.d_model, generator=g)
    if sp:
        x = x.chunk(t, dim=1)[index]
    return x.contiguous().requires_grad_()


def measure_layer(config: GPTConfig, batch: int, tp_group=None, sp: bool = False,
                  mode: str = "none") -> int:
    """Bytes one layer (``blocks[0]``) saves for backward on this rank."""
    t = 1 if tp_group is None else ops.group_size(tp_group)
    index = 0 if tp_group is None else ops.group_rank(tp_group)
    block = _model(config, tp_group, sp, mode).blocks[0]
    x = _input(config, batch, t, index, sp)
    return measure_activations(lambda: block(x), exclude=block.parameters())


def time_modes(config: GPTConfig, batch: int, tp_group=None, sp: bool = False,
               repeats: int = 5) -> dict[str, float]:
    """Median milliseconds of forward + backward through the model's blocks (the embedding
    and head left out: recomputation does not touch them), per mode
    (:func:`time_rounds`)."""
    return {m: statistics.median(ts) for m, ts in
            time_rounds(config, batch, tp_group, sp, repeats).items()}


def time_rounds(config: GPTConfig, batch: int, tp_group=None, sp: bool = False,
                repeats: int = 5) -> dict[str, list[float]]:
    """Milliseconds of forward + backward through the blocks, per mode and round. The modes
    take turns, one repetition each, so a machine that gets busier slows them all alike and
    round ``i`` of two modes can be compared; the first round is thrown away (warm-up).
    Collective under TP."""
    t = 1 if tp_group is None else ops.group_size(tp_group)
    index = 0 if tp_group is None else ops.group_rank(tp_group)
    blocks = {m: _model(config, tp_group, sp, m).blocks for m in MODES}
    x = _input(config, batch, t, index, sp)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(repeats + 1):
        for mode in MODES:
            t0 = time.perf_counter()
            y = x
            for block in blocks[mode]:
                y = block(y)
            y.backward(torch.ones_like(y))
            times[mode].append(time.perf_counter() - t0)
            blocks[mode].zero_grad(set_to_none=True)
    return {m: [1e3 * t for t in ts[1:]] for m, ts in times.items()}


def recompute_sweep(mesh, config: GPTConfig, batch: int = 2, time_repeats: int = 5,
                    max_tp: int | None = None) -> list[dict]:
    """Every (tp, sp, mode) row on this rank: measured bytes, the two formulas, step time
    and the slowdown against no recomputation (median and range over the rounds).
    tp runs over 1, 2, 4, ... up to the launched world or ``max_tp``, while it divides the
    heads and the sequence (``mesh`` of any layout; sub-meshes are built, collectively, for
    the other tp sizes)."""
    n = 1 if mesh is None else mesh.layout.world_size
    rows, t = [], 1
    s, h, a = config.seq_len, config.d_model, config.n_heads
    while t <= min(n, max_tp or n) and a % t == 0 and s % t == 0:
        if t == 1:
            group = None
        elif t == mesh.size("tp"):
            group = mesh.tp
        else:
            group = Mesh.build(Layout(dp=n // t, tp=t)).tp
        for sp in ((False, True) if t > 1 else (False,)):
            rounds = time_rounds(config, batch, group, sp, time_repeats) if time_repeats \
                else {}
            ms = {m: statistics.median(ts) for m, ts in rounds.items()}
            for mode in MODES:
                # the slowdown of each round against the same round without recomputation
                ratios = sorted(a / b for a, b in zip(rounds.get(mode, ()),
                                                      rounds.get("none", ())))
                measured = measure_layer(config, batch, group, sp, mode)
                formula = layer_activation_bytes(s, batch, h, a, t, sp, mode)
                paper = activation_bytes_per_layer(s, batch, h, a, t, sp, recompute=mode)
                rows.append({"tp": t, "sp": sp, "mode": mode, "measured": measured,
                             "formula": formula, "korthikanti": paper,
                             "ratio_to_korthikanti": measured / paper,
                             "step_ms": ms.get(mode),
                             "slowdown": statistics.median(ratios) if ratios else None,
                             "slowdown_range": (ratios[0], ratios[-1]) if ratios else None})
        t *= 2
    return rows


def table(rows: list[dict]) -> str:
    """The sweep as aligned text (bytes are exact; times vary from run to run)."""
    lines = [f"{'tp':>2} {'sp':>3} {'mode':>9} {'measured':>9} {'formula':>9} "
             f"{'paper16':>9} {'ratio':>5} {'ms':>7} {'x none':>6}"]
    for r in rows:
        ms = "" if r["step_ms"] is None else f"{r['step_ms']:7.1f} {r['slowdown']:6.2f}"
        lines.append(f"{r['tp']:>2} {'on' if r['sp'] else 'off':>3} {r['mode']:>9} "
                     f"{r['measured']:>9} {r['formula']:>9} {r['korthikanti']:>9.0f} "
                     f"{r['ratio_to_korthikanti']:5.2f} {ms}")
    return "\n".join(lines)


def recompute_takeaway(rows: list[dict]) -> str:
    """What the sweep measured for full and selective recomputation on one rank (tp = 1),
    from its numbers, and what a GPU would show."""
    by = {r["mode"]: r for r in rows if r["tp"] == 1 and not r["sp"]}
    full, sel, none = by["full"], by["selective"], by["none"]
    lo, hi = full["slowdown_range"] or (full["slowdown"], full["slowdown"])
    return (f"Full keeps {full['measured'] / none['measured']:.0%} of the bytes for "
            f"{full['slowdown']:.2f}x the time ({lo:.2f}-{hi:.2f} over the rounds); "
            f"selective keeps {sel['measured'] / none['measured']:.0%} for "
            f"{sel['slowdown']:.2f}x.<br>The FLOPs predict 1.33x for full (one more forward on "
            "top of forward + backward, which a compute-bound GPU comes close to);<br>on this "
            "CPU the time outside the recomputed matrix products changes the ratio.")
