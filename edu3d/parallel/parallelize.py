"""``parallelize(model, mesh, plan)``: the one place where strategies compose.

After reading this file you should understand the order in which a serial model becomes
this rank's piece of a 3D-parallel one (torchtitan's ``parallelize_llama``, made readable):

1. **tensor parallelism** is applied to the whole plain model: its linear layers and
   embedding become their parallel versions (serial parameter names kept), its loss the
   vocabulary-parallel one (:func:`~edu3d.parallel.tp.apply_tp`);
2. **activation recomputation** wraps the blocks (``full``) or their attention cores
   (``selective``), after TP so that it wraps the parallel block (a recomputed block repeats
   its TP forward communication) and before the cut, which keeps the wrapped blocks
   (:func:`~edu3d.parallel.recompute.apply_recompute`);
3. **the pipeline cut** keeps this rank's stages, chosen by serial layer numbers
   (:func:`~edu3d.schedules.partition.partition`, :func:`~edu3d.parallel.pp.stage.split_model`);
   the schedule's action list for this rank is built alongside;
4. **data parallelism or ZeRO** wraps what is left, the parameters this rank really holds
   (last, because it must see the final parameters: TP shards of this rank's stages only).

Each step is a function a reader can call alone; :class:`Parallel` carries what the trainer
and :mod:`edu3d.parallel.grads` need: the stages, the actions, the shard specs, the serial
name of every parameter, and the DP/ZeRO wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from edu3d.distributed.mesh import Mesh
from edu3d.parallel.dp.compress import make_hook
from edu3d.parallel.dp.data_parallel import DataParallel
from edu3d.schedules.partition import partition
from edu3d.schedules.actions import Action, build, chunks, with_comms
from edu3d.parallel.pp.stage import PipelineStage, split_model
from edu3d.parallel.recompute import apply_recompute
from edu3d.parallel.tp.apply import apply_tp, partial_grad_names
from edu3d.parallel.zero.sharding import Zero, model_units


@dataclass(frozen=True)
class Plan:
    """How to parallelize, beyond the mesh's degrees (the trainer fills it from ``edu3d
    train``'s options: :func:`edu3d.train.trainer.plan_from`)."""

    sequence_parallel: bool = False
    tp_overlap: bool = False
    schedule: str = "1f1b"
    microbatches: int = 1
    vpp: int = 1  # model chunks per pipeline rank (interleaved; > 1 even on one rank)
    partition: str = "uniform"
    zero: int = 0
    dp_impl: str = "bucketed"
    bucket_mb: float = 25.0
    reverse_buckets: bool = True  # False: forward order, the mistake chapter 02 shows
    prefetch: bool = False
    offload: bool = False
    compress: str | None = None
    recompute: str = "none"  # "selective" | "full": activation recomputation


@dataclass
class Parallel:
    """This rank's piece of the model, and how it is wired to the others."""

    mesh: Mesh
    plan: Plan
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

    @property
    def is_first(self) -> bool:
        return 0 in self.stages

    @property
    def is_last(self) -> bool:
        return self.n_stages - 1 in self.stages


def apply_pipeline(model: nn.Module, mesh: Mesh, plan: Plan, compute=None):
    """This rank's stages and its action list. ``compute`` (per-rank lists of compute
    actions, e.g. a learner's schedule) replaces the named schedule's."""
    layout = mesh.layout
    v = chunks(plan.schedule, max(plan.vpp, layout.vpp))
    parts = partition(model.config, layout.pp, v, method=plan.partition)
    pp_rank = mesh.index("pp")
    stages = split_model(model, parts, layout.pp, pp_rank)
    if compute is None:
        actions = build(plan.schedule, layout.pp, plan.microbatches, v)
    else:
        actions = with_comms([[a if isinstance(a, Action) else Action.parse(a) for a in ops]
                              for ops in compute], layout.pp, v)
    return stages, parts, actions[pp_rank]


def apply_data_parallel(par: Parallel, make_optimizer=None) -> None:
    """DP (one of four gradient averagers) or ZeRO over this rank's own parameters; ZeRO
    builds its optimizer over its shard with ``make_optimizer(decay, no_decay)``."""
    mesh, plan = par.mesh, par.plan
    if plan.zero:
        units = [u for s in sorted(par.stages)
                 for u in model_units(par.stages[s], _tied_in(par.stages[s], par.tied))]
        par.zero = Zero(par.module, mesh.dp, plan.zero, make_optimizer, prefetch=plan.prefetch,
                        offload=plan.offload, units=units)
    elif mesh.size("dp") > 1:
        hook = make_hook(plan.compress) if plan.compress else None
        par.dp = DataParallel(par.module, mesh.dp, plan.dp_impl, plan.bucket_mb,
                              reverse_buckets=plan.reverse_buckets, comm_hook=hook)


def _tied_in(stage: PipelineStage, tied):
    """The embedding tied across stages if ``stage`` holds a copy (as tok_emb or lm_head);
    a stage that uses it twice (pp = 1) is found by :func:`model_units` itself."""
    held = [getattr(getattr(stage, m, None), "weight", None) for m in ("tok_emb", "lm_head")]
    return tied if tied is not None and any(t is tied for t in held) else None


def parallelize(model: nn.Module, mesh: Mesh, plan: Plan, make_optimizer=None,
                compute=None) -> Parallel:
    """Turn the full serial ``model`` (built from the same seed on every rank) into this
    rank's piece of ``mesh``'s layout; ``make_optimizer(decay, no_decay)`` builds ZeRO's
    optimizer over its shard (the trainer's rule)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    tie = bool(getattr(model.config, "tie_weights", False))
    if mesh.size("tp") > 1:
        specs = apply_tp(model, mesh, sequence_parallel=plan.sequence_parallel,
                         overlap=plan.tp_overlap)
    else:
        specs = {n: None for n in shapes}
    apply_recompute(model, plan.recompute)
    names = {p: n for n, p in model.named_parameters()}
    stages, parts, actions = apply_pipeline(model, mesh, plan, compute)
    n_stages = len(parts)
    par = Parallel(mesh, plan, stages, nn.ModuleDict({str(s): st for s, st in stages.items()}),
                   n_stages, parts, actions, specs, shapes, names,
                   set(partial_grad_names(specs, plan.sequence_parallel)))
    if tie and n_stages > 1:
        # first and last stage each keep a copy; their gradients are summed after the last
        # micro-batch over the "embed" group (Megatron's embedding group)
        mesh.add_groups("embed")
        if par.is_first or par.is_last:
            par.tied = model.tok_emb.weight
    apply_data_parallel(par, make_optimizer)
    return par
