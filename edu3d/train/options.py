"""Every option of ``edu3d train``, as one typed :class:`TrainOptions`, and every check made
before a single process starts.

After reading this file you should understand:

* what a training run is made of: a model (a preset with overrides), an optimizer and its
  schedule, and a layout ``dp x tp x pp`` with the knobs of each axis: one field of
  :class:`TrainOptions` per ``edu3d train`` flag, with the flag's default. The command line
  is parsed in :mod:`edu3d.commands.train` and converted once; a chapter, a benchmark or a
  test builds the same object with :func:`defaults` (or, from a command line written as
  data, :func:`from_flags`);
* which options compose (all the axes do: TP inside PP, ZeRO over either, micro-batches with
  any layout, because a one-stage pipeline *is* gradient accumulation) and the few
  combinations that cannot work, each refused with what would work instead
  (:func:`check_args`);
* whether the run fits in this machine: the planner's own estimate
  (:mod:`edu3d.plan.fit`), so ``edu3d plan`` and the refusal print the same numbers.

This module imports no torch (``edu3d train --help`` must start fast), which is why the
model's config comes from :mod:`edu3d.model.gpt` through imports inside functions.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import typing
from dataclasses import dataclass

from edu3d.distributed.mesh import Layout, LayoutError
from edu3d.launch import cores as launch_cores
from edu3d.launch.api import NODE_OPTIONS, node_args
from edu3d.plan import fit
from edu3d.plan.estimate import from_train_args
from edu3d.train.axis_rules import BALANCE, CP_IMPLS, CP_SPLITS, check_cp, check_moe

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
RECOMPUTE = ("none", "selective", "full")
BATCHING = ("fixed", "pad", "bucket", "tokens", "pack")  # edu3d.train.batching.MODES; a test checks
GRAD_REDUCE = ("per-microbatch", "per-step")  # edu3d.parallel.zero.sharding.GRAD_REDUCE
ATTENTION = ("sdpa", "explicit")  # edu3d.model.gpt.ATTENTION; a test checks
FAULT_KINDS = ("exit", "kill", "hang", "slow")
PRESET_NAMES = ("tiny", "small", "medium", "gpt2-small")  # edu3d.model.gpt.PRESETS; a test checks
MIN_VOCAB = 4  # edu3d.train.data.SUCCESSORS: each token of the synthetic corpus has 4 successors


@dataclass
class TrainOptions:
    """``edu3d train``'s options: field ``x_y`` is flag ``--x-y``, with its default."""

    # ---- model: a preset; each override (None: the preset's) replaces one field ----
    model: str = "tiny"
    layers: int | None = None
    heads: int | None = None
    d_model: int | None = None
    seq: int | None = None
    vocab: int | None = None
    tie: bool | None = None
    vocab_pad: int = 1  # the vocabulary's tables padded to a multiple of this (64 on a GPU)
    # ---- mixture of experts (0 experts: every block keeps its dense MLP) ----
    experts: int = 0
    topk: int = 2
    moe_every: int = 1  # block i is a mixture of experts when i % moe_every == 0
    shared_experts: int = 0  # always-on experts beside the routed ones (DeepSeek)
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss_coef: float = 1e-2  # Switch/GShard load-balancing loss
    z_loss_coef: float = 0.0  # router z-loss
    balance: str = "aux"  # or "bias": DeepSeek-V3's aux-loss-free per-expert bias
    # ---- training ----
    steps: int = 60
    seed: int = 0  # seeds the weights and the data
    lr: float = 3e-3  # the peak learning rate
    global_batch: int = 8  # sequences per step, whatever the layout
    warmup: int = 0
    lr_schedule: str = "constant"  # or "cosine" (down to lr/10 at the last step)
    weight_decay: float = 0.1
    clip: float = 1.0  # max global gradient norm; 0 disables
    optimizer: str = "adamw"  # or "sgd"
    precision: str = "fp32"  # or "bf16", "fp16"
    # ---- parallelism: ranks = dp * tp * pp ----
    dp: int = 1
    zero: int = 0
    microbatches: int | None = None  # None: 1, or pp for a pipeline (check_args resolves it)
    grad_accum: int | None = None  # the same as microbatches
    dp_impl: str = "bucketed"  # or "naive", "flat", "overlap"
    bucket_mb: float = 25.0
    prefetch: bool = False
    offload: bool = False
    grad_reduce: str = "per-microbatch"  # or "per-step": ZeRO-2/3 only (ZeRO-1, DDP: per step)
    compress: str | None = None
    ep: int = 1  # experts shared out over groups of ep of the dp x cp ranks
    cp: int = 1  # each sequence split over cp ranks (context parallelism)
    cp_impl: str = "ring"  # or "allgather", "ulysses"
    cp_split: str = "zigzag"  # or "plain" (shows causal attention's imbalance)
    tp: int = 1
    sp: bool = False
    tp_overlap: bool = False
    pp: int = 1
    vpp: int = 1
    schedule: str = "1f1b"
    partition: str = "uniform"
    recompute: str = "none"
    freeze: str | None = None  # globs over serial names ("tok_emb.*,blocks.0.*"): not trained
    impl: str = "edu3d"  # or "torch": PyTorch's own APIs (chosen in edu3d.commands.train)
    timeout: float = 600.0
    # ---- checkpoints and failures ----
    ckpt_dir: str | None = None
    save_every: int | None = None
    keep_last: int | None = None
    resume: bool = False
    resume_step: int | None = None  # continue this step's checkpoint (implies resume)
    async_save: bool = False
    incremental: bool = False  # content-addressed blobs: a save writes only changed tensors
    max_restarts: int = 0
    inject_fault: dict | None = None  # {"rank", "step", "kind"[, "seconds": kind slow]}
    heartbeat: float | None = None
    oversubscribe: bool = False  # start more ranks than the cores hold (edu3d.launch.cores)
    # ---- documents of different lengths (edu3d.train.batching) ----
    batching: str = "fixed"  # or "pad", "bucket", "tokens", "pack"
    max_tokens: int | None = None  # tokens: each micro-batch's rows x longest at most this
    doc_mean: float | None = None  # mean document length (None: a quarter of seq_len)
    doc_sigma: float = 0.8  # spread: the standard deviation of the length's logarithm
    # ---- the fast path (edu3d.train.trainer; GPU speed, the same numbers) ----
    attn: str = "sdpa"  # or "explicit": the attention scores as a tensor
    compile: bool = False  # torch.compile each block (inductor)
    no_tf32: bool = False  # keep fp32 matmuls in full fp32 on a GPU (TF32 is on by default)
    # ---- nodes: torchrun's multi-node options (edu3d run's), None when not given ----
    nnodes: int | None = None  # one edu3d train per node, each running world/nnodes ranks
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None
    # ---- output ----
    json: bool = False
    monitor: bool = False  # a live table of every rank under the output (edu3d.launch.live)
    log_every: int = 1  # read the loss (a host synchronisation) every K steps; records at those
    memory_timeline: str | None = None  # write the last step's memory timeline (JSON) here
    # ---- not flags: what the course and the restart loop set ----
    reverse_buckets: bool = True  # False: gradient buckets in forward order (chapter 02's mistake)
    attempt: int = 0  # which restart this is (--max-restarts); faults fire in attempt 0 only
    router_dtype: str = "fp32"  # "fp64": parity tests score routers in double (no near-tie flips)


FIELDS = tuple(f.name for f in dataclasses.fields(TrainOptions))


def defaults(**overrides) -> TrainOptions:
    """``edu3d train``'s options at their defaults (tiny model), with ``overrides`` applied:
    what a benchmark, a chapter or a test hands to :class:`~edu3d.train.trainer.Trainer`."""
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; edu3d train's options are "
                        f"{', '.join(FIELDS)}")
    return TrainOptions(**overrides)


def from_flags(argv: list[str]) -> TrainOptions:
    """The options of an ``edu3d train`` command line written as data (``"--dp 2 --zero 1"``,
    split), as the course and the benchmarks show a layout; ``--flag`` alone sets a boolean.
    The command itself parses with :mod:`edu3d.commands.train`, which also checks ranges."""
    hints = typing.get_type_hints(TrainOptions)
    out, i = {}, 0
    while i < len(argv):
        name = argv[i][2:].replace("-", "_") if argv[i].startswith("--") else None
        if name not in FIELDS:
            raise ValueError(f"{argv[i]!r}: not an edu3d train option (e.g. --dp 2)")
        kinds = [k for k in typing.get_args(hints[name]) or (hints[name],) if k is not type(None)]
        if kinds == [bool]:
            out[name], i = True, i + 1
            continue
        if kinds[0] not in (int, float, str):
            raise ValueError(f"{argv[i]}: not written as data; use defaults({name}=...)")
        if i + 1 == len(argv):
            raise ValueError(f"{argv[i]}: give a value (e.g. {argv[i]} 2)")
        out[name], i = kinds[0](argv[i + 1]), i + 2
    return TrainOptions(**out)


def config_from_args(options: TrainOptions):
    """The model's :class:`~edu3d.model.gpt.GPTConfig`: the preset with the overrides (and
    the mixture of experts, when ``options.experts`` > 0)."""
    from edu3d.model.gpt import config_from

    o = options
    config = config_from(o.model, layers=o.layers, heads=o.heads, d_model=o.d_model,
                         seq=o.seq, vocab=o.vocab, tie=o.tie, vocab_pad=o.vocab_pad)
    if not o.experts:
        return config
    return dataclasses.replace(
        config, n_experts=o.experts, topk=o.topk, moe_every=o.moe_every,
        shared_experts=o.shared_experts, capacity_factor=o.capacity_factor,
        aux_loss_coef=o.aux_loss_coef, z_loss_coef=o.z_loss_coef, balance=o.balance,
        router_dtype=o.router_dtype)


def resolve_microbatches(options: TrainOptions) -> int:
    """``--microbatches`` (or its alias ``--grad-accum``); default 1, or pp for a pipeline."""
    m, accum = options.microbatches, options.grad_accum
    if m is not None and accum is not None and m != accum:
        raise LayoutError(f"--grad-accum {accum} and --microbatches {m} are the same option; "
                          "give one of them")
    return m or accum or options.pp


# ---- the composition rules -----------------------------------------------------------------
def check_args(options: TrainOptions):
    """Every rule a combination of options must follow; returns ``(config, layout)``.

    Resolves ``options.microbatches`` (and its alias ``options.grad_accum``) to the number of
    micro-batches per step. Raises :class:`~edu3d.distributed.mesh.LayoutError` saying what
    would work. (``--impl torch``'s own limits are checked by :mod:`edu3d.commands.train`.)
    """
    o = options
    if o.ep > 1 and o.dp * o.cp == 1:
        o.dp = o.ep  # --ep N alone: N data-parallel ranks to fold the experts into
    check_moe(o)
    config = config_from_args(o)
    layout = Layout(dp=o.dp, tp=o.tp, pp=o.pp, vpp=o.vpp, cp=o.cp, ep=o.ep)
    m = resolve_microbatches(o)
    o.microbatches = o.grad_accum = m
    layout.validate(config=config, global_batch=o.global_batch, microbatches=m)
    check_cp(o, config)
    if o.sp and o.tp == 1:
        raise LayoutError("--sp splits the sequence across the tensor-parallel group; "
                          "add --tp 2 (or more)")
    if o.sp and config.seq_len % o.tp:
        ok = ", ".join(str(t) for t in range(1, config.n_heads + 1)
                       if config.n_heads % t == 0 and config.seq_len % t == 0)
        raise LayoutError(f"sequence parallelism splits seq_len={config.seq_len} over tp="
                          f"{o.tp} ranks, which does not divide it; choose tp in {ok}")
    if o.tp_overlap and o.tp == 1:
        raise LayoutError("--tp-overlap overlaps tensor-parallel communication; add --tp 2 "
                          "(or more)")
    if o.vpp > 1 and o.schedule != "interleaved":
        raise LayoutError(f"--vpp {o.vpp} needs --schedule interleaved")
    if o.schedule == "interleaved" and o.pp > 1 and m % o.pp:
        raise LayoutError(f"interleaved 1F1B groups micro-batches by pp: --microbatches {m} "
                          f"must be a multiple of --pp {o.pp}")
    if o.zero and o.dp * o.cp == 1:
        raise LayoutError(f"--zero {o.zero} shards over the data-parallel group; "
                          "add --dp 2 (or more)")
    if o.offload and not o.zero:
        raise LayoutError("--offload moves ZeRO's sharded optimizer state; add --zero 1 "
                          "(or 2, 3)")
    if o.grad_reduce not in GRAD_REDUCE:
        raise LayoutError(f"grad_reduce={o.grad_reduce!r}: choose one of {', '.join(GRAD_REDUCE)}")
    if o.prefetch and o.zero != 3:
        raise LayoutError("--prefetch gathers ZeRO-3's parameters early; add --zero 3")
    needs_dir = [flag for flag, value in (("--resume", o.resume), ("--save-every", o.save_every),
                                          ("--resume-step", o.resume_step),
                                          ("--keep-last", o.keep_last),
                                          ("--async-save", o.async_save),
                                          ("--incremental", o.incremental),
                                          ("--max-restarts", o.max_restarts)) if value]
    if needs_dir and not o.ckpt_dir:
        raise LayoutError(f"{needs_dir[0]} works on checkpoints; add --ckpt-dir DIR")
    if o.resume_step is not None:
        if isinstance(o.resume_step, bool) or not isinstance(o.resume_step, int) \
                or o.resume_step < 1:
            raise LayoutError(f"--resume-step {o.resume_step!r} must be a step >= 1")
        o.resume = True  # --resume-step N is --resume from step N
    fault = o.inject_fault
    if fault is not None:
        if fault["rank"] >= layout.world_size:
            raise LayoutError(f"--inject-fault rank={fault['rank']}: this layout has ranks "
                              f"0..{layout.world_size - 1}")
        if fault.get("step", 1) > o.steps:
            raise LayoutError(f"--inject-fault step={fault['step']}: the run has only "
                              f"{o.steps} steps")
    if o.compress and (o.zero or o.dp == 1):
        raise LayoutError("--compress hooks plain data parallelism's gradient buckets: use it "
                          "with --dp 2 (or more) and without --zero")
    check_fast_path(o)
    check_nodes(o, layout)
    from edu3d.train.batching import check_options  # needs torch, as config_from_args

    check_options(o, config)
    return config, layout


def check_fast_path(o: TrainOptions) -> None:
    """The fast path's rules: a known attention, a C++ compiler for ``--compile`` (inductor
    writes and compiles C++ on a CPU), one record per step where checkpoints keep them."""
    if o.attn not in ATTENTION:
        raise LayoutError(f"--attn {o.attn!r}: choose one of {', '.join(ATTENTION)}")
    if o.log_every < 1:
        raise LayoutError(f"--log-every {o.log_every}: must be a positive integer")
    if o.log_every > 1 and o.ckpt_dir:
        raise LayoutError(f"--log-every {o.log_every} with --ckpt-dir: a checkpoint keeps every "
                          "step's record; use --log-every 1 with --ckpt-dir")
    if o.compile and not compiler():
        raise LayoutError("--compile needs a C++ compiler for torch.compile's inductor (none of "
                          "$CXX, c++, g++, clang++ is on PATH): install g++ (apt-get install "
                          "g++) or drop --compile")


def compiler() -> str | None:
    """The C++ compiler inductor would use, or None (``$CXX`` first, as inductor reads it)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else []
    return next((p for p in map(shutil.which, names + ["c++", "g++", "clang++"]) if p), None)


def node_options(o: TrainOptions) -> dict:
    """The run's multi-node options by name, for :func:`edu3d.launch.api.node_args`."""
    return {k: v for k, v in dataclasses.asdict(o).items() if k in NODE_OPTIONS}


def check_nodes(o: TrainOptions, layout: Layout) -> None:
    """The world shared out over ``--nnodes`` nodes: evenly, a node rank among them, and no
    ``--max-restarts`` (each node's command would restart on its own)."""
    try:
        node_args(layout.world_size, **node_options(o))
    except ValueError as err:
        raise LayoutError(str(err)) from None
    if (o.nnodes or 1) > 1 and o.max_restarts:
        raise LayoutError(f"--max-restarts {o.max_restarts} with --nnodes {o.nnodes}: each "
                          "node's edu3d train would restart on its own; drop --max-restarts")


# ---- will it fit? ---------------------------------------------------------------------------
def memory_per_rank(options: TrainOptions) -> dict:
    """Bytes the fullest rank of this run needs at the step's peak, by category: the
    planner's estimate (:func:`edu3d.plan.estimate.estimate`) plus the runtime itself.
    ``options`` must have passed :func:`check_args`."""
    return fit.need_per_rank(*from_train_args(options))


def check_fit(options: TrainOptions, available: int | None = None) -> dict:
    """Refuse (:class:`~edu3d.distributed.mesh.LayoutError`) a run whose ranks need more
    memory than this machine has available (:func:`edu3d.plan.fit.check_fit`); returns the
    estimate per rank. ``options`` must have passed :func:`check_args`."""
    return fit.check_fit(*from_train_args(options), available)


def oversubscribed(layout: Layout, cores: int | None = None) -> str | None:
    """A one-line warning when ranks outnumber CPU cores (:mod:`edu3d.launch.cores`), else None."""
    return launch_cores.oversubscribed(layout.world_size, cores, fit.on_gpus(layout.world_size))
