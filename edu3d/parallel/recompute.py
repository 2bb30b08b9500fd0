"""Activation recomputation: keep less for backward, compute it again when backward needs it.

After reading this file you should understand:

* what the forward pass *keeps*: every operation saves some tensors for its backward (a
  linear layer its input, GELU its input, attention q, k, v, ...). Per layer that is
  ``sbh(34 + 5as/h)`` bytes in 16-bit (Korthikanti et al. 2022), and it is held from the
  micro-batch's forward until its backward, for every layer at once;
* **full** recomputation (``--recompute full``) keeps only each block's *input*: the block's
  forward runs without saving anything, and backward runs it a second time, saving as usual,
  just before it needs those tensors. Memory per layer drops to the input (``2sbh`` in
  16-bit, ``/t`` under sequence parallelism); the price is one more forward of every block,
  up to a third more compute (a backward costs about two forwards);
* **selective** recomputation (``--recompute selective``) recomputes only the *attention
  core* (``softmax(QK^T)V``, :meth:`edu3d.model.gpt.CausalSelfAttention.core`), the part whose
  saved tensors grow with ``s^2`` (the ``5as/h`` term: scores, softmax, its dropout) while
  it costs few FLOPs. With a fused attention kernel, as here, the ``s x s`` matrices are
  never stored, so selective recomputation saves only the kernel's per-token log-sum-exp:
  FlashAttention already *is* selective recomputation (see :mod:`edu3d.course.ch07_memory`);
* how ``torch.utils.checkpoint`` (non-reentrant) does it: inside the region a
  ``saved_tensors_hooks`` pair replaces every saved tensor by a placeholder; the region's
  inputs are saved by one no-op autograd node *outside* it, so whatever counts saved tensors
  (:class:`~edu3d.parallel.pp.engine.PipelineEngine`'s activation meter,
  :func:`edu3d.distributed.meter.measure_activations`) sees exactly what is kept: the inputs. The first
  placeholder unpacked in backward re-runs the region (and stops as soon as every saved
  tensor is back);
* how it composes: it is applied **after tensor parallelism** (it wraps the parallel block,
  so a recomputed block **repeats its TP forward communication**: the all-reduces, or SP's
  all-gathers, up to the last saved tensor; Megatron does the same) and **before the
  pipeline cut** (a stage holds the wrapped blocks). The recomputation runs under the
  autocast state of the original forward (torch restores it), so bf16 stays bf16. ZeRO-3's
  hooks sit on the block: its gradient hook gathers the parameters *before* the block's
  backward starts, so the recomputed forward finds them gathered. Zero-bubble's split
  backward runs several autograd passes over a block: ``I`` recomputes it once, and ``W``
  (torch's ``stage_backward_weight``, one pass per group of weights) once per group: six
  more forwards of a full-recomputed block here (a pp2 step of the small model took 2.9x
  ZB-H1's time without recomputation, where 1F1B took 1.3x its own). The gradients are
  still exact; only the time grows. Selective recomputation costs ``W`` nothing (no
  weight's gradient passes through the attention core).

Recomputation changes memory and time, never the numbers: the recomputed forward is the same
deterministic arithmetic, so losses and gradients equal the run without it, bitwise on a CPU
(``tests/test_recompute.py``). What it costs: ``edu3d bench recompute``; what a layer keeps
in each mode: :func:`edu3d.plan.formulas.layer_activation_bytes`.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")


def _run_checkpointed(fn: Callable, *args, **kwargs):
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def checkpointed(fn: Callable) -> Callable:
    """``fn`` run under non-reentrant activation checkpointing when autograd records (a
    ``no_grad`` call, e.g. generation, just runs ``fn``).

    A ``functools.partial`` rather than a closure: ``copy.deepcopy`` of a model copies the
    partial's bound method with the module, so a copied block recomputes *its own* forward,
    not the original's."""
    run = functools.partial(_run_checkpointed, fn)
    run.recomputed = fn  # what it wraps (for inspection, and to refuse wrapping twice)
    return run


def _blocks(model: nn.Module) -> list[nn.Module]:
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(f"{type(model).__name__} has no .blocks: recomputation wraps the "
                        "transformer blocks of edu3d's GPT (apply it before the pipeline cut)")
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def apply_recompute(model: nn.Module, mode: str = "none") -> nn.Module:
    """Make ``model``'s blocks recompute in backward, in place; returns ``model``.

    ``"full"``: each block's ``forward`` is checkpointed (its input kept, everything inside
    recomputed). ``"selective"``: each block's attention ``core`` is checkpointed (q, k, v
    kept, the attention core recomputed). ``"none"`` changes nothing. The parameters, their
    names and the block modules (with any hooks on them) stay the same objects; only the
    instance's ``forward`` / ``core`` attribute is replaced.
    """
    if mode not in MODES:
        raise ValueError(f"recompute={mode!r} is not one of {', '.join(MODES)}")
    if mode == "none":
        return model
    if recompute_mode(model) != "none":
        raise ValueError(f"{type(model).__name__} already recomputes ({recompute_mode(model)}); "
                         "build a fresh model")
    for block in _blocks(model):
        target, name = (block, "forward") if mode == "full" else (block.attn, "core")
        setattr(target, name, checkpointed(getattr(target, name)))
    return model


def recompute_mode(model: nn.Module) -> str:
    """``"full"``, ``"selective"`` or ``"none"``: what :func:`apply_recompute` did to
    ``model`` (read from its first block)."""
    blocks = _blocks(model)
    if not blocks:
        return "none"
    if hasattr(blocks[0].forward, "recomputed"):
        return "full"
    if hasattr(blocks[0].attn.core, "recomputed"):
        return "selective"
    return "none"
