"""``edu3d plan --validate`` and the prediction ``edu3d plan`` prints beside a layout's memory.

After reading this file you should know the two ways the command line shows the performance
model (:mod:`edu3d.plan.step`):

* ``edu3d plan --validate [--hardware NAME|FILE.json] [--json]``: every published run
  (:mod:`edu3d.plan.published`) predicted beside what it measured, with the error, and the
  median and worst error per framework and overall (:mod:`edu3d.plan.validate`). With
  ``--hardware`` only the rows measured on that profile, predicted with it (a profile file
  whose ``name`` is a row's hardware tries new constants against that hardware's rows);
* ``edu3d plan --model ... --dp ... --hardware h100-sxm --recipe megatron``: the layout's
  predicted step time, tokens/s, MFU and the parts of the step, under the memory table.

A bad profile, an unknown profile or recipe, or a table row the model cannot read is refused
in one line (exit 2). No torch.
"""

from __future__ import annotations

import json
import sys

from edu3d.config.sections import Run
from edu3d.model.shapes import ModelSpec
from edu3d.plan.hardware import ProfileError
from edu3d.plan.published import RunError
from edu3d.plan.recipes import RECIPES
from edu3d.plan.step import Prediction
from edu3d.plan.validate import summary, table, validate

MFU_IS_PREDICTED = ("--mfu: MFU is now what the model predicts from the shapes and the "
                    "hardware profile, not an input; to change how fast large matmuls run, give "
                    "--hardware FILE.json with another matmul_efficiency")


def validation_main(args) -> int:
    """Print the validation table (or its JSON): 0, or 2 for a bad profile or table."""
    try:
        rows = validate(args.hardware if args.hardware_given else None)
    except (ProfileError, RunError, ValueError) as err:
        print(f"edu3d plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"rows": [row_json(r) for r in rows], "summary": summary(rows)}))
        return 0
    print(table(rows))
    return 0


def row_json(row) -> dict:
    """One validation row as JSON (the prediction's parts in seconds)."""
    return {"id": row.id, "framework": row.framework, "hardware": row.hardware,
            "metric": row.metric, "measured": row.measured, "predicted": row.predicted,
            "error": row.error, "memory_gib": row.memory_measured,
            "memory_predicted_gib": row.memory_predicted, "memory_error": row.memory_error,
            "assumed": row.assumed, "parts": row.prediction.parts}


def prediction_json(pred: Prediction) -> dict:
    """What ``edu3d plan --json`` adds under ``"prediction"``."""
    return {"step_time_s": pred.step_time, "tokens_per_s": pred.tokens_per_s,
            "tokens_per_s_per_gpu": pred.tokens_per_s_per_gpu, "mfu": pred.mfu,
            "parts": pred.parts, "matmul_efficiency": pred.matmul_efficiency,
            "memory": pred.memory, "hardware": pred.profile, "recipe": pred.recipe}


def prediction_lines(spec: ModelSpec, run: Run, pred: Prediction) -> list[str]:
    """The prediction in words: step, throughput, MFU, and its parts."""
    parts = ", ".join(f"{k} {v:.3g} s" for k, v in pred.parts.items() if v)
    out = [f"predicted on {pred.profile} ({pred.recipe} recipe): {pred.step_time:.3g} s per step, "
           f"{pred.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {pred.mfu:.1%} "
           f"(matmuls at {pred.matmul_efficiency:.0%} of peak)", f"  parts: {parts}"]
    if pred.recipe != "edu3d":
        mem = pred.memory
        out.append(f"  memory with the {pred.recipe} recipe: {mem['allocated'] / 1e9:.1f} GB "
                   f"allocated, {mem['device'] / 1e9:.1f} GB on the device (allocator and "
                   "runtime included)")
    return out


def recipe_names() -> tuple[str, ...]:
    return tuple(RECIPES)
