"""Every check made before a single process starts, made once: :func:`preflight`.

After reading this file you should understand:

* which options compose (all the axes do: TP inside PP, ZeRO over either, micro-batches with
  any layout, because a one-stage pipeline *is* gradient accumulation) and the few
  combinations that cannot work, each refused with what would work instead
  (:func:`check_args`, with the mixture-of-experts and context-parallel rules of
  :mod:`edu3d.train.axis_rules`, FP8's of :mod:`edu3d.train.fp8_rules` and the batching
  rules of :mod:`edu3d.train.batching`);
* that a run's description (:class:`~edu3d.config.sections.Run`) is *resolved* here, once:
  ``--ep N`` alone becomes ``--dp N --ep N``, ``--resume-step N`` implies ``--resume``, an
  output path becomes absolute;
* whether the run fits in this machine: the planner's own estimate
  (:mod:`edu3d.plan.fit`), so ``edu3d plan`` and the refusal print the same numbers;
* that the ranks trust what passed: :func:`preflight` returns a :class:`Checked` run, and
  :func:`edu3d.train.loop.run` takes only that, so nothing is checked twice and no check is
  skipped.

This module imports no torch at its top (``edu3d train --help`` and a refused run must start
fast); the checks that need the model's real parameter names, the batching rules and the
checkpoint folder come in through imports inside functions, after the cheap rules passed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass

from edu3d.config.layout import Layout, LayoutError
from edu3d.config.sections import Run
from edu3d.launch import cores as launch_cores
from edu3d.launch.api import check_launch, node_args
from edu3d.model.config_schema import config_from
from edu3d.model.shapes import COURSE_PRESETS
from edu3d.plan import fit
from edu3d.plan.estimate import spec_of
from edu3d.train.axis_rules import aux_coef, aux_scope_note, check_cp, check_moe
from edu3d.train.fp8_rules import check_fp8
from edu3d.train.pipeline_rules import check_pipeline

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
RECOMPUTE = ("none", "selective", "full")
BATCHING = ("fixed", "pad", "bucket", "tokens", "pack")  # edu3d.train.batching.MODES; a test checks
GRAD_REDUCE = ("per-microbatch", "per-step")  # edu3d.parallel.zero.sharding.GRAD_REDUCE
ATTENTION = ("sdpa", "explicit")  # edu3d.model.gpt.ATTENTION; a test checks
FAULT_KINDS = ("exit", "kill", "hang", "slow")
PRESET_NAMES = COURSE_PRESETS  # edu3d.model.gpt.PRESETS' names, torch-free; a test checks
MIN_VOCAB = 4  # edu3d.train.data.SUCCESSORS: each token of the synthetic corpus has 4 successors


@dataclass(frozen=True)
class Checked:
    """A run that passed :func:`preflight`, with what the checks found."""

    run: Run  # resolved (see the module docstring)
    config: object  # the model's GPTConfig
    need: dict  # bytes the fullest rank needs, by category (edu3d.plan.fit.need_per_rank)
    frozen: tuple[str, ...] = ()  # the serial names --freeze freezes
    resume_step: int | None = None  # the checkpoint step a --resume starts from (0: none)
    warnings: tuple[str, ...] = ()  # printed once, before launch


def preflight(run: Run, available: int | None = None) -> Checked:
    """Every check of ``run``, once, in the order that refuses a bad run fastest: the rules
    (:func:`check_args`), the memory (:func:`edu3d.plan.fit.check_fit`), the frozen names,
    the output path and the checkpoint folder. Raises ``ValueError`` (a
    :class:`~edu3d.config.layout.LayoutError`, or a checkpoint error) saying what would work."""
    run = resolve(run)
    config, lay = check_args(run)
    if lay.world_size > 1:  # ranks will start on this node: can they?
        here = lay.world_size // (run.launch.nnodes or 1)
        check_launch(here, run.launch.heartbeat, run.launch.oversubscribe, fit.on_gpus(here))
    if run.launch.monitor and lay.world_size == 1:
        raise LayoutError("--monitor watches the ranks of a parallel run; add --dp 2 (or "
                          "another layout), or drop --monitor (a serial run prints its progress)")
    need = check_fit(run, available)
    frozen = check_freeze(run, config)
    run = check_memory_timeline(run)
    resume_step = None
    if run.checkpoint.ckpt_dir:
        from edu3d.ckpt.format import check_ckpt_dir  # torch: the checkpoint's format

        resume_step = check_ckpt_dir(run, config)
    warnings = tuple(w for w in (oversubscribed(lay), aux_scope_note(run)) if w)
    return Checked(run, config, need, tuple(frozen), resume_step, warnings)


def model_config(run: Run):
    """The model's :class:`~edu3d.model.gpt.GPTConfig`: the preset with the overrides (and
    the mixture of experts, when ``run.model.experts`` > 0)."""
    m = run.model
    vocab = m.vocab
    if vocab is None and run.batch.data != "synthetic":  # real text: byte tokens
        vocab = 256  # edu3d.train.text.VOCAB
    config = config_from(m.preset, layers=m.layers, heads=m.heads, d_model=m.d_model,
                         seq=m.seq, vocab=vocab, tie=m.tie, vocab_pad=m.vocab_pad)
    if not m.experts:
        return config
    return dataclasses.replace(
        config, n_experts=m.experts, topk=m.topk, moe_every=m.moe_every,
        shared_experts=m.shared_experts, capacity_factor=m.capacity_factor,
        aux_loss_coef=aux_coef(m), aux_scope=m.aux_scope, z_loss_coef=m.z_loss_coef,
        balance=m.balance, router_dtype=m.router_dtype)


# ---- the composition rules -----------------------------------------------------------------
def resolve(run: Run) -> Run:
    """What the flags imply, made explicit: ``--ep N`` alone is ``--dp N --ep N`` (N
    data-parallel ranks to fold the experts into), ``--resume-step N`` is ``--resume``."""
    lay = run.layout
    if lay.ep > 1 and lay.dp * lay.cp == 1:
        run = run.replace(dp=lay.ep)
    step = run.checkpoint.resume_step
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise LayoutError(f"--resume-step {step!r} must be a step >= 1")
        run = run.replace(resume=True)
    return run


def check_args(run: Run) -> tuple[object, Layout]:
    """Every rule a combination of options must follow, on the run as :func:`resolve` makes
    it; returns the model's config and the layout. Raises
    :class:`~edu3d.config.layout.LayoutError` saying what would work. (``--impl torch``'s own
    limits are checked by :mod:`edu3d.commands.train`.)"""
    run = resolve(run)
    lay = run.layout
    check_moe(run)
    check_fp8(run)
    config = model_config(run)
    par, m = run.parallel, run.microbatches
    lay.validate(config=config, global_batch=run.batch.global_batch, microbatches=m)
    check_cp(run, config)
    if par.sp and lay.tp == 1:
        raise LayoutError("--sp splits the sequence across the tensor-parallel group; "
                          "add --tp 2 (or more)")
    if par.sp and config.seq_len % lay.tp:
        ok = ", ".join(str(t) for t in range(1, config.n_heads + 1)
                       if config.n_heads % t == 0 and config.seq_len % t == 0)
        raise LayoutError(f"sequence parallelism splits seq_len={config.seq_len} over tp="
                          f"{lay.tp} ranks, which does not divide it; choose tp in {ok}")
    if par.tp_overlap and lay.tp == 1:
        raise LayoutError("--tp-overlap overlaps tensor-parallel communication; add --tp 2 "
                          "(or more)")
    if lay.vpp > 1 and par.schedule != "interleaved":
        raise LayoutError(f"--vpp {lay.vpp} needs --schedule interleaved")
    if par.schedule == "interleaved" and lay.pp > 1 and m % lay.pp:
        raise LayoutError(f"interleaved 1F1B groups micro-batches by pp: --microbatches {m} "
                          f"must be a multiple of --pp {lay.pp}")
    check_pipeline(run, config.n_layers, m)
    if par.partition not in ("uniform", "balanced"):
        raise LayoutError(f"partition {par.partition!r}: the trainer cuts 'uniform' or "
                          "'balanced'" + ("; 'ends' (the embedding and head each in a layer's "
                                          "place) is a cut the planner weighs, not one edu3d "
                                          "runs" if par.partition == "ends" else ""))
    if par.zero and lay.dp * lay.cp == 1:
        raise LayoutError(f"--zero {par.zero} shards over the data-parallel group; "
                          "add --dp 2 (or more)")
    check_hsdp(run)
    if run.memory.offload and not par.zero:
        raise LayoutError("--offload moves ZeRO's sharded optimizer state; add --zero 1 "
                          "(or 2, 3)")
    check_offload(run, config.n_layers)
    if par.grad_reduce not in GRAD_REDUCE:
        raise LayoutError(f"grad_reduce={par.grad_reduce!r}: choose one of "
                          f"{', '.join(GRAD_REDUCE)}")
    if par.prefetch and par.zero != 3:
        raise LayoutError("--prefetch gathers ZeRO-3's parameters early; add --zero 3")
    ck = run.checkpoint
    needs_dir = [flag for flag, value in (
        ("--resume", ck.resume), ("--save-every", ck.save_every),
        ("--resume-step", ck.resume_step), ("--keep-last", ck.keep_last),
        ("--async-save", ck.async_save), ("--incremental", ck.incremental),
        ("--max-restarts", ck.max_restarts)) if value]
    if needs_dir and not ck.ckpt_dir:
        raise LayoutError(f"{needs_dir[0]} works on checkpoints; add --ckpt-dir DIR")
    fault = run.launch.inject_fault
    if fault is not None:
        if fault.rank >= lay.world_size:
            raise LayoutError(f"--inject-fault rank={fault.rank}: this layout has ranks "
                              f"0..{lay.world_size - 1}")
        if fault.step > run.training.steps:
            raise LayoutError(f"--inject-fault step={fault.step}: the run has only "
                              f"{run.training.steps} steps")
    if par.compress and (par.zero or lay.dp == 1):
        raise LayoutError("--compress hooks plain data parallelism's gradient buckets: use it "
                          "with --dp 2 (or more) and without --zero")
    check_fast_path(run)
    check_nodes(run, lay)
    from edu3d.train.batching import check_options  # torch, as model_config
    from edu3d.train.text import check_data  # torch and numpy: the token file

    check_options(run, config)
    check_data(run, config)
    return config, lay


def check_hsdp(run: Run) -> None:
    """``--hsdp R``: ZeRO shards within R replica groups and all-reduces across them
    (:mod:`edu3d.parallel.zero.hybrid`), so it needs ZeRO, and R must divide dp (and the
    expert-data-parallel ranks): :meth:`~edu3d.config.layout.Layout.hsdp_sizes`."""
    r = run.parallel.hsdp
    if r != 1 and not run.parallel.zero:
        raise LayoutError(f"--hsdp {r} shards ZeRO's state within replica groups; plain data "
                          "parallelism (--zero 0) holds everything on every rank already: add "
                          "--zero 3 (or 2, 1), or drop --hsdp")
    run.layout.hsdp_sizes(r)


def check_offload(run: Run, n_layers: int) -> None:
    """``--offload-activations`` (:mod:`edu3d.parallel.offload_activations`): its two options
    only with it, on edu3d's trainer, moving at least one block. It composes with every
    layout and with recomputation (it offloads what recomputation keeps)."""
    mem = run.memory
    if not mem.offload_activations:
        if mem.offload_every != 1 or mem.offload_last:
            flag = "--offload-last" if mem.offload_last else f"--offload-every {mem.offload_every}"
            raise LayoutError(f"{flag} chooses the blocks --offload-activations moves; add "
                              "--offload-activations")
        return
    if mem.offload_every < 1:
        raise LayoutError(f"--offload-every {mem.offload_every}: must be a positive integer")
    if run.parallel.impl != "edu3d":
        raise LayoutError("--offload-activations wraps edu3d's own blocks; drop --impl torch")
    if not mem.offloaded(n_layers):
        raise LayoutError(f"--offload-activations moves no block: the model's {n_layers} "
                          f"block(s) leave only the last, which stays on the device; add "
                          "--offload-last (or more --layers)")


def check_fast_path(run: Run) -> None:
    """The fast path's rules: a known attention, a C++ compiler for ``--compile`` (inductor
    writes and compiles C++ on a CPU), one record per step where checkpoints keep them."""
    attn, log_every = run.precision.attn, run.launch.log_every
    if attn not in ATTENTION:
        raise LayoutError(f"--attn {attn!r}: choose one of {', '.join(ATTENTION)}")
    if log_every < 1:
        raise LayoutError(f"--log-every {log_every}: must be a positive integer")
    if log_every > 1 and run.checkpoint.ckpt_dir:
        raise LayoutError(f"--log-every {log_every} with --ckpt-dir: a checkpoint keeps every "
                          "step's record; use --log-every 1 with --ckpt-dir")
    if run.precision.compile and not compiler():
        raise LayoutError("--compile needs a C++ compiler for torch.compile's inductor (none of "
                          "$CXX, c++, g++, clang++ is on PATH): install g++ (apt-get install "
                          "g++) or drop --compile")


def compiler() -> str | None:
    """The C++ compiler inductor would use, or None (``$CXX`` first, as inductor reads it)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else []
    return next((p for p in map(shutil.which, names + ["c++", "g++", "clang++"]) if p), None)


def node_options(run: Run) -> dict:
    """The run's multi-node options, as :func:`edu3d.launch.api.node_args` takes them."""
    lc = run.launch
    return {"nnodes": lc.nnodes, "node_rank": lc.node_rank, "rdzv_endpoint": lc.rdzv_endpoint,
            "rdzv_backend": lc.rdzv_backend, "rdzv_id": lc.rdzv_id, "rdzv_conf": lc.rdzv_conf,
            "master_addr": lc.master_addr, "master_port": lc.master_port,
            "local_addr": lc.local_addr}


def check_nodes(run: Run, layout: Layout) -> None:
    """The world shared out over ``--nnodes`` nodes: evenly, a node rank among them, and no
    ``--max-restarts`` (each node's command would restart on its own)."""
    try:
        node_args(layout.world_size, **node_options(run))
    except ValueError as err:
        raise LayoutError(str(err)) from None
    nnodes, restarts = run.launch.nnodes, run.checkpoint.max_restarts
    if (nnodes or 1) > 1 and restarts:
        raise LayoutError(f"--max-restarts {restarts} with --nnodes {nnodes}: each node's "
                          "edu3d train would restart on its own; drop --max-restarts")


def check_freeze(run: Run, config) -> list[str]:
    """The serial names ``--freeze`` freezes (``ValueError``, one line, for a glob that
    matches none: :func:`edu3d.model.param_globs.check_patterns`)."""
    globs = run.memory.freeze
    if not globs:
        return []
    if run.parallel.impl == "torch":
        raise ValueError("--freeze with --impl torch: edu3d's trainer freezes by serial name; "
                         "drop --impl torch")
    from edu3d.model.param_globs import check_patterns
    from edu3d.parallel.freeze import param_names  # torch: the model's real names

    return check_patterns(param_names(config), globs)


def check_memory_timeline(run: Run) -> Run:
    """``--memory-timeline FILE``: a step after the first (which allocates AdamW's state) on
    edu3d's trainer, into a new or regular file (never beside a folder) of a writable folder;
    the path made absolute for the ranks."""
    target = run.launch.memory_timeline
    if not target:
        return run
    path = os.path.abspath(target)
    folder = os.path.dirname(path)
    problem = ("use --steps 2 or more (the last step is recorded, after a first that "
               "allocates the optimizer's state)" if run.training.steps < 2 else
               "drop --impl torch (it records edu3d's own trainer)"
               if run.parallel.impl != "edu3d" else
               f"the folder {folder} does not exist" if not os.path.isdir(folder) else
               f"the folder {folder} is not writable" if not os.access(folder, os.W_OK) else
               f"{path} is {'a folder' if os.path.isdir(path) else 'not a regular file'}; name "
               "a file" if os.path.lexists(path) and not os.path.isfile(path) else None)
    if problem:
        raise LayoutError(f"--memory-timeline {target}: {problem}")
    return run.replace(memory_timeline=path)


# ---- will it fit? ---------------------------------------------------------------------------
def memory_per_rank(run: Run) -> dict:
    """Bytes the fullest rank of ``run`` needs at the step's peak, by category: the planner's
    estimate (:func:`edu3d.plan.estimate.estimate`) plus the runtime itself."""
    return fit.need_per_rank(spec_of(run), run)


def check_fit(run: Run, available: int | None = None) -> dict:
    """Refuse (:class:`~edu3d.config.layout.LayoutError`) a run whose ranks need more
    memory than this machine has available (:func:`edu3d.plan.fit.check_fit`); returns the
    estimate per rank."""
    return fit.check_fit(spec_of(run), run, available)


def oversubscribed(layout: Layout, cores: int | None = None) -> str | None:
    """A one-line warning when ranks outnumber CPU cores (:mod:`edu3d.launch.cores`), else None."""
    return launch_cores.oversubscribed(layout.world_size, cores, fit.on_gpus(layout.world_size))
