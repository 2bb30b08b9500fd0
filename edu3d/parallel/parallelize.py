"""``parallelize(model, mesh, run)``: the one place where strategies compose.

After reading this file you should understand the order in which a serial model becomes
this rank's piece of a 3D-parallel one (torchtitan's ``parallelize_llama``, made readable):

1. **tensor parallelism** is applied to the whole plain model: its linear layers and
   embedding become their parallel versions (serial parameter names kept), its loss the
   vocabulary-parallel one (:func:`~edu3d.parallel.tp.apply_tp`);
2. **FP8** (``--precision fp8``) swaps every block's four linear layers, plain or TP's, for
   their FP8 versions (:func:`~edu3d.parallel.fp8.apply_fp8`): same parameters, the
   products in FP8, their scales reduced over tp where a tensor is cut;
3. **context and expert parallelism**, module swaps like TP's: CP gives every block's
   attention core its ring / all-gather / Ulysses version and the position embedding this
   rank's positions (:func:`~edu3d.parallel.cp.apply_cp`; the trainer cuts the batch's
   sequences the same way); EP keeps this rank's experts of every mixture-of-experts layer and
   routes tokens to the others by all-to-all (:func:`~edu3d.parallel.ep.apply_ep`);
4. **activation recomputation** wraps the blocks (``full``) or their attention cores
   (``selective``), after TP so that it wraps the parallel block (a recomputed block repeats
   its TP forward communication) and before the cut, which keeps the wrapped blocks
   (:func:`~edu3d.parallel.recompute.apply_recompute`); **activation offloading** wraps the
   chosen blocks outside it, so that it moves what recomputation keeps
   (:func:`~edu3d.parallel.offload_activations.apply_offload`);
5. **the pipeline cut** keeps this rank's stages, chosen by serial layer numbers
   (:func:`~edu3d.schedules.partition.partition`, :func:`~edu3d.parallel.pp.stage.split_model`);
   the schedule's action list for this rank is built alongside;
6. **data parallelism or ZeRO** wraps what is left, the parameters this rank really holds
   (last, because it must see the final parameters: TP shards of this rank's stages only).
   Dense parameters are averaged over every ``dp x cp`` rank; an expert's over the ranks
   holding the same experts (``edp``), divided by the same ``dp x cp``: each of those ranks
   routed its own tokens to every expert, so the sums cover all ``dp x cp`` ranks' tokens.
   Under HSDP (``--hsdp R``) ZeRO shards over a replica group's ranks (``shard``, experts'
   ``eshard``) and all-reduces across the groups (``replicate``, ``ereplicate``).
   Under ZeRO-3 the FP8 layers' tensorwise weights get units of their own, gathered in FP8
   (:mod:`edu3d.parallel.fp8.fp8_gather`).

Each step is a function a reader can call alone; :class:`Parallel` carries what the trainer
and :mod:`edu3d.parallel.grads` need: the stages, the actions, the shard specs, the serial
name of every parameter, and the DP/ZeRO wrapper.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from edu3d.config.sections import Run
from edu3d.distributed.mesh import Mesh
from edu3d.parallel.cp.sequence import apply_cp
from edu3d.parallel.dp.compress import make_hook
from edu3d.parallel.dp.data_parallel import DataParallel
from edu3d.parallel.ep.placement import (apply_ep, apply_token_groups, expert_param_names,
                                         token_groups)
from edu3d.parallel.fp8 import apply_fp8, gathered_weights, install, split_units
from edu3d.parallel.freeze import apply_freeze
from edu3d.schedules.partition import partition
from edu3d.schedules.actions import Action, build, chunks, placement, with_comms
from edu3d.parallel.pp.stage import PipelineStage, split_model
from edu3d.parallel.offload_activations import ActivationOffload, apply_offload
from edu3d.parallel.recompute import apply_recompute
from edu3d.parallel.tp.apply import apply_tp, partial_grad_names
from edu3d.parallel.zero.sharding import Zero
from edu3d.parallel.zero.units import merge_shared, model_units


@dataclass
class Parallel:
    """This rank's piece of the model, and how it is wired to the others."""

    mesh: Mesh
    run: Run
    stages: dict[int, PipelineStage]  # global stage index -> stage (this rank's only)
    module: nn.ModuleDict  # the stages as one module: every parameter this rank holds
    n_stages: int
    parts: list  # (first layer, end layer) of every global stage
    actions: list[Action]  # this rank's schedule, with its sends and receives
    specs: dict  # serial name -> TP shard spec (None: every tp rank holds it whole)
    shapes: dict  # serial name -> full (serial) shape
    names: dict = field(default_factory=dict)  # parameter -> serial name
    partial: set = field(default_factory=set)  # serial names of SP-partial gradients
    tied: nn.Parameter | None = None  # tied embedding split over first and last stage
    dp: DataParallel | None = None
    zero: Zero | None = None
    experts: set = field(default_factory=set)  # serial names of expert weights (under EP)
    expert_dp: DataParallel | None = None  # averages the experts over edp (ep > 1)
    expert_zero: Zero | None = None
    offload: ActivationOffload | None = None  # --offload-activations: its blocks and counts

    @property
    def wrappers(self) -> list:
        """The gradient averagers this rank runs: dense, then experts'."""
        return [w for w in (self.dp, self.zero, self.expert_dp, self.expert_zero)
                if w is not None]

    @property
    def zeros(self) -> list[Zero]:
        return [z for z in (self.zero, self.expert_zero) if z is not None]

    @property
    def is_first(self) -> bool:
        return 0 in self.stages

    @property
    def is_last(self) -> bool:
        return self.n_stages - 1 in self.stages


def apply_pipeline(model: nn.Module, mesh: Mesh, run: Run, compute=None):
    """This rank's stages and its action list. ``compute`` (per-rank lists of compute
    actions, e.g. a learner's schedule) replaces the named schedule's."""
    layout = mesh.layout
    v = chunks(run.parallel.schedule, max(run.layout.vpp, layout.vpp))
    parts = partition(model.config, layout.pp, v, method=run.parallel.partition)
    pp_rank = mesh.index("pp")
    stages = split_model(model, parts, layout.pp, pp_rank, placement(run.parallel.schedule))
    if compute is None:
        actions = build(run.parallel.schedule, layout.pp, run.microbatches, v)
    else:
        actions = with_comms([[a if isinstance(a, Action) else Action.parse(a) for a in ops]
                              for ops in compute], layout.pp, v)
    return stages, parts, actions[pp_rank]


def apply_data_parallel(par: Parallel, optimizer=None) -> None:
    """DP (one of four gradient averagers) or ZeRO over this rank's own parameters. ZeRO's
    optimizer over a list of parameters is ``Zero(..., **optimizer(params))``: its
    ``optimizer_class``, ``params`` (or param groups) and defaults (the trainer's rule);
    ``None``: :class:`Zero`'s default, AdamW over all of them."""
    mesh, pl = par.mesh, par.run.parallel
    offload = par.run.memory.offload
    layout = mesh.layout
    n = layout.dp * layout.cp  # every dense gradient is averaged over dp x cp
    is_expert = {p for p, name in par.names.items() if name in par.experts}
    options = optimizer or (lambda params: {})
    if pl.zero:
        units = merge_shared([u for s in sorted(par.stages) for u in
                              model_units(par.stages[s], _tied_in(par.stages[s], par.tied))])
        dense = [(name, mods, [p for p in ps if p not in is_expert]) for name, mods, ps in units]
        dense = [u for u in dense if u[2]]
        group, across = zero_groups(mesh, pl.hsdp, experts=False)
        fp8 = gathered_weights(par.module) if pl.zero == 3 else {}
        dense = split_units(dense, set(fp8))
        par.zero = Zero(par.module, group, pl.zero, prefetch=pl.prefetch, offload=offload,
                        units=dense, grad_reduce=pl.grad_reduce, reduce_scatter=True,
                        replicate_group=across,
                        **options([p for _, _, ps in dense for p in ps]))
        install(par.zero, fp8)
        if is_expert:
            experts = _expert_units(par, is_expert)
            group, across = zero_groups(mesh, pl.hsdp, experts=True)
            par.expert_zero = Zero(par.module, group, pl.zero, offload=offload,
                                   units=experts, divisor=n, grad_reduce=pl.grad_reduce,
                                   reduce_scatter=True, replicate_group=across,
                                   **options([p for _, _, ps in experts for p in ps]))
    elif n > 1:
        hook = make_hook(pl.compress) if pl.compress else None
        par.dp = DataParallel(par.module, mesh.group("dpcp"), pl.dp_impl, pl.bucket_mb,
                              reverse_buckets=pl.reverse_buckets, comm_hook=hook,
                              params=[p for p in par.module.parameters() if p not in is_expert],
                              average_in_backward=False)  # the trainer calls finish()
        if is_expert:
            par.expert_dp = DataParallel(par.module, mesh.group("edp"), pl.dp_impl,
                                         pl.bucket_mb, reverse_buckets=pl.reverse_buckets,
                                         params=[p for p in par.module.parameters()
                                                 if p in is_expert], divisor=n,
                                         average_in_backward=False)


def zero_groups(mesh: Mesh, hsdp: int, experts: bool) -> tuple:
    """``(group, replicate_group)`` of a :class:`Zero`: it shards over ``dp x cp`` (experts:
    ``edp``) and all-reduces across nothing, or under HSDP (``hsdp`` replica groups) shards
    over its replica group's ranks and all-reduces across the groups
    (:meth:`Mesh.add_hsdp <edu3d.distributed.mesh.Mesh.add_hsdp>`)."""
    if hsdp == 1:
        return mesh.group("edp" if experts else "dpcp"), None
    mesh.add_hsdp(hsdp)  # collective: every rank builds the groups (once)
    e = "e" if experts else ""
    return mesh.group(e + "shard"), mesh.group(e + "replicate")


def _expert_units(par: Parallel, is_expert: set) -> list:
    """ZeRO's units for the expert weights: one per mixture-of-experts layer, holding this
    rank's experts of it, in call order (the experts' own forwards gather it under ZeRO-3)."""
    units = []
    for module_name, module in par.module.named_modules():
        params = [p for p in module.parameters(recurse=False) if p in is_expert]
        if not params:
            continue
        layer, _, rest = module_name.partition(".experts.")
        expert = par.module.get_submodule(f"{layer}.experts.{rest.split('.')[0]}")
        if units and units[-1][0] == layer:
            units[-1][2].extend(params)
            if units[-1][1][-1] is not expert:
                units[-1][1].append(expert)
        else:
            units.append((layer, [expert], params))
    return units


def _tied_in(stage: PipelineStage, tied):
    """The embedding tied across stages if ``stage`` holds a copy (as tok_emb or lm_head);
    a stage that uses it twice (pp = 1) is found by :func:`model_units` itself."""
    held = [getattr(getattr(stage, m, None), "weight", None) for m in ("tok_emb", "lm_head")]
    return tied if tied is not None and any(t is tied for t in held) else None


def apply_compile(model: nn.Module, ends: bool = True) -> None:
    """``torch.compile`` each block's ``forward``, as torchtitan compiles per block: after
    TP, CP, EP and recomputation have rewritten the block (so the compiled code is theirs)
    and before the pipeline cut and ZeRO, whose module hooks stay *outside* the compiled
    code (they gather and free parameters, which a graph cannot capture). Every block runs
    the same code on its own parameters, so one compiled graph serves them all.

    With ``ends`` the model's own ``head`` and ``loss`` are compiled too (the padding mask,
    the fp32 upcast and the cross entropy over the vocabulary fuse into a few passes over
    the logits instead of one per operation). The trainer asks for it only where the ends
    are plain: not under TP (its vocabulary-parallel loss communicates) nor ZeRO-3 (its
    hooks sit on ``ln_f`` and ``lm_head``, which ``head`` calls)."""
    # each traced collective reads the clock: dynamo runs it eagerly between two graphs
    warnings.filterwarnings("ignore", message=".*does not know how to trace the builtin "
                            "`time.perf_counter_ns")
    for block in model.blocks:
        block.forward = torch.compile(block.forward)
    for name in ("head", "loss") if ends else ():
        fn = getattr(model, name)
        if getattr(fn, "__func__", None) is getattr(type(model), name, None):  # its own code
            setattr(model, name, torch.compile(fn))


def parallelize(model: nn.Module, mesh: Mesh, run: Run, optimizer=None,
                compute=None) -> Parallel:
    """Turn the full serial ``model`` (built from the same seed on every rank) into this
    rank's piece of ``mesh``'s layout; ``optimizer(params)`` gives ZeRO's optimizer
    arguments for ``params`` (see :func:`apply_data_parallel`)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    tie = bool(getattr(model.config, "tie_weights", False))
    if mesh.size("tp") > 1:
        specs = apply_tp(model, mesh, sequence_parallel=run.parallel.sp,
                         overlap=run.parallel.tp_overlap)
    else:
        specs = {n: None for n in shapes}
    if run.precision.dtype == "fp8":
        apply_fp8(model, run.precision)
    layout = mesh.layout
    if layout.cp > 1:
        apply_cp(model, mesh.group("cp"), mesh.index("cp"), layout.cp, run.parallel.cp_impl,
                 run.parallel.cp_split)
    if layout.world_size > 1:  # a mixture of experts' token groups span these ranks
        apply_token_groups(model, token_groups(mesh, model.config.seq_len,
                                               run.parallel.cp_split))
    experts = set()
    if layout.ep > 1:
        experts = expert_param_names(model)
        apply_ep(model, mesh.group("ep"), mesh.index("ep"), layout.ep)
    apply_recompute(model, run.memory.recompute)
    if run.precision.compile:
        apply_compile(model, ends=mesh.size("tp") == 1 and run.parallel.zero != 3)
    offload = apply_offload(model, run.memory)
    names = {p: n for n, p in model.named_parameters()}
    apply_freeze(model, run.memory.freeze)  # serial names, after TP made its new parameters
    stages, parts, actions = apply_pipeline(model, mesh, run, compute)
    n_stages = len(parts)
    par = Parallel(mesh, run, stages, nn.ModuleDict({str(s): st for s, st in stages.items()}),
                   n_stages, parts, actions, specs, shapes, names,
                   set(partial_grad_names(specs, run.parallel.sp)), experts=experts,
                   offload=offload)
    if tie and n_stages > 1:
        # first and last stage each keep a copy; their gradients are summed after the last
        # micro-batch over the "embed" group (Megatron's embedding group)
        mesh.add_groups("embed")
        if par.is_first or par.is_last:
            par.tied = model.tok_emb.weight
    apply_data_parallel(par, optimizer)
    return par
