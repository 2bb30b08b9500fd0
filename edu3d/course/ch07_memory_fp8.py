"""Chapter 07's FP8 section: one tensor's scale and error, the loss in three precisions, and
ZeRO-3's gathers at half of bf16's bytes, all live on a CPU.

After reading this file you should know where each number of the section comes from:

* :func:`tensor_report` casts one tensor to E4M3 three ways (one **tensorwise** scale, a
  **rowwise** scale per row, no scale at all) with :func:`edu3d.parallel.fp8.quantize`, the
  cast the FP8 layers use: rows whose magnitudes span four decades and one outlier, so that
  the learner sees what one scale for everything costs the small rows (they sink into
  E4M3's subnormals, or to 0) and what a scale per row costs the outlier (rowwise scales
  are powers of two: the outlier lands below fmax, with a coarser step);
* :func:`live` is **one launch of 2 ranks** (:func:`record`): ZeRO-3 on dp=2 trains the
  same model from the same start in fp32, bf16 (autocast) and FP8 (the blocks' products
  emulated in FP8, :mod:`edu3d.parallel.fp8`) for a few AdamW steps, each traced as its
  own case, then the **control**: the same model under FSDP2's mixed-precision policy
  (``param_dtype=bf16``, every gather in 2 bytes) with its units cut as FP8 cuts them, one
  forward and backward (and once more in fp32, ``param_dtype=None``). It returns the
  losses and, from the trace, the bytes one gather of each ZeRO-3 unit filled;
* :func:`loss_gaps` measures how far bf16's and FP8's curves sit from fp32's (the relative
  gap, averaged over the last steps and at its worst): measured, not hidden;
* :func:`gather_table` sets the blocks' linear weights' bytes per gather in FP8 beside the
  control's bf16 and fp32's, and the whole gather beside the planner's formula
  (:func:`edu3d.plan.estimate.zero3_gather_bytes`).
"""

from __future__ import annotations

import torch

from edu3d.config.layout import Layout
from edu3d.config.sections import from_flags
from edu3d.distributed import trace
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.parallel.fp8 import quantize, split_units
from edu3d.parallel.fp8.fp8_gather import SUFFIX
from edu3d.parallel.fp8.fp8_linear import BLOCK_LINEARS
from edu3d.parallel.zero.sharding import Zero
from edu3d.parallel.zero.units import model_units
from edu3d.plan.estimate import spec_of, zero3_gather_bytes
from edu3d.train.data import SyntheticCorpus
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer

PRECISIONS = ("fp32", "bf16", "fp8")
LAYOUT = "--dp 2 --zero 3"
CONTROL = "bf16 gathers"  # the control's trace case
WIDE = "fp32 gathers"  # the same cut of units, gathered in fp32


def sample_tensor(outlier: float = 50.0, rows: int = 16, cols: int = 256,
                  seed: int = 0) -> torch.Tensor:
    """Rows of normal numbers whose magnitudes run from 1e-4 to 1, and one ``outlier`` in
    the largest row (0: none)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 0, rows).unsqueeze(1)
    if outlier:
        t[-1, 0] = outlier
    return t


def tensor_report(outlier: float = 50.0, fmt: str = "e4m3", seed: int = 0) -> dict:
    """``{"tensorwise" | "rowwise" | "unscaled": {...}}``: each cast's scale(s), relative
    error (whole tensor, and per row), share of nonzero numbers flushed to 0 and share
    saturated, plus the rows' magnitudes (``"row_amax"``)."""
    t = sample_tensor(outlier, seed=seed)
    out = {"row_amax": t.abs().amax(1).tolist()}
    for name, q in (("tensorwise", quantize(t, "tensorwise", fmt)),
                    ("rowwise", quantize(t, "rowwise", fmt)),
                    ("unscaled", quantize(t, fmt=fmt, scale=torch.tensor(1.0)))):
        rows = ((q.dequantized - t).norm(dim=1) / t.norm(dim=1)).tolist()
        out[name] = {"scale": q.scale.flatten().tolist(), "rel_error": q.rel_error,
                     "row_errors": rows, "flushed": q.flushed, "saturated": q.saturated,
                     "max_rel_error": q.max_rel_error}
    return out


def _control(mesh, x: torch.Tensor, y: torch.Tensor, config, dtype) -> list[tuple]:
    """The control: FSDP2's ``param_dtype=dtype`` (bf16; None: fp32) over the FP8 run's
    units, one forward and backward."""
    model = GPT(config, seed=0)
    weights = {getattr(getattr(b, part), attr).weight for b in model.blocks
               for part, attr in BLOCK_LINEARS}
    zero = Zero(model, mesh.group("dpcp"), 3, units=split_units(model_units(model), weights),
                reduce_scatter=True, param_dtype=dtype)
    with trace.current().context(case=CONTROL if dtype is not None else WIDE):
        model(x, y)[1].float().backward()
        zero.finish()
    return [(u.name, u.numel, u.padded) for u in zero.units]


def record(mesh, steps: int, flags: str) -> dict:
    """Launch target (dp=2): each precision's ZeRO-3 run of ``steps`` AdamW steps from the
    same start, traced by precision, then the control. Rank 0's losses are the run's (the
    trainer averages them over the ranks); returns ``{"losses": {p: [...]}, "units":
    {case: [(name, numel, padded)]}}``."""
    losses, units = {}, {}
    for p in PRECISIONS:
        run = from_flags(f"{LAYOUT} {flags} --precision {p}".split())
        check_args(run)
        config = model_config(run)
        corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=run.training.seed)
        trainer = Trainer(GPT(config, seed=run.training.seed), mesh, run)
        with trace.current().context(case=p):
            losses[p] = [trainer.step(*corpus.batch(s, run.batch.global_batch), s)["loss"]
                         for s in range(1, steps + 1)]
        units[p] = [(u.name, u.numel, u.padded) for u in trainer.par.zero.units]
    x, y = corpus.batch(1, run.micro_batch)
    units[CONTROL] = _control(mesh, x, y, config, torch.bfloat16)
    units[WIDE] = _control(mesh, x, y, config, None)
    return {"losses": losses, "units": units}


def gathers(events: list[dict], units: dict) -> dict:
    """``{case: {unit name: bytes of one all-gather}}`` from rank 0's trace (every gather
    of a unit fills the same buffer)."""
    out: dict = {}
    for ev in events:
        if ev["rank"] == 0 and ev["op"] == "all_gather" and "chunk" in ev and ev.get("case"):
            out.setdefault(ev["case"], {})[units[ev["case"]][ev["chunk"]][0]] = ev["bytes"]
    return out


def live(steps: int = 20, flags: str = "--lr 3e-3") -> dict:
    """One launch of 2 ranks (:func:`record`); ``flags``: more ``edu3d train`` flags for all
    three runs (``--fp8-scaling rowwise``, ``--fp8-recipe delayed``, ``--lr``...). Returns
    the losses, each case's bytes per unit gather and the flags."""
    lay = from_flags(LAYOUT.split()).layout
    res = launch(record, lay.world_size, args=(steps, flags), layout=Layout(dp=lay.dp),
                 timeout=300, name="ch07-fp8")
    out = res.results[0]
    return {"losses": out["losses"], "gathers": gathers(res.events(), out["units"]),
            "flags": flags}


def loss_gaps(losses: dict, last: int = 10) -> dict:
    """``{precision: {"mean": ..., "worst": ...}}``: the relative gap of each curve to
    fp32's, averaged over the ``last`` steps and the largest of any step."""
    ref = losses["fp32"]
    out = {}
    for p, curve in losses.items():
        gaps = [abs(a - b) / abs(b) for a, b in zip(curve, ref)]
        out[p] = {"mean": sum(gaps[-last:]) / len(gaps[-last:]), "worst": max(gaps)}
    return out


def gather_table(result: dict) -> dict:
    """Bytes per gather: the blocks' linear weights in FP8, in the bf16 control and in fp32;
    and one gather of every unit in each case beside the planner's formula."""
    g = result["gathers"]
    low = {n: b for n, b in g["fp8"].items() if n.endswith(SUFFIX)}
    whole = {case: sum(b.values()) for case, b in g.items()}
    formula = {}
    for p in ("fp32", "fp8"):
        run = from_flags(f"{LAYOUT} {result['flags']} --precision {p}".split())
        formula[p] = zero3_gather_bytes(spec_of(run), run)
    return {"weights": {"fp8": sum(low.values()), "bf16": sum(g[CONTROL][n] for n in low),
                        "fp32": sum(g[WIDE][n] for n in low)},
            "whole": whole, "formula": formula}
