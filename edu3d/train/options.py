"""Every option of ``edu3d train``, and every check made before a single process starts.

After reading this file you should understand:

* what a training run is made of: a model (a preset with overrides), an optimizer and its
  schedule, and a layout ``dp x tp x pp`` with the knobs of each axis;
* which options compose (all the axes do: TP inside PP, ZeRO over either, micro-batches with
  any layout, because a one-stage pipeline *is* gradient accumulation) and the few
  combinations that cannot work, each refused with what would work instead;
* how much memory a rank needs, from the config alone: 16 bytes per parameter for fp32 AdamW
  (4 weights + 4 gradients + 8 optimizer state), divided by ``tp * pp`` and, for what ZeRO
  shards, by ``dp``; plus ``34·s·b·h`` bytes of activations per layer and micro-batch in
  flight (Korthikanti et al. 2022). A run that cannot fit in this machine is refused with
  those numbers instead of allocating until the allocator fails.

This module imports no torch (``edu3d run`` and ``edu3d schedule`` import :func:`positive_int`
from here and must start fast); only the model's config comes from :mod:`edu3d.model.gpt`.
"""

from __future__ import annotations

import argparse
import math
import os

from edu3d.distributed.mesh import Layout, LayoutError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
RECOMPUTE = ("none", "selective", "full")
FAULT_KINDS = ("exit", "kill", "hang")
PRESET_NAMES = ("tiny", "small", "medium", "gpt2-small")  # edu3d.model.gpt.PRESETS; a test checks
MIN_VOCAB = 4  # edu3d.train.data.SUCCESSORS: each token of the synthetic corpus has 4 successors


# ---- argparse types: each says the valid range ---------------------------------------------
def _integer(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: must be {what}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be {what}")
        return value

    parse.__name__ = what
    return parse


def _number(minimum: float, inclusive: bool, example: str):
    bound = f"{'>=' if inclusive else '>'} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(
                f"{text}: must be a finite number {bound} (e.g. {example})")
        return value

    parse.__name__ = f"number {bound}"
    return parse


positive_int = _integer(1, "a positive integer (1, 2, 3 ...)")
positive_int.__doc__ = "argparse type for counts (ranks, steps, micro-batches ...)."
non_negative_int = _integer(0, "an integer >= 0")


def fault_spec(text: str) -> dict:
    """argparse type for ``--inject-fault rank=R,step=S[,kind=exit|kill|hang]``."""
    usage = "rank=R,step=S[,kind=exit|kill|hang] (e.g. rank=1,step=3,kind=kill)"
    spec: dict = {"kind": "exit"}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("rank", "step", "kind"):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {usage}")
        if key == "kind":
            if value not in FAULT_KINDS:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: kind must be one of {', '.join(FAULT_KINDS)}")
            spec["kind"] = value
        else:
            spec[key] = (_integer(1, "a step >= 1") if key == "step" else non_negative_int)(value)
    if "rank" not in spec or "step" not in spec:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {usage}")
    return spec


D = " (default: %(default)s)"  # argparse fills in each option's default in --help


# ---- the options ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every option of ``edu3d train`` to ``parser``; help texts show the defaults."""
    model = parser.add_argument_group("model (a preset; each override replaces one field)")
    model.add_argument("--model", default="tiny", choices=PRESET_NAMES,
                       help="preset" + D)
    model.add_argument("--layers", type=positive_int, help="override the preset's n_layers")
    model.add_argument("--heads", type=positive_int, help="override n_heads")
    model.add_argument("--d-model", type=positive_int, help="override d_model")
    model.add_argument("--seq", type=positive_int, help="override seq_len")
    model.add_argument("--vocab", type=_integer(MIN_VOCAB, f"an integer >= {MIN_VOCAB} (the "
                                                           "corpus gives each token "
                                                           f"{MIN_VOCAB} successors)"),
                       help="override vocab_size (at least 4)")
    model.add_argument("--tie", action="store_true", default=None,
                       help="tie lm_head to the token embedding (default: the preset's choice)")
    opt = parser.add_argument_group("training")
    opt.add_argument("--steps", type=positive_int, default=60, help="training steps" + D)
    opt.add_argument("--seed", type=non_negative_int, default=0,
                     help="seeds the weights and the data" + D)
    opt.add_argument("--lr", type=_number(0, False, "3e-3"), default=3e-3,
                     help="peak learning rate" + D)
    opt.add_argument("--global-batch", type=positive_int, default=8,
                     help="sequences per step, whatever the layout" + D)
    opt.add_argument("--warmup", type=non_negative_int, default=0,
                     help="steps of linear learning-rate warmup" + D)
    opt.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                     help="after warmup: constant, or cosine decay to 10%% of --lr "
                                    "at the last step" + D)
    opt.add_argument("--weight-decay", type=_number(0, True, "0.1"), default=0.1,
                     help="AdamW weight decay on matrices" + D)
    opt.add_argument("--clip", type=_number(0, True, "1.0"), default=1.0,
                     help="max global gradient norm; 0 disables" + D)
    opt.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                     help="sgd is plain SGD, the honest check of gradient scale" + D)
    opt.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                     help="bf16: autocast, fp32 master weights; fp16: plus dynamic "
                                    "loss scaling" + D)
    par = parser.add_argument_group("parallelism (ranks = dp * tp * pp, launched with torchrun)")
    par.add_argument("--dp", type=positive_int, default=1,
                     help="data-parallel degree" + D)
    par.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                     help="ZeRO stage over the data-parallel group" + D)
    par.add_argument("--microbatches", type=positive_int, default=None,
                     help="micro-batches per step, for every layout: without --pp this is "
                          "gradient accumulation (default: 1, or pp with --pp)")
    par.add_argument("--grad-accum", type=positive_int, default=None,
                     help="the same as --microbatches")
    par.add_argument("--dp-impl", choices=("naive", "flat", "overlap", "bucketed"),
                     default="bucketed", help="how gradients are averaged" + D)
    par.add_argument("--bucket-mb", type=_number(0, False, "25"), default=25.0,
                     help="bucket size in MB for --dp-impl bucketed (PyTorch DDP's)" + D)
    par.add_argument("--prefetch", action="store_true", help="ZeRO-3: gather the next layer early")
    par.add_argument("--offload", action="store_true",
                     help="ZeRO: keep the optimizer state (and its update) on the CPU")
    par.add_argument("--compress", choices=("fp16", "bf16", "int8", "topk"), default=None,
                     help="compress data-parallel gradients (lossy: losses drift from serial)")
    par.add_argument("--tp", type=positive_int, default=1,
                     help="tensor-parallel degree" + D)
    par.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp)")
    par.add_argument("--tp-overlap", action="store_true",
                     help="overlap the input-gradient all-reduce with weight gradients")
    par.add_argument("--pp", type=positive_int, default=1, help="pipeline stages" + D)
    par.add_argument("--vpp", type=positive_int, default=1,
                     help="model chunks per pipeline rank (interleaved)" + D)
    par.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                     help="pipeline schedule" + D)
    par.add_argument("--partition", choices=("uniform", "balanced"), default="uniform",
                     help="how layers are cut into pipeline stages" + D)
    par.add_argument("--recompute", choices=RECOMPUTE, default="none",
                     help="activation recomputation: full recomputes each block in backward "
                          "(keeping its input), selective only the attention core" + D)
    par.add_argument("--impl", choices=("edu3d", "torch"), default="edu3d",
                     help="edu3d: edu3d's own mechanics; torch: the same layout on PyTorch's "
                          "own APIs (DDP, ZeroRedundancyOptimizer, FSDP2, DTensor TP, "
                          "torch.distributed.pipelining)" + D)
    par.add_argument("--timeout", type=_number(0, False, "600"), default=600.0,
                     help="seconds before a parallel run is killed" + D)
    ck = parser.add_argument_group("checkpoints and failures")
    ck.add_argument("--ckpt-dir", default=None,
                    help="folder of sharded checkpoints (one sub-folder per saved step)")
    ck.add_argument("--save-every", type=positive_int, default=None,
                    help="save every K steps (default with --ckpt-dir: at the last step only)")
    ck.add_argument("--keep-last", type=positive_int, default=None, metavar="K",
                    help="keep only the newest K complete checkpoints: once a save is "
                         "committed, older step folders are removed (default: keep all)")
    ck.add_argument("--resume", action="store_true",
                    help="continue from the newest complete checkpoint in --ckpt-dir, whatever "
                         "layout wrote it")
    ck.add_argument("--async-save", action="store_true",
                    help="snapshot the state and write it in the background while training "
                         "continues (at most one save in flight)")
    ck.add_argument("--max-restarts", type=non_negative_int, default=0,
                    help="when a rank dies or hangs, restart every rank from the last complete "
                         "checkpoint, up to N times" + D)
    ck.add_argument("--inject-fault", type=fault_spec, default=None,
                    metavar="rank=R,step=S[,kind=exit|kill|hang]",
                    help="make rank R die (exit, kill) or hang at step S, once (for tests and "
                         "the course)")
    ck.add_argument("--heartbeat", type=_number(0, False, "20"), default=None,
                    help="seconds without progress after which a rank counts as hung and is "
                         "handled like a dead one (default: half the collective timeout)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per step and nothing else on stdout")
    return parser


def defaults(**overrides) -> argparse.Namespace:
    """``edu3d train``'s options at their defaults (tiny model), with ``overrides`` applied:
    what a benchmark, a chapter or a test hands to :class:`~edu3d.train.trainer.Trainer`."""
    args = add_arguments(argparse.ArgumentParser()).parse_args([])
    args.__dict__.update(overrides)
    return args


def config_from_args(args: argparse.Namespace):
    """The model's :class:`~edu3d.model.gpt.GPTConfig`: the preset with the overrides."""
    from edu3d.model.gpt import config_from

    return config_from(args.model, layers=args.layers, heads=args.heads, d_model=args.d_model,
                       seq=args.seq, vocab=args.vocab, tie=args.tie)


def _microbatches(args: argparse.Namespace) -> int:
    """``--microbatches`` (or its alias ``--grad-accum``); default 1, or pp for a pipeline."""
    m, accum = args.microbatches, getattr(args, "grad_accum", None)
    if m is not None and accum is not None and m != accum:
        raise LayoutError(f"--grad-accum {accum} and --microbatches {m} are the same option; "
                          "give one of them")
    return m or accum or args.pp


# ---- the composition rules -----------------------------------------------------------------
def check_args(args: argparse.Namespace):
    """Every rule a combination of options must follow; returns ``(config, layout)``.

    Resolves ``args.microbatches`` (and its alias ``args.grad_accum``) to the number of
    micro-batches per step. Raises :class:`~edu3d.distributed.mesh.LayoutError` saying what would work.
    """
    config = config_from_args(args)
    layout = Layout(dp=args.dp, tp=args.tp, pp=args.pp, vpp=args.vpp)
    m = _microbatches(args)
    args.microbatches = args.grad_accum = m
    layout.validate(config=config, global_batch=args.global_batch, microbatches=m)
    if args.sp and args.tp == 1:
        raise LayoutError("--sp splits the sequence across the tensor-parallel group; "
                          "add --tp 2 (or more)")
    if args.sp and config.seq_len % args.tp:
        ok = ", ".join(str(t) for t in range(1, config.n_heads + 1)
                       if config.n_heads % t == 0 and config.seq_len % t == 0)
        raise LayoutError(f"sequence parallelism splits seq_len={config.seq_len} over tp="
                          f"{args.tp} ranks, which does not divide it; choose tp in {ok}")
    if args.tp_overlap and args.tp == 1:
        raise LayoutError("--tp-overlap overlaps tensor-parallel communication; add --tp 2 "
                          "(or more)")
    if args.vpp > 1 and args.schedule != "interleaved":
        raise LayoutError(f"--vpp {args.vpp} needs --schedule interleaved")
    if args.schedule == "interleaved" and args.pp > 1 and m % args.pp:
        raise LayoutError(f"interleaved 1F1B groups micro-batches by pp: --microbatches {m} "
                          f"must be a multiple of --pp {args.pp}")
    if args.zero and args.dp == 1:
        raise LayoutError(f"--zero {args.zero} shards over the data-parallel group; "
                          "add --dp 2 (or more)")
    if args.offload and not args.zero:
        raise LayoutError("--offload moves ZeRO's sharded optimizer state; add --zero 1 "
                          "(or 2, 3)")
    if args.prefetch and args.zero != 3:
        raise LayoutError("--prefetch gathers ZeRO-3's parameters early; add --zero 3")
    opt = lambda name: getattr(args, name, None)  # noqa: E731 (older Namespaces lack them)
    needs_dir = [f for f in ("--resume", "--save-every", "--keep-last", "--async-save",
                          "--max-restarts")
                 if opt(f[2:].replace("-", "_"))]
    if needs_dir and not opt("ckpt_dir"):
        raise LayoutError(f"{needs_dir[0]} works on checkpoints; add --ckpt-dir DIR")
    fault = opt("inject_fault")
    if fault is not None:
        if fault["rank"] >= layout.world_size:
            raise LayoutError(f"--inject-fault rank={fault['rank']}: this layout has ranks "
                              f"0..{layout.world_size - 1}")
        if fault["step"] > args.steps:
            raise LayoutError(f"--inject-fault step={fault['step']}: the run has only "
                              f"{args.steps} steps")
    if opt("impl") == "torch":  # flags PyTorch's own APIs have no counterpart for
        from edu3d.production.torch_check import unsupported

        problem = unsupported(args)
        if problem:
            raise LayoutError(problem)
    if args.compress and (args.zero or args.dp == 1):
        raise LayoutError("--compress hooks plain data parallelism's gradient buckets: use it "
                          "with --dp 2 (or more) and without --zero")
    return config, layout


# ---- will it fit? ---------------------------------------------------------------------------
RUNTIME_BYTES = 200 * 2**20  # what torch and gloo cost one rank before any tensor (measured)


def num_params_from_config(config) -> int:
    """The parameter count of :class:`~edu3d.model.gpt.GPT` from its config, no model built."""
    d, L, V = config.d_model, config.n_layers, config.vocab_size
    per_layer = 12 * d * d + 13 * d  # qkv 3d^2+3d, proj d^2+d, fc 4d^2+4d, proj 4d^2+d, 2 LNs 4d
    embeddings = V * d + config.seq_len * d
    head = 0 if config.tie_weights else V * d
    return L * per_layer + 2 * d + embeddings + head


def memory_per_rank(config, layout: Layout, args: argparse.Namespace) -> dict:
    """Bytes the fullest rank needs (a lower bound): fp32 weights, gradients and AdamW's two
    moments, sharded by TP and PP and, as far as ZeRO goes, by DP; activations of the
    micro-batches in flight; the runtime itself."""
    model_shards = layout.tp * layout.pp
    n = num_params_from_config(config) / model_shards
    dp, zero = layout.dp, args.zero
    moments = 0 if args.optimizer == "sgd" else 8
    m = args.microbatches or 1
    b = args.global_batch // (dp * m)  # sequences per micro-batch
    s, h = config.seq_len, config.d_model
    per_layer = 34 * s * b * h  # Korthikanti: sbh(10 + 24/t) under TP, sbh*34/t with SP
    if layout.tp > 1:
        per_layer = s * b * h * (34 / layout.tp if args.sp else 10 + 24 / layout.tp)
    # accumulation frees each micro-batch's activations; GPipe holds all m, 1F1B at most pp
    in_flight = 1 if layout.pp == 1 else m if args.schedule == "gpipe" else min(m, layout.pp)
    layers = math.ceil(config.n_layers / layout.pp)
    logits = 2 * 4 * s * b * config.vocab_size / layout.tp  # fp32 logits and their gradient
    return {"params": int(4 * n / (dp if zero >= 3 else 1)),
            "grads": int(4 * n / (dp if zero >= 2 else 1)),
            "optimizer": int(moments * n / (dp if zero >= 1 else 1)),
            "activations": int(per_layer * layers * in_flight + logits),
            "runtime": RUNTIME_BYTES}


def available_memory() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes; None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _on_gpus(layout: Layout) -> bool:
    """Ranks run on GPUs (one each) when enough are visible; this check is for host memory."""
    if os.environ.get("EDU3D_BACKEND", "").lower() == "gloo":
        return False
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus")) >= layout.world_size
    except OSError:
        return False


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_fit(config, layout: Layout, args: argparse.Namespace,
              available: int | None = None) -> dict:
    """Refuse (:class:`~edu3d.distributed.mesh.LayoutError`) a run whose ranks need more memory than
    this machine has available; returns the estimate per rank. Skipped where the available
    memory is unknown (not Linux) or the ranks run on GPUs."""
    need = memory_per_rank(config, layout, args)
    available = available_memory() if available is None else available
    if available is None or _on_gpus(layout):
        return need
    ranks, per_rank = layout.world_size, sum(need.values())
    if ranks * per_rank > available:
        parts = ", ".join(f"{k} {_gb(v)}" for k, v in need.items())
        fix = "a smaller model (--layers, --d-model, --vocab) or a smaller --global-batch"
        if layout.dp > 1 and args.zero < 3:
            fix += ", or --zero 3 to shard the model's state over the dp replicas"
        raise LayoutError(
            f"this run cannot fit: {num_params_from_config(config) / 1e9:.2f} B parameters "
            f"need about {_gb(per_rank)} per rank ({parts}) x {ranks} rank(s) = "
            f"{_gb(ranks * per_rank)}, but this machine has {_gb(available)} available; "
            f"choose {fix}")
    return need


def oversubscribed(layout: Layout, cores: int | None = None) -> str | None:
    """A one-line warning when ranks outnumber CPU cores more than 4 to 1, else None."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks = layout.world_size
    if cores and ranks > 4 * cores and not _on_gpus(layout):
        return (f"warning: {ranks} ranks on {cores} CPU core(s): every rank waits for a turn "
                f"on a core, so steps will be very slow; use at most {4 * cores} ranks here")
    return None
