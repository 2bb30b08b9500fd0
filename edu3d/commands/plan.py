"""``edu3d plan``: will it fit, and which layout?

After reading this file you should know what the command answers and where each answer
comes from:

* ``edu3d plan --model llama2-7b --tp 2 --pp 2 --dp 2 --zero 1`` prints the bytes of every
  pipeline rank by category (weights, gradients, optimizer state, activations,
  communication buffers) and the fullest rank, from :mod:`edu3d.plan.estimate` (model shapes
  from :mod:`edu3d.model.shapes`); ``--gpu-mem 80`` adds a verdict, fits or does not fit;
* ``edu3d plan --model llama2-70b --gpus 64 --gpu-mem 80`` ranks every layout of 64 GPUs by
  an estimated step time (:mod:`edu3d.plan.search`, whose docstring states the cost model)
  and explains the fastest one that fits;
* ``--json`` prints one object: ``params_bytes`` ... ``total_bytes``, ``per_stage``,
  ``traffic_bytes`` (what a rank sends per step, by axis), and with ``--gpus`` a
  ``recommended`` layout with its ``reasons``;
* mixtures of experts and long sequences: ``--experts --topk --moe-every --shared-experts
  --expert-ffn`` make any model a MoE (or start from ``--model mixtral-8x7b`` /
  ``deepseek-v3``, :data:`edu3d.plan.moe_presets.MOE_PRESETS`), ``--ep`` cuts its experts, ``--cp`` (``--cp-impl``)
  its sequences: ``world = dp·cp·tp·pp``, EP inside the ``dp·cp`` ranks;
* ``--freeze 'tok_emb.*,blocks.0.*'`` (``edu3d train``'s globs over the serial names):
  those parameters keep their weights, whole on every rank, and lose their gradients and
  optimizer state (:mod:`edu3d.plan.inventory`); a glob that matches nothing is refused;
* ``--grad-reduce per-microbatch|per-step``: how ZeRO-2/3 reduce over micro-batches
  (:mod:`edu3d.plan.zero_modes`); the line under the table prints the weights, gradients
  and optimizer state alone, the ZeRO paper's count (``--params 7.5e9 --dp 64 --zero 2``:
  16.6 GB per-microbatch at any ``--microbatches``).

Exit codes: 0, 1 when the layout (or every layout) does not fit, 2 for options that cannot
work together. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from edu3d.commands.argtypes import between, number
from edu3d.commands.plan_validation import (MFU_IS_PREDICTED, prediction_json, prediction_lines,
                                            recipe_names, validation_main)
from edu3d.commands.train import globs
from edu3d.plan import search as plan_search
from edu3d.plan import zero_modes
from edu3d.plan.fit import size_text
from edu3d.config.sections import Run
from edu3d.plan.estimate import (CATEGORIES, CP_IMPLS, MAX_EXPERTS, MAX_GPUS, MAX_LAYERS,
                                 PRECISIONS, RECOMPUTE, check_ep, estimate, setup, setup_dict,
                                 state_bytes, validate)
from edu3d.plan.formulas import as_moe
from edu3d.plan.hardware import ProfileError
from edu3d.plan.step import predict
from edu3d.plan.inventory import frozen_params
from edu3d.plan.moe_presets import MOE_PRESETS
from edu3d.model.shapes import PRESETS, ModelSpec, spec_for_params, spec_from

MOE_FLAGS = ("experts", "topk", "moe_every", "shared_experts", "expert_ff", "capacity_factor")
MAX_PARAMS = 1e13  # ten trillion: beyond any published model (the search answers in seconds)
WIDE = 2**20  # the most of any width, sequence length, vocabulary or batch the planner takes
SHAPE = {"n_layers": between(1, MAX_LAYERS), "n_heads": between(1, 2**14),
         "d_model": between(1, WIDE), "seq_len": between(1, WIDE),
         "vocab_size": between(1, WIDE * 16), "n_kv_heads": between(1, 2**14),
         "d_ff": between(1, WIDE)}


# ---- edu3d plan ----------------------------------------------------------------------------------
def add_arguments(parser):
    """``edu3d plan``'s options."""
    what = parser.add_mutually_exclusive_group()  # one of them, unless --validate
    what.add_argument("--model", choices=(*PRESETS, *MOE_PRESETS),
                      help="a preset: the course's or a real model")
    what.add_argument("--params", type=number(1e8, True, "7e9", MAX_PARAMS),
                      help="a GPT-3-shaped model of about this many parameters")
    m = parser.add_argument_group("model overrides")
    for flag, kw in (("--layers", "n_layers"), ("--heads", "n_heads"), ("--d-model", "d_model"),
                     ("--seq", "seq_len"), ("--vocab", "vocab_size"),
                     ("--kv-heads", "n_kv_heads"), ("--ffn", "d_ff")):
        m.add_argument(flag, dest=kw, type=SHAPE[kw], help=f"override {kw}")
    m.add_argument("--tie", action="store_true", default=None, help="tie the head to the embedding")
    moe = parser.add_argument_group("mixture of experts (any model; a MoE preset's by default)")
    moe.add_argument("--experts", type=between(1, MAX_EXPERTS),
                     help="routed experts per MoE block")
    moe.add_argument("--topk", type=between(1, MAX_EXPERTS), help="experts per token (default 2)")
    moe.add_argument("--moe-every", type=between(1, MAX_LAYERS),
                     help="block i is MoE iff i %% this == 0")
    moe.add_argument("--shared-experts", type=between(0, MAX_EXPERTS),
                     help="always-on experts per MoE block")
    moe.add_argument("--expert-ffn", dest="expert_ff", type=between(1, WIDE),
                     help="an expert's MLP width (default: the dense MLP's)")
    moe.add_argument("--capacity-factor", type=number(0, True, "1.25", 1024),
                     help="pad or drop to ceil(T·k/E·C) tokens per expert (default: none)")
    lay = parser.add_argument_group("layout (without --gpus, or to check one layout on them)")
    for flag in ("--dp", "--tp", "--pp", "--vpp", "--ep", "--cp"):
        lay.add_argument(flag, type=between(1, MAX_GPUS), default=None,
                         help=f"{flag[2:]} degree")
    lay.add_argument("--cp-impl", choices=CP_IMPLS, default="ring",
                     help="context parallelism: ring attention, all-gathered K/V, or Ulysses")
    lay.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage")
    lay.add_argument("--hsdp", type=between(1, MAX_GPUS), default=1,
                     help="HSDP replica groups: ZeRO shards within dp*cp/HSDP ranks")
    lay.add_argument("--grad-reduce", choices=zero_modes.GRAD_REDUCE,
                     default=zero_modes.DEFAULT,
                     help="ZeRO-2/3 over micro-batches: reduce-scatter every micro-batch and "
                          "keep 1/N of the gradients (DeepSpeed, FSDP2; default), or once per "
                          "step, holding full gradients (Megatron; ZeRO-1's memory, 1/m of "
                          "the reduce-scatters)")
    lay.add_argument("--microbatches", type=between(1, WIDE), help="micro-batches per step")
    lay.add_argument("--micro-batch-size", type=between(1, WIDE),
                     help="sequences per micro-batch")
    lay.add_argument("--global-batch", type=between(1, WIDE * 16),
                     help="sequences per step (default: the preset's published batch; 8 for "
                          "the course's models, as edu3d train)")
    lay.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "zb-h1", "zbv",
                                            "dualpipev"),
                     default="1f1b")
    lay.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    lay.add_argument("--recompute", choices=RECOMPUTE, default="none")
    lay.add_argument("--precision", choices=PRECISIONS, default=None,
                     help="fp32 (4+4+8 bytes/param) or mixed bf16/fp16 (2+2+12); default fp32 "
                          "for the course's models, bf16 otherwise")
    lay.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    lay.add_argument("--freeze", type=globs, default=None, metavar="GLOB[,GLOB...]",
                     help="parameters not trained (globs over the serial names, as edu3d "
                          "train's): their weights stay, whole on every rank; no gradients, "
                          "no optimizer state")
    cl = parser.add_argument_group("cluster and cost model (with --gpus, the layout search)")
    cl.add_argument("--gpus", type=between(1, MAX_GPUS),
                    help="GPUs to plan for: search every layout")
    cl.add_argument("--gpu-mem", type=number(0, False, "80", 1e6), default=None,
                    help="GB per GPU (default with --gpus: 80)")
    cl.add_argument("--gpus-per-node", type=between(1, MAX_GPUS), default=8)
    cl.add_argument("--hardware", default=None, metavar="NAME|FILE.json",
                    help="hardware profile (edu3d/plan/data/hardware: h100-sxm, h100-sxm-hf, "
                         "h100-hbm2e-96gb, h200, a100-80gb, a100-40gb; or a profile file, e.g. "
                         "one edu3d calibrate wrote); default h100-sxm")
    cl.add_argument("--recipe", choices=recipe_names(), default="edu3d",
                    help="memory and kernel recipe: edu3d's own (exact for its runs) or a "
                         "framework's")
    cl.add_argument("--peak-tflops", type=number(0, False, "989", 1e9), default=None,
                    help="override the profile's bf16 peak")
    cl.add_argument("--mfu", type=number(0, False, "0.45", 1), default=None,
                    help="refused: MFU is predicted now (kept so old commands say why)")
    cl.add_argument("--intra-gbps", type=number(0, False, "300", 1e9), default=None,
                    help="override the profile's NVLink bus bandwidth, GB/s")
    cl.add_argument("--inter-gbps", type=number(0, False, "25", 1e9), default=None,
                    help="override the profile's inter-node bus bandwidth, GB/s")
    cl.add_argument("--validate", action="store_true",
                    help="predict every published run beside its measurement (with --hardware: "
                         "the runs of that hardware) and print the errors")
    cl.add_argument("--top", type=between(1, 10**6), default=8, help="layouts listed")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return parser


def add_subcommand(sub):
    """Register ``plan`` on ``edu3d``'s subcommands."""
    p = sub.add_parser("plan", help="will it fit? per-rank memory of a layout, and the best "
                                    "layout for a cluster",
                       description="Per-rank memory by category and pipeline stage for a "
                                   "layout; with --gpus, every layout ranked by an estimated "
                                   "step time, and the recommended one with its reasons.")
    add_arguments(p)
    p.set_defaults(func=main_from_args)
    return p


def setup_from_args(args) -> tuple[ModelSpec, Run]:
    """The model and the layout ``edu3d plan``'s options describe (``ValueError`` if they
    cannot work together)."""
    over = {k: getattr(args, k) for k in ("n_layers", "n_heads", "d_model", "seq_len",
                                          "vocab_size", "n_kv_heads", "d_ff")}
    if args.params is not None:
        spec = dataclasses.replace(spec_for_params(args.params),
                                   **{k: v for k, v in over.items() if v is not None})
    elif args.model in MOE_PRESETS:
        spec = dataclasses.replace(MOE_PRESETS[args.model], **{
            k: v for k, v in {**over, "tied": args.tie}.items() if v is not None})
    else:
        spec = spec_from(args.model, tied=args.tie, **over)
    spec = moe_from_args(spec, args)
    dp, tp, pp = (getattr(args, k) or 1 for k in ("dp", "tp", "pp"))
    gb, m, b = args.global_batch, args.microbatches, args.micro_batch_size
    if m and b:
        gb = dp * m * b
    gb = gb or spec.global_batch
    if not m:
        m = gb // (dp * b) if b else (pp if spec.course else max(1, gb // dp))
    b = b or gb // (dp * m)
    if gb != dp * m * b or b < 1:
        raise ValueError(f"global batch {gb} does not split into dp={dp} x {m} micro-batches "
                         "of whole sequences; change --global-batch, --microbatches or "
                         "--micro-batch-size")
    precision = args.precision or ("fp32" if spec.course else "bf16")
    check_ep(spec, dp * (args.cp or 1), args.ep or 1)
    st = setup(dp=dp, tp=tp, pp=pp, vpp=args.vpp or 1, zero=args.zero, microbatches=m,
               micro_batch=b, schedule=args.schedule, sp=args.sp, recompute=args.recompute,
               precision=precision, optimizer=args.optimizer, ep=args.ep or 1,
               cp=args.cp or 1, cp_impl=args.cp_impl, grad_reduce=args.grad_reduce,
               freeze=args.freeze or (), hsdp=args.hsdp)
    validate(spec, st)
    return spec, st


def moe_from_args(spec: ModelSpec, args) -> ModelSpec:
    """``spec`` with the mixture-of-experts options applied (``ValueError`` if they cannot
    work: ``--topk`` above ``--experts``, experts options on a dense model)."""
    given = {k: getattr(args, k) for k in MOE_FLAGS if getattr(args, k) is not None}
    moe = dataclasses.replace(as_moe(spec), **given)
    if not moe.experts and (given or (args.ep or 1) > 1):
        raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in given) or '--ep'} "
                         f"need(s) a mixture of experts: add --experts E (e.g. --experts 8), "
                         "or choose --model mixtral-8x7b or deepseek-v3")
    if moe.experts and moe.topk > moe.experts:
        raise ValueError(f"--topk {moe.topk} is more than the {moe.experts} experts; choose "
                         f"--topk between 1 and {moe.experts}")
    if moe.shared_experts < 0:
        raise ValueError("--shared-experts must be 0 or more")
    return moe if moe.experts else spec


def describe(spec: ModelSpec, st: Run) -> str:
    pb, gb, ob = state_bytes(st.precision.dtype, st.training.optimizer, spec.course)
    return (f"dp={st.layout.dp}" + (f" cp={st.layout.cp} ({st.parallel.cp_impl})" if st.layout.cp > 1 else "")
            + f" tp={st.layout.tp} pp={st.layout.pp}" + (f" vpp={st.layout.vpp}" if st.layout.vpp > 1 else "")
            + (f" ep={st.layout.ep}" if st.layout.ep > 1 else "")
            + f" ZeRO-{st.parallel.zero}" + (f" {st.parallel.grad_reduce}" if st.parallel.zero >= 2 else "")
            + (f" HSDP x{st.parallel.hsdp}" if st.parallel.hsdp > 1 else "")
            + f", {st.microbatches} micro-batch(es) of {st.micro_batch} x "
            f"{spec.seq_len} tokens, {st.parallel.schedule}, recompute {st.memory.recompute}, {st.precision.dtype} "
            f"({pb}+{gb}+{ob} bytes/param)" + (", SP" if st.parallel.sp else ""))


def table(est: dict) -> str:
    """Per-stage bytes as a text table (GB when large, MB otherwise)."""
    big = est["total_bytes"] > 1e9
    unit, div = ("GB", 1e9) if big else ("MB", 1e6)
    cols = CATEGORIES + ("total",)
    lines = [f"{'per rank (' + unit + ')':<18}" + "".join(f"{c:>13}" for c in cols)]
    n = len(est["per_stage"])
    for row in est["per_stage"]:
        r = row["pp_rank"]
        name = f"pp rank {r}" + (" first" if r == 0 and n > 1 else "") + (
            " last" if r == n - 1 and n > 1 else "")
        lines.append(f"{name:<18}" + "".join(f"{row[c] / div:>13.3f}" for c in cols))
    return "\n".join(lines)


def _json_setup(st: Run) -> dict:
    return setup_dict(st)


def main_from_args(args) -> int:
    """``edu3d plan``: 0 when it fits (or nothing was asked to fit), 1 when it does not,
    2 for options that cannot work together."""
    args.hardware_given = args.hardware is not None
    args.hardware = args.hardware or "h100-sxm"
    if args.mfu is not None:
        print(f"edu3d plan: {MFU_IS_PREDICTED}", file=sys.stderr)
        return 2
    if args.validate:
        return validation_main(args)
    if args.model is None and args.params is None:
        print("edu3d plan: give --model NAME or --params N (or --validate)", file=sys.stderr)
        return 2

    if args.gpus is not None and not any((args.dp, args.tp, args.pp)) and (args.ep or args.cp):
        print("edu3d plan: --ep and --cp belong to a layout (with --dp/--tp/--pp); with --gpus "
              "alone the search tries every ep and cp itself", file=sys.stderr)
        return 2
    try:
        spec, st = setup_from_args(args)
    except ValueError as err:
        print(f"edu3d plan: {err}", file=sys.stderr)
        return 2
    searching = args.gpus is not None and not any((args.dp, args.tp, args.pp))
    mem_gb = args.gpu_mem or (80.0 if args.gpus else None)
    if args.gpus is not None and not searching and st.world_size != args.gpus:
        print(f"edu3d plan: dp*cp*tp*pp = {st.world_size} but --gpus {args.gpus}; give a layout whose "
              "product is the GPU count, or leave --dp/--tp/--pp out to search",
              file=sys.stderr)
        return 2
    try:
        cluster = plan_search.Cluster(args.gpus or st.world_size, mem_gb or 80.0,
                                      args.gpus_per_node, args.peak_tflops, None,
                                      args.intra_gbps, args.inter_gbps, hardware=args.hardware,
                                      recipe=args.recipe)
    except ProfileError as err:
        print(f"edu3d plan: {err}", file=sys.stderr)
        return 2
    out = {"model": dataclasses.asdict(spec), "num_params": spec.num_params()}
    moe = as_moe(spec)
    if searching:
        try:
            rows = plan_search.search(spec, cluster, st.batch.global_batch, st.precision.dtype,
                                      st.parallel.schedule, st.parallel.cp_impl, st.memory.freeze)
        except ValueError as err:
            print(f"edu3d plan: {err}", file=sys.stderr)
            return 2
        if not rows or not rows[0]["fits"]:
            print(f"edu3d plan: no layout of {spec.name} fits {args.gpus} GPUs of {mem_gb:g} GB"
                  + (f" (the best needs {rows[0]['memory']['total_bytes'] / 1e9:.1f} GB)"
                     if rows else ""), file=sys.stderr)
            return 1
        best = rows[0]
        why = plan_search.reasons(spec, cluster, rows)
        st = best["setup"]
        out["recommended"] = {**_json_setup(st), "reasons": why,
                              "step_time_s": best["time"]}
        out["candidates"] = [{**_json_setup(r["setup"]), "total_bytes": r["memory"]["total_bytes"],
                              "step_time_s": r["time"]["total"] if r["prediction"] else None,
                              "fits": r["fits"], "predicted": r["prediction"] is not None}
                             for r in rows[:args.top]]
        out["cost_model"] = plan_search.__doc__.split("The cost model")[1].strip()
        out["cluster"] = dataclasses.asdict(cluster)
    est = estimate(spec, st)
    out.update(est)
    out["setup"] = _json_setup(st)
    out["traffic_bytes"] = plan_search.traffic(spec, st)
    try:
        pred = predict(spec, st, plan_search.profile_of(cluster), cluster.recipe)
    except ValueError as err:
        print(f"edu3d plan: {err}", file=sys.stderr)
        return 2
    out["prediction"] = prediction_json(pred)
    need = est["total_bytes"] if args.recipe == "edu3d" else pred.memory["device"] / cluster.usable
    fits = None if mem_gb is None else need <= cluster.usable * mem_gb * 1e9
    out["fits"] = fits
    if args.json:
        print(json.dumps(out))
        return 0 if fits is not False else 1
    print(f"{spec.name}: {count_text(spec.num_params())} parameters" + (
        f" ({count_text(moe.active_params())} active: {moe.experts} experts, top-{moe.topk}, "
        f"{moe.moe_layers} MoE blocks)" if moe.experts else "")
        + f"; activations: {est['activation_model']}")
    if searching:
        print(f"cluster: {cluster.describe()}")
        print(f"{len(rows)} layouts, {sum(r['fits'] for r in rows)} fit; fastest first:")
        for r in rows[:args.top]:
            took = f"{r['time']['total']:9.2f}" if r["prediction"] else f">={r['time']['floor']:7.2f}"
            print(f"  {took} s/step  {r['memory']['total_bytes'] / 1e9:6.1f} GB"
                  f"  {'fits' if r['fits'] else 'too big'}  {describe(spec, r['setup'])}")
        print("recommended: " + describe(spec, st))
        for line in why:
            print(f"  - {line}")
    else:
        print("layout: " + describe(spec, st))
    print(table(est))
    verdict = "" if fits is None else (
        f"  {'FITS' if fits else 'DOES NOT FIT'} in {cluster.usable * mem_gb:.1f} GB usable of "
        f"{mem_gb:g} GB")
    print(f"fullest: pp rank {est['fullest_pp_rank']}, "
          f"{size_text(est['total_bytes'], '.3f')}" + verdict)
    print(f"  of which weights, gradients and optimizer state (the ZeRO paper's count): "
          f"{size_text(est['state_bytes'], '.3f')}" + (
              "; the full gradients are held for the step (--grad-reduce per-step)"
              if zero_modes.holds_step(st.parallel.zero, st.parallel.grad_reduce, st.microbatches) else ""))
    if st.memory.freeze:
        print(f"frozen (--freeze {','.join(st.memory.freeze)}): {frozen_params(spec, st.memory.freeze):,} of "
              f"{spec.num_params():,} parameters: their weights only, whole on every rank; "
              "no gradients, no optimizer state")
    sent = [f"{axis} {size_text(v, '.3f')}" for axis, v in out["traffic_bytes"].items() if v]
    print("sent per rank and step: " + (", ".join(sent) or "nothing (one rank)"))
    for line in prediction_lines(spec, st, pred):
        print(line)
    return 0 if fits is not False else 1


def count_text(n: float) -> str:
    """A parameter count as it is said: ``7.500 B``, ``124.4 M``, ``234,880``."""
    if n >= 1e9:
        return f"{n / 1e9:.3f} B"
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,.0f}"


def plan_main(argv: list[str] | None = None) -> int:
    """``edu3d plan ...`` as a function (returns the exit code)."""
    return main_from_args(add_arguments(argparse.ArgumentParser(prog="edu3d plan")).parse_args(argv))
