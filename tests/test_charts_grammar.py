"""Every chart keeps the visual grammar: a named legend, the shown step from 0 ms, a replay
whose picture, label and slider agree, send and receive told apart.

Every ``*_figure`` function in ``widgets/*.py`` (the charts; ``widgets/panels/`` holds the
knobs) is built here from synthetic data with the schema of the real runs (:data:`BUILDERS`);
a new figure function without a builder fails :func:`test_every_figure_function_is_walked`,
so the walk stays complete.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest
import torch

import edu3d.widgets as widgets_pkg
from edu3d.course.ch01_collectives import ring_all_reduce_s, ring_step_costs
from edu3d.course.ch02_data_parallel import simulate_dp_step
from edu3d.course.ch03_zero import course_config, zero_prediction
from edu3d.course.ch04_tensor_parallel import (tp_activation_prediction,
                                               tp_collectives_prediction, tp_layer_config)
from edu3d.course.ch05_pipeline_parallel import pp_bubble_curve
from edu3d.course import ch11_review_recipe as recipe
from edu3d.course.ch11_review import plan, zero_traffic_gb
from edu3d.config.layout import Layout
from edu3d.widgets import style


# ---- synthetic inputs, one per figure function ---------------------------------------------
def ring_events(n: int = 4, chunk_bytes: int = 4000, case: str = "demo") -> list[dict]:
    """The sends of a ring all-reduce as :func:`edu3d.distributed.algorithms.ring_all_reduce` traces them."""
    out = []
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(n - 1):
            for r in range(n):
                chunk = (r - step) % n if phase == "reduce_scatter" else (r + 1 - step) % n
                out.append({"rank": r, "lane": "comm", "op": "send", "peer": (r + 1) % n,
                            "bytes": chunk_bytes, "algo": "ring_all_reduce", "phase": phase,
                            "ring_step": step, "chunk": chunk, "case": case,
                            "t0": 1.0, "t1": 2.0})
    return out


def gallery_results(n: int = 4) -> list[dict]:
    ops = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    return [{op: {"before": [10 * r + i for i in range(4)],
                  "after": None if op == "reduce" and r else [float(i) for i in range(4)]}
             for op in ops} for r in range(n)]


def comm_report() -> dict:
    rows = []
    for k, b in enumerate((1024, 16384, 262144)):
        row = {"op": "all_reduce", "bytes": b, "reference": "gloo (dist.all_reduce)"}
        for key in ("edu3d", "reference"):
            row |= {f"{key}_s": 1e-4 * (k + 1), f"{key}_model_s": 1e-4 * (k + 1),
                    f"{key}_alpha_s": 5e-5, f"{key}_beta_s_per_byte": 1e-9}
        rows.append(row)
    return {"world_size": 4, "results": rows}


def dp_step_events(case: str = "bucketed", step: int = 3, t_start: float = 3.3e6) -> list[dict]:
    """One DP step far along a run's clock (3.3 s in), as the chapter-02/03 runs record it."""
    out = []
    for r in range(2):
        t = t_start
        for op, dur in (("F", 2000.0), ("B", 4000.0)):
            out.append({"rank": r, "lane": "compute", "op": op, "t0": t, "t1": t + dur,
                        "step": step, "case": case})
            t += dur
        out.append({"rank": r, "lane": "comm", "op": "all_reduce", "group": "dp", "n": 2,
                    "bytes": 4096, "t0": t - 1500, "t1": t + 300, "step": step, "case": case})
        out.append({"rank": r, "lane": "comm", "op": "all_gather", "group": "dp", "n": 2,
                    "bytes": 4096, "t0": t - 1000, "t1": t - 500, "step": step, "case": case})
    return out


def split_results(t: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, generator=g), torch.randn(4, 6, generator=g)
    serial = x @ w
    out = []
    for r in range(t):
        cols = w.chunk(t, 1)[r]
        rows_x, rows_w = x.chunk(t, 1)[r], w.chunk(t, 0)[r]
        out.append({"serial": serial,
                    "column": {"x": x, "w": cols, "partial": x @ cols, "result": serial},
                    "row": {"x": rows_x, "w": rows_w, "partial": rows_x @ rows_w,
                            "result": serial}})
    return out


def zero_mem_events(step: int = 2) -> list[dict]:
    return [{"rank": 0, "lane": "mem", "op": "mem", "t0": 5e6 + 100 * i, "t1": 5e6 + 100 * i,
             "step": step, "case": "zero3", "mem": {"params": 1000 + 500 * (i % 2)}}
            for i in range(8)]


def _ring_costs():
    return ring_step_costs(4, 4000, alpha=1e-4, beta=1e-9)


def _bucket_sim():
    params = [("tok_emb.weight", 4096), ("blocks.0.w", 8192), ("lm_head.weight", 4096)]
    return simulate_dp_step(params, 0.02, True, 2)


def _pipeline():
    from edu3d.widgets.pipeline import synthetic_trace

    return synthetic_trace("1f1b", 2, 4)


BUILDERS = {
    "collectives.gallery_figure": lambda m: m.gallery_figure(gallery_results(), "all_reduce"),
    "collectives.ring_replay_figure": lambda m: m.ring_replay_figure(ring_events(), 4, 16000,
                                                                     case="demo"),
    "collectives.bytes_figure": lambda m: m.bytes_figure({2: 4000, 3: 5333, 4: 6000}, 8000),
    "collectives.cost_model_figure": lambda m: m.cost_model_figure(comm_report()),
    "mesh3d.mesh_figure": lambda m: m.mesh_figure(Layout(dp=2, tp=2, pp=2)),
    "overlap.overlap_figure": lambda m: m.overlap_figure(dp_step_events(), "bucketed", 3),
    "overlap.traffic_figure": lambda m: m.traffic_figure({"dp": 2.0, "zero3": 3.01},
                                                         {"dp": 2, "zero3": 3}),
    "overlap.compression_figure": lambda m: m.compression_figure(
        {"none": {"losses": [5.0, 4.0, 3.0], "param_rel_diff": 0.0},
         "fp16": {"losses": [5.0, 4.0, 3.1], "param_rel_diff": 1e-4}}),
    "pipeline.compare_figure": lambda m: m.compare_figure(
        [{"name": "1f1b", "pp": 2, "m": 4, "events": _pipeline()},
         {"name": "gpipe", "pp": 2, "m": 4, "events": m.synthetic_trace("gpipe", 2, 4)}]),
    "pipeline.pipeline_figure": lambda m: m.pipeline_figure(_pipeline(), "1f1b", 2, 4),
    "tensor_split.split_figure": lambda m: m.split_figure(split_results(), "row"),
    "timeline.timeline_figure": lambda m: m.timeline_figure(dp_step_events(), title="DP step"),
    "zero.sharding_map_figure": lambda m: m.sharding_map_figure(
        [("embed", 10, 12), ("block0", 20, 20)], 4, stage=2),
    "zero.memory_bars_figure": lambda m: m.memory_bars_figure(
        {s: {"params": 4e5, "grads": 4e5, "optimizer": 8e5, "total": 1.6e6} for s in range(4)},
        100_000, 4),
    "zero.resident_params_figure": lambda m: m.resident_params_figure(
        zero_mem_events(), 1000, 4, 2, case="zero3"),
    "collectives.ring_steps_figure": lambda m: m.ring_steps_figure(
        _ring_costs(), 4, 16000, [{**r, "s": 2 * r["s"]} for r in _ring_costs()],
        alpha=1e-4, beta=1e-9),
    "collectives.alpha_beta_figure": lambda m: m.alpha_beta_figure(
        4, 1 << 20, alpha=1e-4, beta=1e-9, time_s=ring_all_reduce_s, measured_s=2e-3),
    "overlap.bucket_timeline_figure": lambda m: m.bucket_timeline_figure(
        _bucket_sim(), _bucket_sim()["events"], bucket_mb=0.1, reverse=True),
    "review.ring_figure": lambda m: m.ring_figure(8),
    "review.zero_figure": lambda m: m.zero_figure("llama2-7b", 64),
    "review.zero_traffic_figure": lambda m: m.zero_traffic_figure(zero_traffic_gb()),
    "review.activations_figure": lambda m: m.activations_figure("gpt3-175b"),
    "review.tp_figure": lambda m: m.tp_figure(plan("llama2-7b", 16), "llama2-7b", 16),
    "review.in_flight_figure": lambda m: m.in_flight_figure(4, 8, ("gpipe", "1f1b", "zb-h1")),
    "review.layout_figure": lambda m: m.layout_figure(plan("llama2-13b", 16), "llama2-13b", 16),
    "review.recipe_figure": lambda m: m.recipe_figure(recipe.decisions(), recipe.STEPS),
    "review.zero_measured_figure": lambda m: m.zero_measured_figure(
        [{"zero": z, "dp": 4, "measured": 1000 * (4 - z), "estimate": 1000 * (4 - z)}
         for z in range(4)]),
    "perf.op_table_figure": lambda m: m.op_table_figure(
        [{"name": "aten::mm", "calls": 35, "self_ms": 3.0, "total_ms": 3.1},
         {"name": "c10d::allreduce_", "calls": 8, "self_ms": 2.0, "total_ms": 2.0},
         {"name": "Optimizer.step#AdamW.step", "calls": 1, "self_ms": 4.0, "total_ms": 5.0},
         {"name": "aten::gelu_backward", "calls": 4, "self_ms": 0.5, "total_ms": 0.5}]),
    "perf.budget_figure": lambda m: m.budget_figure(
        {"overlap off (predicted)": {"compute": 20, "exposed": 8, "idle": 0, "comm": 8},
         "overlap off": {"compute": 22, "exposed": 9, "idle": 2, "comm": 9}},
        ghosts=("overlap off (predicted)",), title="dp2 step", takeaway="k"),
    "perf.scaling_figure": lambda m: m.scaling_figure(
        [{"name": "dp1", "world_size": 1, "median_s": 0.012, "tokens_per_s": 21000},
         {"name": "dp2", "world_size": 2, "median_s": 0.02, "tokens_per_s": 12800},
         {"name": "dp4", "world_size": 4, "median_s": 0.1, "tokens_per_s": 2560}], 2),
    "perf.bench_figure": lambda m: m.bench_figure(
        {"benchmark": "dp", "world_size": 2, "results": [
            {"name": "bucketed DDP step (tiny)", "edu3d_s": 0.022, "reference_s": 0.02,
             "reference": "torch.nn.parallel.DistributedDataParallel", "ratio": 1.1,
             "goal": 1.05}]}),
    "perf.prediction_figure": lambda m: m.prediction_figure(
        {"dp2": {"compute": 10.0, "exposed": 3.0, "idle": 0.0, "step": 13.0},
         "pp2": {"compute": 10.0, "exposed": 1.0, "idle": 2.5, "step": 13.5}},
        "pp2", {"dp2": 30.0}),
    "perf.predicted_measured_figure": lambda m: m.predicted_measured_figure(
        [{"name": "dp2", "predicted": 30.0, "measured": 33.0, "error": -0.09},
         {"name": "pp2", "predicted": 41.0, "measured": 36.0, "error": 0.14}]),
    "perf.published_figure": lambda m: m.published_figure(
        {"points": [{"id": "a-1", "framework": "megatron-lm", "metric": "mfu",
                     "measured": 0.45, "predicted": 0.47, "error": 0.04, "miss": None},
                    {"id": "b-1", "framework": "torchtitan", "metric": "tokens_per_s",
                     "measured": 5600.0, "predicted": 5100.0, "error": -0.09, "miss": None},
                    {"id": "b-2", "framework": "torchtitan", "metric": "tokens_per_s",
                     "measured": 7000.0, "predicted": 12000.0, "error": 0.71,
                     "miss": "host-bound"}],
         "summary": {"overall": {"throughput": {"rows": 3, "median": 0.09, "worst": 0.71}},
                     "torchtitan": {"throughput": {"rows": 2, "median": 0.4, "worst": 0.71}}}},
        source="torchtitan"),
}


def _zero_panel(stage: int = 2):
    pred = zero_prediction(course_config(), 4, stage)
    return pred, {"stage": stage, "memory": {0: pred["estimate"][stage]},
                  "traffic": pred["traffic"][stage] * 1.0001}


def _tp_panel():
    config = tp_layer_config()
    return config, tp_collectives_prediction(config, 2, 2, True)


def _hsdp_rows():
    """Chapter 03's HSDP rows, the run's readings as the formula's (R = 4 not run)."""
    from edu3d.course import ch03_zero_hsdp

    rows = ch03_zero_hsdp.table()
    for row in rows[:2]:
        row.update({f"{k}_measured": row[k] for k in ("shard", "replicate", "params", "grads",
                                                       "optimizer")})
    return rows


def _tp_activations():
    config = tp_layer_config()
    return {(k, on): tp_activation_prediction(config, 2, k, on)
            for k in (1, 2, 4, 8) for on in (False, True)}


BUILDERS.update({
    "zero.zero_memory_figure": lambda m: m.zero_memory_figure(*_zero_panel()),
    "zero.zero_traffic_figure": lambda m: m.zero_traffic_figure(*_zero_panel()),
    "zero.hsdp_figure": lambda m: m.hsdp_figure(_hsdp_rows(), 2),
    "tp_layer.tp_collectives_figure": lambda m: m.tp_collectives_figure(
        _tp_panel()[1], 2, True, _tp_panel()[1]),
    "tp_layer.tp_memory_figure": lambda m: m.tp_memory_figure(
        _tp_activations(), _tp_panel()[0], 2, 2, True, {"measured": 527360}),
    "pipeline.bubble_figure": lambda m: m.bubble_figure(
        pp_bubble_curve("interleaved", 2, 2, tuple(range(1, 17)), 0.05), "interleaved", 2, 4,
        2, 0.15),
})


def _ring():
    from edu3d.course import ch13_context_parallelism_ring as ring

    return ring


def _ch13():
    from edu3d.course import ch13_context_parallelism as ch13

    return ch13


BUILDERS.update({
    "context.score_blocks_figure": lambda m: m.score_blocks_figure(
        _ch13().owner_map(16, 2, "plain"), 2, "plain", [36, 100], [48, 112], [48, 112]),
    "context.ring_steps_figure": lambda m: m.ring_steps_figure(
        [{"rank": r, "phase": p, "ring_step": 0, "kind": k, "peer": (r + 1) % 2, "bytes": 8,
          "t0": 3.3e6 + 10 * i, "t1": 3.3e6 + 10 * i + 5}
         for i, (r, p, k) in enumerate([(0, "forward", "K,V"), (1, "forward", "positions"),
                                        (0, "backward", "dK,dV")])], 2),
    "context.merge_figure": lambda m: m.merge_figure(_ch13().merge_demo()),
    "context.exchange_figure": lambda m: m.exchange_figure(
        _ch13().impl_formulas(32, 4, 32), _ch13().impl_formulas(32, 4, 32),
        {"ring": 20.0, "allgather": 12.0, "ulysses": 12.5}, cp=4),
    "context.activation_figure": lambda m: m.activation_figure(
        [{"seq_len": s, "cp": c, "measured": 1000 * s // c, "formula": 1000 * s // c}
         for s in (32, 64) for c in (1, 2)]),
    "context.scale_figure": lambda m: m.scale_figure(_ch13().playbook_scale()),
    "context.ring_work_figure": lambda m: m.ring_work_figure(
        _ring().ring_step_work(16, 2, "plain"), _ring().ring_step_work(16, 2, "zigzag"),
        {s: _ring().step_imbalance(_ring().ring_step_work(16, 2, s))
         for s in ("plain", "zigzag")}),
    "context.overlap_figure": lambda m: m.overlap_figure(
        [{"seq_len": s, "tokens": s // 4, "kv_bytes": 64 * s, "attention_ms": s / 100,
          "transfer_ms": 1.0} for s in (64, 256, 1024)], 256, 4),
})


def _prod_row(name):
    mem = {"params": 4000, "grads": 4000, "optimizer": 8000}
    return {"name": name, "edu3d_losses": [5.5, 5.4], "torch_losses": [5.5, 5.4],
            "edu3d_step_s": 0.01, "torch_step_s": 0.02, "edu3d_mem": mem, "torch_mem": mem,
            "edu3d_wire_bytes": 4000.0, "worst_rel": 1e-7}


_PROD_ACC = {"wrapped": {"model_before": "GPT", "model": "DistributedDataParallel",
             "optimizer_before": "AdamW", "optimizer": "AcceleratedOptimizer",
             "inner_optimizer": "AdamW", "distributed_type": "DistributedType.MULTI_CPU",
             "backend": "gloo", "world_size": 2, "bucket_cap_mb": 25.0},
             "collectives": [{"step": s, "op": "all_reduce", "bucket": 0, "bytes": 4000,
                              "params": 10} for s in (1, 2, 3)]}
_PROD_OFF = {k: {"losses": [1.0], "step_s": 0.01,
                 "mem": {"params": 4, "grads": 4, "optimizer": o},
                 "host_bytes": h, "moved_bytes": mv}
             for k, o, h, mv in (("device", 8, 0, 0), ("offload", 0, 16, 8))}
BUILDERS.update({
    "production.need_figure": lambda m: m.need_figure(),
    "production.comparison_figure": lambda m: m.comparison_figure(
        {"DP": _prod_row("DP"), "ZeRO-3": _prod_row("ZeRO-3")}, highlight="ZeRO-3", psi=1000),
    "production.loss_figure": lambda m: m.loss_figure(_prod_row("DP")),
    "production.accelerate_figure": lambda m: m.accelerate_figure(_PROD_ACC),
    "production.fsdp_figure": lambda m: m.fsdp_figure(1000, 100, highlight="FULL_SHARD"),
    "production.offload_figure": lambda m: m.offload_figure(_PROD_OFF),
})


def tune_report() -> dict:
    """An ``edu3d tune`` report (:mod:`edu3d.bench.autotune`) of 4 candidates, one failed."""
    from edu3d.bench.ranking import grade

    cands = [{"label": label, "predicted_step_s": pred, "predicted_bytes": 7e5 + 1e4 * i,
              "predicted_parts_s": {"compute": pred * 0.9, "dp": pred * 0.1},
              "command": f"edu3d train --dp 2 --zero {i}"} for i, (label, pred) in enumerate(
                  (("dp2 zero1", 1.6e-3), ("dp1 tp2", 1.64e-3), ("dp1 pp2", 1.73e-3),
                   ("dp2 zero3", 1.8e-3)))]
    for c, meas, peak in zip(cands, (0.025, 0.24, 0.026), (6.6e5, 4.2e5, 4.7e5)):
        c["measured"] = {"step_s": meas, "tokens_per_s": 256 / meas, "peak_bytes": peak,
                         "steps_timed": 2, "loss": 5.5}
    cands[3]["error"] = "RankError: rank 1 failed"
    return {"candidates": cands, "skipped": [], "world_size": 2, "device": "cpu",
            **grade(cands, None)}


def _tune_points(metric="step time"):
    from edu3d.course.ch07_memory_tune import points

    return points(tune_report(), metric)


BUILDERS.update({
    "tuning.tune_figure": lambda m: m.tune_figure(_tune_points(), "values", "dp1 tp2"),
})


def _step_memory_doc() -> dict:
    """A recorded step's document (edu3d.train.memory_recorder.document), two ranks."""
    kinds = ("params", "grads", "optimizer", "activations", "comm")
    rows = [("step", "begin", "start", 0), ("F", "begin", "forward", 0),
            ("F", "end", "forward", 3000), ("B", "begin", "backward", 3000),
            ("reduce_scatter", "begin", "backward", 1000), ("B", "end", "reduce", 0),
            ("optimizer", "end", "optimizer", 0)]
    samples = [{"t": 100.0 * i, "lane": "compute", "op": op, "edge": edge, "phase": ph,
                "params": 900, "grads": 500, "optimizer": 900, "activations": act,
                "comm": 300 if op == "reduce_scatter" else 0}
               for i, (op, edge, ph, act) in enumerate(rows)]
    ranks = [{"rank": r, "coord": [0, r, 0], "step": 2, "samples": samples,
              "peak": {"index": 2, "total": 5300, **{k: samples[2][k] for k in kinds},
                       "op": "F", "phase": "forward", "t": 200.0}} for r in range(2)]
    plan = {"per_stage": [{"pp_rank": 0, "total": 5600, **{k: 1000 for k in kinds},
                           "transient": 100}]}
    return {"options": {"dp": 2, "zero": 2, "microbatches": 1, "recompute": "none",
                        "grad_reduce": "per-microbatch"}, "step": 2,
            "planner": {"peak": plan, "rest": plan}, "ranks": ranks,
            "stats": {"total": 5300}}


BUILDERS.update({
    "memory_timeline.step_memory_figure": lambda m: m.step_memory_figure(_step_memory_doc()),
    "memory_timeline.peaks_figure": lambda m: m.peaks_figure(
        [{"label": f"ZeRO-{z}", "measured": 5000 - 500 * z, "planner": 5300 - 500 * z,
          "by_kind": {"params": 900, "grads": 500, "optimizer": 900 - 200 * z,
                      "activations": 2700 - 300 * z, "comm": 0}} for z in range(4)]),
})


def _grad_reduce_rows() -> list[dict]:
    """The planner's rows of chapter 03's sweep, each with a 'measured' value beside it."""
    from edu3d.course import ch03_zero_reduce

    return [{**r, "grads_measured": r["grads"], "wire_measured": r["wire"]}
            for r in ch03_zero_reduce.table()]


BUILDERS.update({
    "grad_reduce.grad_reduce_figure": lambda m: m.grad_reduce_figure(
        _grad_reduce_rows(), (2, "per-microbatch")),
    "packing.batching_figure": lambda m: m.batching_figure(
        {"length": [4, 8, 16, 32], "count": [5, 9, 4, 1], "mean": 10.2},
        [{"mode": mode, "waste": w, "tokens_per_s": t, "tokens_per_s_spread": (t - 50, t + 40)}
         for mode, w, t in (("fixed", 0.0, 900), ("pad", 0.51, 700), ("bucket", 0.12, 850),
                            ("tokens", 0.03, 880), ("pack", 0.18, 870))], 0.58),
})
BUILDERS.update({  # chapter 07's offload curves: a device line per mode, a host line for two
    "offload_curve.offload_figure": lambda m: m.offload_figure(
        {mode: {"x": list(range(5)), "device": [0, d, 2 * d, d, 0], "host": [0, h, 2 * h, h, 0],
                "phase": ["forward"] * 3 + ["backward"] * 2}
         for mode, d, h in (("none", 900, 0), ("offload", 300, 600),
                            ("full recompute", 200, 0), ("full + offload", 100, 100))},
        title="Activations through one step", takeaway="Offloading moves them to the host."),
})


def _fp8_live() -> dict:
    """Chapter 07's FP8 run in the schema of :func:`edu3d.course.ch07_memory_fp8.live`."""
    from edu3d.course import ch07_memory_fp8

    losses = {p: [5.5 - 0.05 * s + e * (s % 3) for s in range(20)]
              for p, e in (("fp32", 0.0), ("bf16", 1e-4), ("fp8", 1e-3))}
    table = {"weights": {"fp32": 786432, "bf16": 393216, "fp8": 196608},
             "whole": {"fp32": 939520, "bf16 gathers": 469760, "fp8": 349696},
             "formula": {"fp32": 939520, "fp8": 349696}}
    return {"losses": losses, "gaps": ch07_memory_fp8.loss_gaps(losses), "table": table,
            "report": ch07_memory_fp8.tensor_report()}


BUILDERS.update({
    "fp8_numbers.scale_error_figure": lambda m: m.scale_error_figure(_fp8_live()["report"]),
    "fp8_numbers.loss_curves_figure": lambda m: m.loss_curves_figure(
        _fp8_live()["losses"], _fp8_live()["gaps"]),
    "fp8_numbers.gather_bytes_figure": lambda m: m.gather_bytes_figure(_fp8_live()["table"]),
})


def figure_functions() -> list[str]:
    names = []
    for info in pkgutil.iter_modules(widgets_pkg.__path__):
        mod = importlib.import_module(f"edu3d.widgets.{info.name}")
        names += [f"{info.name}.{n}" for n, f in inspect.getmembers(mod, inspect.isfunction)
                  if n.endswith("_figure") and f.__module__ == mod.__name__]
    return sorted(names)


def build(key: str):
    module, _ = key.split(".")
    return BUILDERS[key](importlib.import_module(f"edu3d.widgets.{module}"))


# ---- the walk ---------------------------------------------------------------------------------
def test_every_figure_function_is_walked():
    assert figure_functions() == sorted(BUILDERS), (
        "add a builder to BUILDERS for every *_figure function in widgets/")


MEANINGLESS = re.compile(r"^\s*$|^trace \d+$")


@pytest.mark.parametrize("key", sorted(BUILDERS))
def test_every_legend_entry_has_a_meaning(key):
    fig = build(key)
    shown = [t for t in fig.data if style.shows_in_legend(fig, t)]
    for t in shown:
        assert t.name and not MEANINGLESS.match(t.name), f"{key}: unnamed legend entry {t}"
    # a legend that says nothing is hidden: a lone unnamed trace never reads "trace 0"
    for t in fig.data:
        if not t.name:
            assert not style.shows_in_legend(fig, t), f"{key}: unnamed {t.type} in the legend"
    # duplicated entries (one per subplot) are folded into one legend group
    names = [(t.name, t.legendgroup) for t in shown]
    assert len(names) == len(set(names)), f"{key}: repeated legend entries {names}"


@pytest.mark.parametrize("key", sorted(BUILDERS))
def test_every_chart_has_a_title_and_axis_units(key):
    fig = build(key)
    assert fig.layout.title.text, key
    for name in ("xaxis", "yaxis"):
        axis = fig.layout[name]
        title = axis.title.text if axis.title else None
        if title and axis.visible is not False:
            assert "(" in title or title in ("rank", "chunk", "stage", "step",
                                             "configuration", "ZeRO stage", "ranks N",
                                             "element index", "micro-batches m",
                                             "version", "pipeline rank",
                                             "tensor-parallel degree"), f"{key}: {title}"


def test_a_lone_unnamed_trace_shows_no_legend():
    import plotly.graph_objects as go

    fig = style.frame(go.Figure(go.Bar(x=["a", "b"], y=[1, 2])), "t", "k", x="x", y="y (ms)")
    assert fig.layout.showlegend is False and fig.data[0].showlegend is False
    two = go.Figure([go.Bar(x=["a"], y=[1], name="measured"), go.Bar(x=["a"], y=[2])])
    style.frame(two, "t")
    assert [style.shows_in_legend(two, t) for t in two.data] == [True, False]


def test_plural():
    assert style.plural(1, "layer") == "1 layer"
    assert style.plural(3, "layer") == "3 layers"
    assert style.plural(0, "layer") == "0 layers"
    assert style.plural(2, "micro-batch", "micro-batches") == "2 micro-batches"


# ---- colour -----------------------------------------------------------------------------------
def test_send_and_receive_are_told_apart():
    assert style.op_color("send") != style.op_color("recv")
    assert style.op_color("SEND_F") != style.op_color("RECV_F")
    assert style.op_color("SEND_B") != style.op_color("RECV_B")
    # and apart in lightness too (colour-blind and greyscale safe): > 25 % of the range
    def lum(c):
        r, g, b = style.hex_to_rgb(c)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b
    assert abs(lum(style.op_color("send")) - lum(style.op_color("recv"))) > 0.25 * 255
    fig = build("pipeline.pipeline_figure")
    colors = {t.name: t.marker.color for t in fig.data if t.name in ("send", "recv")}
    first = {k: (v[0] if not isinstance(v, str) else v) for k, v in colors.items()}
    assert set(first) == {"send", "recv"} and first["send"] != first["recv"]


PALETTE = {c.upper() for c in (*style.OP_COLORS.values(), *style.GROUP_COLORS,
                               *style.EXTRA_COLORS, style.GREY, style.BLACK, style.SKY)}


def _solid(color) -> list[str]:
    if color is None or isinstance(color, (int, float)):
        return []
    if isinstance(color, str):
        return [color]
    return [c for c in color if isinstance(c, str)]


@pytest.mark.parametrize("key", sorted(BUILDERS))
def test_colours_come_from_the_palette(key):
    """Every solid colour a bar or line uses is a palette colour (or its chunk tint)."""
    tints = {style.tint(c, k, v).upper() for c in PALETTE if c.startswith("#")
             for v in (2, 3, 4) for k in range(v)}
    fig = build(key)
    for t in fig.data:
        used = []
        if t.type in ("bar", "scatter"):
            used += _solid(t.marker.color)
            if t.type == "scatter":
                used += _solid(t.line.color)
        for c in used:
            if c.startswith("rgba(0,0,0,0)"):
                continue  # transparent (the idle hatch)
            assert c.upper() in PALETTE | tints, f"{key}: {t.name} uses {c}"


# ---- the ring replay: picture, label and slider agree ---------------------------------------
def test_ring_replay_opens_on_its_first_frame():
    from edu3d.widgets.collectives import ring_replay_figure

    fig = ring_replay_figure(ring_events(), 4, 16000, case="demo")
    first = fig.frames[0]
    assert fig.data[0].z == first.data[0].z and fig.data[0].text == first.data[0].text
    assert all(c == "1/4" for row in fig.data[0].text for c in row)  # the start: own data only
    slider = fig.layout.sliders[0]
    assert slider.active == 0
    labels = [s.label for s in slider.steps]
    assert labels == ["start", "RS0", "RS1", "RS2", "AG0", "AG1", "AG2"]
    assert [list(s.args[0]) for s in slider.steps] == [[f.name] for f in fig.frames]
    assert fig.layout.title.text == first.layout.title.text
    assert "start" in fig.layout.title.text and "sent 0 B" in fig.layout.title.text
    assert list(fig.layout.annotations) == list(first.layout.annotations) == []


def test_ring_replay_frames_say_what_they_show():
    from edu3d.widgets.collectives import ring_replay_figure

    fig = ring_replay_figure(ring_events(), 4, 16000, case="demo")
    for frame, step in zip(fig.frames[1:], fig.layout.sliders[0].steps[1:]):
        phase = "reduce-scatter" if step.label.startswith("RS") else "all-gather"
        assert f"{phase} step {step.label[2:]}" in frame.layout.title.text
        assert len(frame.layout.annotations) == 4  # one arrow per rank
    last = fig.frames[-1].data[0].text
    assert all(c == "4/4" for row in last for c in row)  # every rank ends with the whole sum
    assert "sent 24,000 B per rank" in fig.frames[-1].layout.title.text  # 2(N-1)/N · S


# ---- timelines start where the shown step starts ---------------------------------------------
def _x_start(fig) -> float:
    return min(min(t.base) for t in fig.data if t.type == "bar" and len(t.base))


@pytest.mark.parametrize("key", ["timeline.timeline_figure", "overlap.overlap_figure"])
def test_timeline_starts_at_the_first_shown_event(key):
    fig = build(key)  # the step sits 3.3 s into the run
    assert _x_start(fig) == 0.0
    end = max(max(b + w for b, w in zip(t.base, t.x)) for t in fig.data if t.type == "bar")
    assert end < 10.0  # ms: the step fills the axis, not a sliver at 3300 ms
    lo, hi = fig.layout.xaxis.range
    assert lo == 0 and end <= hi < 1.1 * end


def test_a_later_step_of_a_run_starts_at_zero_too():
    from edu3d.widgets.timeline import timeline_figure

    evs = [e for e in dp_step_events(t_start=9.9e6) if e["rank"] == 1]
    evs.append({"rank": 0, "lane": "compute", "op": "F", "t0": 10e6, "t1": 10.002e6})
    fig = timeline_figure(evs)
    assert _x_start(fig) == 0.0 and fig.layout.xaxis.range[0] == 0


def test_theory_and_measurement_each_start_at_zero():
    from edu3d.widgets.timeline import timeline_figure

    measured = [{"rank": 0, "lane": "compute", "op": "F", "t0": 5e6, "t1": 5e6 + 1000}]
    theory = [{"rank": 0, "lane": "compute", "op": "F", "t0": 0.0, "t1": 900.0, "sim": True}]
    fig = timeline_figure(measured + theory)
    bases = {t.name: t.base[0] for t in fig.data if t.name in ("F", "F (theory)")}
    assert bases == {"F": 0.0, "F (theory)": 0.0}


def test_pipeline_and_zero_charts_start_at_zero():
    fig = build("pipeline.pipeline_figure")
    assert _x_start(fig) == pytest.approx(0.0, abs=1e-9)
    fig = build("zero.resident_params_figure")
    assert fig.data[0].x[0] == 0.0


# ---- the notebooks cite what a learner can open ---------------------------------------------
def test_notebooks_cite_no_file_the_repository_lacks():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for nb in sorted((root / "notebooks").glob("*.ipynb")) + sorted(
            (root / "exercises").glob("*.ipynb")):
        for name in re.findall(r"\b([A-Z][A-Z_]+\.md)\b", nb.read_text()):
            assert (root / name).exists(), f"{nb.name} cites {name}, which is not in the repository"

