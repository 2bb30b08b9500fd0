"""ZeRO-2/3 under gradient accumulation: reduce every micro-batch, or once per step?

After reading this file you should be able to say, for DDP and each ZeRO stage, what a rank
holds and what it sends per optimizer step when the step has ``m`` micro-batches, in both of
the modes ``--grad-reduce`` chooses between:

* ``per-microbatch`` (the default, as DeepSpeed ZeRO-2/3 and FSDP2 do): every micro-batch's
  backward reduce-scatters each unit's gradients as soon as they are complete and keeps
  only this rank's ``1/N`` shard, which the next micro-batch adds to; ZeRO-3 gathers a
  unit's weights before its forward, frees them after, gathers them again for its backward
  and frees them after the reduce-scatter. Memory stays the ZeRO paper's at any ``m``;
  traffic grows with ``m``;
* ``per-step`` (Megatron's distributed optimizer, FSDP2 under
  ``set_requires_gradient_sync(False)``): the micro-batches accumulate full gradients
  locally (``no_sync``) and the last one reduce-scatters once; ZeRO-3 keeps its gathered
  weights for the step. Traffic is the single-micro-batch step's; memory is ZeRO-1's for the
  gradients (plus the shard the reduce-scatter lands in), and ZeRO-3 holds the full weights
  too. With one micro-batch the two modes are the same step.

**Bytes on the wire per step and rank** (ring collectives, DESIGN.md: all-reduce sends
``2(N-1)/N·S``, reduce-scatter and all-gather ``(N-1)/N·S``; ``Ψ`` this rank's parameters,
``N`` ranks sharing them, ``p_b`` and ``g_b`` bytes per weight and gradient):

=========================  ===========================================  ==================
layout                     collectives per step                         bytes sent
=========================  ===========================================  ==================
DDP                        one all-reduce (``no_sync`` accumulates)     ``2(N-1)/N·g_bΨ``
ZeRO-1, ZeRO-2 per-step    one reduce-scatter of the gradients, one     ``(N-1)/N·(g_b +
                           all-gather of the updated weights            p_b)Ψ``
ZeRO-2 per-microbatch      ``m`` reduce-scatters, one all-gather        ``(N-1)/N·(m·g_b +
                                                                        p_b)Ψ``
ZeRO-3 per-step            all-gather for the forwards, again for the   ``(N-1)/N·(2p_b +
                           last backward, one reduce-scatter            g_b)Ψ``
ZeRO-3 per-microbatch      ``m`` x (2 all-gathers + 1 reduce-scatter)   ``m(N-1)/N·(2p_b +
                                                                        g_b)Ψ``
=========================  ===========================================  ==================

With 16-bit weights and gradients and ``m = 1`` these are the paper's ``2Ψ`` values
(DDP, ZeRO-1, ZeRO-2) and ``3Ψ`` (ZeRO-3) times 2 bytes. Under FP8 (tensorwise) ZeRO-3
gathers the blocks' linear weights in 1 byte (:func:`gather_bytes`): half of bf16's.

**HSDP** (``--hsdp R``, :mod:`edu3d.parallel.zero.hybrid`) splits these bytes over two
groups (:func:`hsdp_wire_bytes`): inside a replica group of ``S = N/R`` ranks, the table's
row with ``S`` for ``N`` (every reduce-scatter and all-gather); across the groups, one
all-reduce of this rank's gradient shard per step, ``2(R-1)/R·g_bΨ/S``, in either mode (the
shard adds up the micro-batches first). Memory is the table's with ``S`` for ``N``.

**Memory** (the planner's ``estimate`` at the peak, :mod:`edu3d.plan.estimate`): the state
columns hold the sharded state (:func:`edu3d.plan.formulas.zero_bytes`) plus what a mode
keeps for the whole step (:func:`step_extra`: per-step ZeRO-2/3 the full gradients ``g_bΨ``,
ZeRO-3 also the gathered weights ``p_bΨ``); what lives only while one unit is reduced or
computed is a communication buffer bounded by the biggest unit ``U``
(:func:`in_flight_bytes`): the flat copy a reduce-scatter sends, and per-microbatch the
unit's own gradients before they are freed (ZeRO-3: the unit's gathered weights and the
next one, prefetched). So the per-microbatch state is the paper's ``2Ψ + (2+K)Ψ/N`` and
``(4+K)Ψ/N`` at any ``m``, and per-step ZeRO-2's is ``4Ψ + (2+K)Ψ/N``, ZeRO-1's ``4Ψ + KΨ/N``
plus the ``2Ψ/N`` shard. No torch here.
"""

from __future__ import annotations

from edu3d.config.sections import Run
from edu3d.model.shapes import ModelSpec
from edu3d.plan.formulas import zero_bytes
from edu3d.plan.inventory import held

GRAD_REDUCE = ("per-microbatch", "per-step")
DEFAULT = "per-microbatch"  # DeepSpeed ZeRO-2/3 and FSDP2's default
#: which mode each library takes (chapter 03 prints these beside its chart)
LIBRARIES = {
    "DeepSpeed": "ZeRO-2/3 reduce-scatter every micro-batch (per-microbatch) and keep only "
                 "the 1/N gradient shard; its engine.no_sync() refuses to run under ZeRO-2/3.",
    "FSDP2": "reduce-scatters every micro-batch (per-microbatch) unless "
             "set_requires_gradient_sync(False), whose docstring warns that it keeps full "
             "unsharded gradients (per-step); set_reshard_after_backward(False) keeps the "
             "gathered weights too.",
    "Megatron": "the distributed optimizer accumulates into a full-size gradient buffer and "
                "reduce-scatters once per step (per-step): 6 + 12/d bytes per parameter, "
                "gradients not sharded.",
}


def check(grad_reduce: str) -> None:
    if grad_reduce not in GRAD_REDUCE:
        raise ValueError(f"grad_reduce={grad_reduce!r}: choose one of {', '.join(GRAD_REDUCE)}")


def holds_step(zero: int, grad_reduce: str, m: int) -> bool:
    """Whether ZeRO-2/3 keep full gradients (ZeRO-3: gathered weights) for the whole step:
    per-step with more than one micro-batch."""
    check(grad_reduce)
    return zero >= 2 and grad_reduce == "per-step" and m > 1


def dp_wire_bytes(psi: float, n: int, zero: int, grad_reduce: str = DEFAULT, m: int = 1,
                  param_bytes: int = 2, grad_bytes: int = 2) -> float:
    """Bytes one rank sends per step over its ``n`` data-parallel ranks (the table above)."""
    check(grad_reduce)
    if n <= 1:
        return 0.0
    ring = (n - 1) / n * psi
    each = m if grad_reduce == "per-microbatch" else 1
    if zero == 0:
        return 2 * ring * grad_bytes
    if zero == 1:
        return ring * (grad_bytes + param_bytes)
    if zero == 2:
        return ring * (each * grad_bytes + param_bytes)
    return each * ring * (2 * param_bytes + grad_bytes)


def hsdp_wire_bytes(psi: float, n: int, replicas: int, zero: int, grad_reduce: str = DEFAULT,
                    m: int = 1, param_bytes: int = 2, grad_bytes: int = 2) -> dict[str, float]:
    """Bytes one rank sends per step under HSDP, by group: ``"shard"`` (ZeRO over the ``n``
    ranks of its replica group, :func:`dp_wire_bytes`) and ``"replicate"`` (the all-reduce
    of its ``psi/n`` gradient shard across the ``replicas`` groups). ``psi``: this rank's
    parameters (edu3d's padded flat units, a multiple of ``n``)."""
    across = 2 * (replicas - 1) / replicas * grad_bytes * psi / n if zero else 0.0
    return {"shard": dp_wire_bytes(psi, n, zero, grad_reduce, m, param_bytes, grad_bytes),
            "replicate": across}


def hsdp_traffic(spec: ModelSpec, run: Run, value_bytes: int = 2) -> dict[str, float]:
    """Bytes one rank sends per step under HSDP, by group, in ``value_bytes`` values (16-bit,
    as :func:`edu3d.plan.search.traffic` counts): ``shard`` and ``replicate`` for the dense
    units, ``eshard`` and ``ereplicate`` for the experts (:func:`hsdp_wire_bytes` of the
    fullest pipeline rank's, over the replica groups of
    :meth:`~edu3d.config.layout.Layout.hsdp_sizes`)."""
    par, out = run.parallel, {}
    sizes = run.layout.hsdp_sizes(par.hsdp)
    for n, prefix, experts in zip(sizes, ("", "e"), (False, True)):
        psi = max(held(spec, run, r, experts) for r in range(run.layout.pp))
        got = hsdp_wire_bytes(psi, n, par.hsdp, par.zero, par.grad_reduce, run.microbatches,
                              value_bytes, value_bytes)
        out.update({prefix + k: v for k, v in got.items()} if psi else {})
    return out


def step_extra(psi: float, zero: int, grad_reduce: str, m: int, param_bytes: int = 2,
               grad_bytes: int = 2) -> dict[str, float]:
    """What a mode keeps for the whole step beyond the sharded state: per-step ZeRO-2/3 the
    full gradients (ZeRO-3 also the gathered weights); nothing otherwise."""
    held = holds_step(zero, grad_reduce, m)
    return {"params": param_bytes * psi * (held and zero == 3), "grads": grad_bytes * psi * held}


def state_bytes_per_rank(psi: float, n: int, zero: int, grad_reduce: str = DEFAULT, m: int = 1,
                         param_bytes: int = 2, grad_bytes: int = 2,
                         optimizer_bytes: int = 12) -> dict[str, float]:
    """Weights, gradients and optimizer state per rank during a step of ``m`` micro-batches:
    the paper's :func:`~edu3d.plan.formulas.zero_bytes` plus :func:`step_extra`."""
    out = zero_bytes(psi, n, zero, param_bytes, grad_bytes, optimizer_bytes)
    extra = step_extra(psi, zero, grad_reduce, m, param_bytes, grad_bytes)
    out = {c: out[c] + extra.get(c, 0.0) for c in ("params", "grads", "optimizer")}
    out["total"] = sum(out.values())
    return out


def in_flight_bytes(unit: float, zero: int, grad_reduce: str, m: int, param_bytes: int = 2,
                    grad_bytes: int = 2) -> float:
    """Communication buffers of the biggest unit (``unit`` elements) in flight: the flat
    copy its reduce-scatter sends; unless the step holds them, its gradients before they
    are freed, and ZeRO-3's gathered weights of it and of the next unit (prefetched)."""
    if zero < 2:
        return 0.0
    out = grad_bytes * unit
    if not holds_step(zero, grad_reduce, m):
        out += grad_bytes * unit + (2 * param_bytes * unit if zero == 3 else 0)
    return out


def gather_bytes(units: list, n: int, param_bytes: int, fp8: bool = False) -> int:
    """Bytes one all-gather of every ZeRO-3 unit fills (each unit's full flat buffer, padded
    to a multiple of ``n``: what the trace records per gather; a rank sends ``(n-1)/n`` of
    it). ``units``: ``[(name, [(elements, cast to FP8)])]``. With ``fp8`` (``--precision
    fp8`` tensorwise, :mod:`edu3d.parallel.fp8.fp8_gather`) a unit's FP8 weights are a unit
    of their own, 1 byte per element, beside the rest at ``param_bytes``: the weights' share
    of the ``2p_b`` of the table above becomes ``2·1``."""
    total = 0
    for _, tensors in units:
        low = sum(k for k, cast in tensors if cast) if fp8 else 0
        rest = sum(k for k, _ in tensors) - low
        total += param_bytes * -(-rest // n) * n + -(-low // n) * n
    return total
