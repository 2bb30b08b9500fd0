"""The rules of the two axes that complete the 5D set, checked before a process starts:
mixtures of experts with expert parallelism, and context parallelism.

After reading this file you can say which ``--experts``/``--ep``/``--topk`` and
``--cp``/``--cp-impl``/``--cp-split`` combinations edu3d runs, and what each refusal tells
you to change instead. :func:`edu3d.train.preflight.check_args` calls both, with the run
(:class:`~edu3d.config.sections.Run`); no torch here.
"""

from __future__ import annotations

import dataclasses

from edu3d.config.layout import LayoutError
from edu3d.config.sections import Model, Parallel, Run

CP_IMPLS = ("ring", "allgather", "ulysses")
CP_SPLITS = ("zigzag", "plain")
BALANCE = ("aux", "bias")
AUX_SCOPES = ("microbatch", "sequence", "global")  # edu3d.model.balance.SCOPES, without torch
AUX_COEF = 1e-2  # --aux-loss-coef's default with --balance aux


def default(section, name: str):
    """A field's default in a section of the run (the sections are slotted: the class
    attribute is a descriptor, not the default)."""
    return next(f.default for f in dataclasses.fields(section) if f.name == name)


def check_moe(run: Run) -> None:
    """The mixture-of-experts and expert-parallel rules (before the model is built)."""
    o, ep = run.model, run.layout.ep
    if o.balance not in BALANCE:
        raise LayoutError(f"--balance {o.balance!r}: choose one of {', '.join(BALANCE)}")
    if o.aux_scope not in AUX_SCOPES:
        raise LayoutError(f"--aux-scope {o.aux_scope!r}: choose one of {', '.join(AUX_SCOPES)}")
    if not o.experts:
        moe_only = [f for f, v in (("--ep", ep > 1), ("--shared-experts", o.shared_experts),
                                   ("--capacity-factor", o.capacity_factor),
                                   ("--balance bias", o.balance == "bias"),
                                   (f"--topk {o.topk}", o.topk != default(Model, "topk")),
                                   (f"--moe-every {o.moe_every}",
                                    o.moe_every != default(Model, "moe_every")),
                                   ("--aux-scope", o.aux_scope != "microbatch")) if v]
        if moe_only:
            raise LayoutError(f"{moe_only[0]} needs a mixture of experts: add --experts 4 "
                              "(or another count)")
        return
    if not 1 <= o.topk <= o.experts:
        raise LayoutError(f"--topk {o.topk}: each token picks 1 to --experts {o.experts} "
                          "experts")
    if o.moe_every < 1 or o.shared_experts < 0 or o.capacity_factor < 0:
        raise LayoutError("--moe-every must be >= 1, --shared-experts and --capacity-factor "
                          ">= 0 (0: dropless)")
    if o.experts % ep:
        ok = ", ".join(str(d) for d in range(1, o.experts + 1) if o.experts % d == 0)
        raise LayoutError(f"--ep {ep} must divide --experts {o.experts} (each rank holds "
                          f"experts/ep of them); choose ep in {ok}")
    if o.balance == "bias" and run.checkpoint.ckpt_dir:
        raise LayoutError("--balance bias with --ckpt-dir: the per-expert bias is a buffer, and "
                          "edu3d's checkpoints hold parameters and optimizer state only, so a "
                          "resumed run would restart it at 0; use --balance aux to checkpoint")
    if run.parallel.sp:
        raise LayoutError("--sp with --experts: the mixture-of-experts layer routes whole "
                          "tokens and edu3d runs it on every tensor-parallel rank; drop --sp")


def aux_coef(model) -> float:
    """The load-balancing loss's weight: ``--aux-loss-coef`` when given, else 1e-2, or 0 with
    ``--balance bias`` (DeepSeek-V3 balances by the bias alone; ask for both with a
    coefficient)."""
    if model.aux_loss_coef is not None:
        return model.aux_loss_coef
    return 0.0 if model.balance == "bias" else AUX_COEF


def aux_scope_note(run: Run) -> str | None:
    """One line saying which serial command a mixture-of-experts run equals, when that is
    not simply the same command on one process: the balance statistics and the capacity
    count groups of tokens, and a data rank's micro-batch is a group of its own."""
    o, dp, m = run.model, run.layout.dp, run.microbatches
    if not o.experts or dp * m == 1:
        return None
    capacity = " (--capacity-factor still counts each data rank's micro-batch)" \
        if o.capacity_factor > 0 and dp > 1 else ""
    if o.aux_scope == "microbatch":
        return (f"--aux-scope microbatch counts the load balance over each data rank's "
                f"micro-batch, {dp} x {m} groups a step: this run equals the serial command "
                f"with --microbatches {dp * m} and no layout flags; --aux-scope global counts "
                f"each micro-batch over every rank, as the serial command with --microbatches "
                f"{m} does{capacity}")
    if capacity:
        return (f"--capacity-factor counts each data rank's micro-batch, {dp} x {m} groups a "
                f"step, whatever --aux-scope says (an expert's buffer is one rank's): this run "
                f"equals no serial command exactly; with --aux-scope microbatch it equals the "
                f"serial command with --microbatches {dp * m}")
    return None


def check_cp(run: Run, config) -> None:
    """Context parallelism's rules: a sequence it can cut evenly, Ulysses' head limit."""
    par, cp, tp = run.parallel, run.layout.cp, run.layout.tp
    if par.cp_impl not in CP_IMPLS or par.cp_split not in CP_SPLITS:
        raise LayoutError(f"--cp-impl {par.cp_impl} --cp-split {par.cp_split}: choose --cp-impl "
                          f"in "
                          f"{', '.join(CP_IMPLS)} and --cp-split in {', '.join(CP_SPLITS)}")
    if cp == 1:
        idle = [f"--{flag.replace('_', '-')} {getattr(par, flag)}" for flag in ("cp_impl", "cp_split")
                if getattr(par, flag) != default(Parallel, flag)]
        if idle:
            raise LayoutError(f"{idle[0]} chooses how context parallelism works, and this run has "
                              "none: add --cp 2 (or more), or drop it")
        return
    chunks = 2 * cp if par.cp_split == "zigzag" else cp
    if config.seq_len % chunks:
        raise LayoutError(f"--cp {cp} --cp-split {par.cp_split} cuts each sequence into "
                          f"{chunks} equal chunks, but --seq {config.seq_len} does not divide; "
                          f"choose --cp in {cp_choices(run, config)}")
    if par.sp:
        raise LayoutError("--sp with --cp: both split the sequence; use one of them")
    heads = config.n_heads // tp
    if par.cp_impl == "ulysses" and heads % cp:
        raise LayoutError(f"--cp-impl ulysses gives each of the {cp} ranks whole heads, but "
                          f"each tensor-parallel rank has {heads} head(s); choose --cp in "
                          f"{cp_choices(run, config)}")


def cp_choices(run: Run, config) -> str:
    """The degrees of context parallelism that pass every rule of :func:`check_cp` for this
    run's sequence, split, heads and implementation (advice never offers a value that the
    next rule refuses)."""
    par, seq, heads = run.parallel, config.seq_len, config.n_heads // run.layout.tp
    ok = [n for n in range(1, seq + 1)
          if seq % (2 * n if par.cp_split == "zigzag" else n) == 0
          and (par.cp_impl != "ulysses" or heads % n == 0)]
    return ", ".join(map(str, ok))
