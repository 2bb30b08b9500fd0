"""What a CPU adds to the performance model: the costs a GPU hides, and gloo's own collectives.

After reading this file you should understand why the same model needs a few more terms to
predict edu3d's runs on a laptop, each measured by ``edu3d calibrate`` (a profile with
``cores`` is a CPU one; a GPU profile leaves every term here at zero or unused):

* **ranks share cores** (:func:`ranks_per_core`): a rank is a process with one thread
  (``OMP_NUM_THREADS=1``); with more ranks than cores, each computes only part of the time,
  so its compute and its launches stretch by ``ranks / cores``;
* **ranks beside each other** (:func:`corun`): even with a core each, ranks that run at
  once share the caches, the memory bus and the cores' time with their own helper threads
  (gloo's, the launcher's): ``edu3d calibrate`` times the same serial Trainer steps on every
  rank of a launch at once, on the wall clock, against the same steps alone in its CPU time,
  and every host and compute term of a multi-rank step stretches by that ratio;
* **the step's loops over tensors** (:func:`step_overhead`): on a GPU, AdamW is one fused
  kernel and the norm and clip are a handful; on a CPU, ``foreach`` AdamW still runs each of
  its dozen operations tensor by tensor, and the global norm, the clip and ``zero_grad``
  walk every parameter tensor in Python. So a step costs ``step_overhead`` seconds per
  parameter tensor the rank holds (:func:`tensors_held`), beyond the optimizer's bytes:
  ~1-2 ms of a tiny model's ~10 ms step;
* **data parallelism's hooks** (:func:`microbatch_overhead`): every backward of a
  data-parallel rank runs a Python hook per parameter tensor (ZeRO's and DDP's buckets):
  ``hook_overhead`` seconds per tensor per micro-batch, measured on 2 data-parallel ranks
  against the serial Trainer (+35 % of a width-8 micro-batch here);
* **data parallelism's step** (:func:`sync_overhead`): beyond its hooks, a data-parallel
  step costs more than the serial one once per step, however many micro-batches it runs
  (the last micro-batch's buckets flattened and reduced, the main thread's share of the
  collective calls, the wait for the peer): ``sync_overhead`` seconds per parameter tensor,
  the intercept of the same data-parallel steps beyond the serial steps' intercept
  (~0.9 ms a step of a 53-tensor model here);
* **the host around each collective** (``collective_overhead``, charged once per call by
  :func:`edu3d.plan.links.collective_time`): edu3d wraps every collective in Python (the
  autograd function of a tensor-parallel f/g, the flattening copies, the trace's event) and
  the rank wakes up cold after waiting in it; measured on tensor-parallel Trainer steps
  (:mod:`edu3d.bench.profile_fit`): ~0.14-0.3 ms a call here, which at tp=2 with SP (48
  collectives a micro-batch of the tiny model) is as much as its arithmetic;
* **recomputation's checkpoints** (:func:`checkpoint_overhead`): ``torch.utils.checkpoint``
  keeps each region's inputs and RNG state, swaps every saved tensor for a placeholder
  through Python hooks and re-runs the forward from Python: ~0.3-0.4 ms a block and
  micro-batch here, several times the kernels a tiny model's attention core recomputes;
  measured on the same Trainer steps with every block checkpointed;
* **gloo's collectives** (:func:`collective`): each kind is timed by itself, because gloo's
  differ more than a ring's counts say: its reduce-scatter runs as a full all-reduce (and a
  copy), its all-gather and send/recv have latencies of their own. ``edu3d calibrate``
  measures each over loopback and writes its ``alpha`` (per ring step) and bus bandwidth, in
  the same ``alpha·steps + S·factor / bandwidth`` form as every other link
  (:mod:`edu3d.plan.links`).

The launch overhead per kernel (``kernel_overhead``, which the CPU pays in series with the
arithmetic, :mod:`edu3d.plan.roofline`) is already in every profile; on a CPU it is fitted to
a real Trainer step, so it carries Python and autograd too (:mod:`edu3d.bench.profile_fit`).
No torch here.
"""

from __future__ import annotations

from edu3d.config.sections import Run
from edu3d.model.shapes import ModelSpec
from edu3d.plan.hardware import Profile
from edu3d.plan.inventory import units

KINDS = {"all_reduce": "all_reduce", "all_gather": "all_gather",
         "reduce_scatter": "reduce_scatter", "send": "send_recv"}  # links' kind -> measured


def corun(profile: Profile, ranks: int) -> float:
    """How much slower a rank's work runs while other ranks run beside it (1 for one rank,
    on a GPU, or on a profile without ``corun``)."""
    return profile.corun if profile.cores and profile.corun and ranks > 1 else 1.0


def ranks_per_core(profile: Profile, ranks: int) -> float:
    """How much a rank's host work stretches: how many ranks take turns on each core, times
    :func:`corun` (1 when a rank runs alone on its core, or on a GPU)."""
    return max(1.0, ranks / profile.cores) * corun(profile, ranks) if profile.cores else 1.0


def tensors_held(spec: ModelSpec, run: Run, pp_rank: int) -> int:
    """Trainable parameter tensors pipeline rank ``pp_rank`` holds (its experts included)."""
    return sum(len(tensors) for experts in (False, True)
               for _, tensors in units(spec, run, pp_rank, experts))


def step_overhead(spec: ModelSpec, run: Run, profile: Profile, pp_rank: int) -> float:
    """Seconds a step spends in the host's loops over the rank's parameter tensors (zero on
    a GPU profile, which has no ``step_overhead``)."""
    if not profile.step_overhead:
        return 0.0
    return (profile.step_overhead * tensors_held(spec, run, pp_rank)
            * ranks_per_core(profile, run.world_size))


def microbatch_overhead(spec: ModelSpec, run: Run, profile: Profile, pp_rank: int) -> float:
    """Seconds each micro-batch's backward spends in data parallelism's gradient hooks
    (zero without data parallelism, or on a profile without ``hook_overhead``)."""
    if not profile.hook_overhead or run.layout.dp * run.layout.cp == 1:
        return 0.0
    return (profile.hook_overhead * tensors_held(spec, run, pp_rank)
            * ranks_per_core(profile, run.world_size))


def sync_overhead(spec: ModelSpec, run: Run, profile: Profile, pp_rank: int) -> float:
    """Seconds a data-parallel step costs once per step beyond the serial step and its hooks
    (zero without data parallelism, or on a profile without ``sync_overhead``)."""
    if not profile.sync_overhead or run.layout.dp * run.layout.cp == 1:
        return 0.0
    return (profile.sync_overhead * tensors_held(spec, run, pp_rank)
            * ranks_per_core(profile, run.world_size))


def checkpoint_overhead(profile: Profile, recompute: str, ranks: int) -> float:
    """Host seconds a checkpointed block costs each micro-batch beyond the kernels it
    recomputes (zero without recomputation, or on a profile without ``checkpoint_overhead``)."""
    if recompute == "none" or not profile.checkpoint_overhead:
        return 0.0
    return profile.checkpoint_overhead * ranks_per_core(profile, ranks)


def collective(kind: str, profile: Profile) -> tuple[float, float] | None:
    """``(alpha, bus bandwidth)`` measured for ``kind`` (a :data:`edu3d.plan.links.KINDS`
    name), or None where the profile has none for it (every GPU profile)."""
    return profile.collectives.get(KINDS.get(kind, kind))
