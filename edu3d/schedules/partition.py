"""Cutting the model into pipeline stages.

After reading this file you should understand:

* a pipeline is only as fast as its slowest stage, so the cut matters: every rank waits for
  the most expensive stage at every step;
* **uniform**: ``L`` layers over ``S`` stages, ``L // S`` each, the remainder going to the
  first stages (10 layers on 4 stages: 3, 3, 2, 2); the planner also weighs **ends**, where
  the embedding and the head each count as a layer (Llama 3's and DeepSpeed's cut);
* **balanced**: the first stage also runs the embedding and the last the final LayerNorm and
  the LM head, whose ``d x vocab`` matrix can cost as much as several layers. Given a cost per
  piece, the contiguous cut that minimises the most expensive stage is found by a small
  dynamic programme; the costs can be an estimate (:func:`layer_costs`, FLOPs) or per-layer
  times measured in a run (*rebalancing*);
* with interleaving (``vpp`` chunks per rank) the model is cut into ``pp * vpp`` stages and
  global stage ``s`` goes to rank ``s % pp`` as its chunk ``s // pp``; ZBV and DualPipeV cut
  ``2 * pp`` stages and place them as a V (rank ``r`` holds ``r`` and ``2p-1-r``:
  :func:`~edu3d.schedules.actions.stage_rank`). The cut itself does not depend on where the
  stages go.

A partition is a list of ``(first_layer, end_layer)`` ranges, one per global stage; the first
stage also holds the embedding and the last the head.
"""

from __future__ import annotations

from functools import lru_cache

from edu3d.schedules.actions import chunks

PLANNER_PARTITIONS = ("uniform", "balanced", "ends")  # partition() runs the first two


def uniform(n_layers: int, n_stages: int, ends: bool = False) -> list[tuple[int, int]]:
    """``n_layers // n_stages`` layers per stage, one more for the first ``n_layers % n_stages``.

    ``ends``: the embedding and the head each take a layer's place in the cut, so the first
    and last stages hold one layer fewer (Llama 3's pipeline, whose first chunk holds only the
    embedding and last only the head and loss; DeepSpeed's ``type:transformer|embedding``).
    A stage may then hold no layer at all. The planner weighs this cut; the trainer runs
    ``uniform`` and ``balanced`` (:func:`partition`)."""
    units = n_layers + (2 if ends else 0)
    if not 1 <= n_stages <= units:
        raise ValueError(f"{n_stages} stages for {n_layers} layers: each stage needs at least "
                         f"one {'layer, the embedding or the head' if ends else 'layer'}, so "
                         f"use between 1 and {units} stages (pp * vpp)")
    q, rem = divmod(units, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        end = start + q + (1 if s < rem else 0)
        out.append((start, end))
        start = end
    if ends:  # unit 0 is the embedding, unit n_layers + 1 the head
        out = [(max(a - 1, 0), min(b - 1, n_layers)) for a, b in out]
    return out


def planner_cut(n_layers: int, layout, parallel) -> list[tuple[int, int]]:
    """The cut the planner weighs for a run's ``layout`` and ``parallel`` sections: ``pp x
    chunks`` stages, :func:`uniform` (``ends`` where the run's partition says so; it weighs
    ``balanced`` as ``uniform``). Raises ``ValueError`` for an unknown partition or more
    stages than the cut has pieces."""
    if parallel.partition not in PLANNER_PARTITIONS:
        raise ValueError(f"partition={parallel.partition!r}: choose one of "
                         f"{', '.join(PLANNER_PARTITIONS)}")
    return uniform(n_layers, layout.pp * chunks(parallel.schedule, layout.vpp),
                   ends=parallel.partition == "ends")


def layer_costs(config) -> tuple[float, list[float], float]:
    """Estimated training FLOPs per token of ``(embedding, each block, head)``.

    A block costs 6 FLOPs per weight (``config.block_params``, about ``12d²``) plus
    attention's ``12·d·s`` (``QKᵀ`` and ``AV``, see :func:`edu3d.model.gpt.flops_per_token`);
    the head ``6·d·V``; the embedding is a lookup, counted as one pass over its output
    (``6d``) so it is not free.
    """
    d, s, v = config.d_model, config.seq_len, config.vocab_size
    block = 6 * config.block_params + 12 * d * s
    return float(6 * d), [float(block)] * config.n_layers, float(6 * d * v + 6 * 2 * d)


def balanced(costs: list[float], n_stages: int, first_extra: float = 0.0,
             last_extra: float = 0.0) -> list[tuple[int, int]]:
    """The contiguous cut of layers with the smallest maximum stage cost.

    ``costs[i]`` is layer ``i``'s cost; ``first_extra`` and ``last_extra`` are the embedding's
    and head's, charged to the first and last stage. Among cuts with the same bottleneck the
    evenest wins (then the one with more layers in earlier stages, as :func:`uniform`).
    """
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"{n_stages} stages for {n} layers: use between 1 and {n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s, a, b):
        return (prefix[b] - prefix[a] + (first_extra if s == 0 else 0.0)
                + (last_extra if s == n_stages - 1 else 0.0))

    @lru_cache(maxsize=None)
    def best(s: int, a: int) -> tuple[float, float, tuple[int, ...]]:
        """Stages s.. covering layers a..n: (bottleneck, sum of squared stage costs, ends).

        The bottleneck decides; among equal bottlenecks the evener cut (smaller sum of
        squares) wins, then the one with more layers in earlier stages."""
        if s == n_stages - 1:
            c = cost(s, a, n)
            return c, c * c, (n,)
        options = []
        for b in range(n - (n_stages - s - 1), a, -1):
            worst, sq, ends = best(s + 1, b)
            c = cost(s, a, b)
            options.append((max(c, worst), sq + c * c, (b, *ends)))
        return min(options, key=lambda o: (o[0], o[1]))

    ends = best(0, 0)[2]
    return list(zip((0, *ends[:-1]), ends))


def stage_costs(parts: list[tuple[int, int]], costs: list[float], first_extra: float = 0.0,
                last_extra: float = 0.0) -> list[float]:
    """Each stage's total cost under a partition (to see how even a cut is)."""
    out = [sum(costs[a:b]) for a, b in parts]
    out[0] += first_extra
    out[-1] += last_extra
    return out


def partition(config, pp: int, vpp: int = 1, method: str = "uniform",
              measured: list[float] | None = None) -> list[tuple[int, int]]:
    """Layer ranges for the ``pp * vpp`` global stages of ``config``.

    ``method`` is ``"uniform"`` or ``"balanced"`` (by :func:`layer_costs`); ``measured``
    (seconds per layer, embedding and head folded into the first and last) rebalances from a
    run instead.
    """
    n_stages = pp * vpp
    if method == "uniform" and measured is None:
        return uniform(config.n_layers, n_stages)
    if method not in ("uniform", "balanced"):
        raise ValueError(f"unknown partition method {method!r}; use 'uniform' or 'balanced'")
    if measured is not None:
        if len(measured) != config.n_layers:
            raise ValueError(f"{len(measured)} measured layer times for "
                             f"{config.n_layers} layers; give one time per layer")
        return balanced(list(measured), n_stages)
    emb, blocks, head = layer_costs(config)
    return balanced(blocks, n_stages, emb, head)
