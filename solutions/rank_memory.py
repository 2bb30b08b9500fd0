"""Exercise 07: the bytes one rank holds, from the layout alone (reference solution).

A rank of a ``dp x tp x pp`` layout of edu3d's GPT, trained in fp32 with AdamW, holds:

* **the parameters of its pipeline stage.** ``L`` layers are cut uniformly: ``L // pp`` per
  stage, the first ``L % pp`` stages one more. The first stage also holds the embeddings
  (token ``V x h``, position ``s x h``), the last the final LayerNorm (``2h``) and the LM
  head (``V x h``). A tied head *is* the token embedding: one matrix when one stage holds
  both ends (``pp = 1``), a copy on the last stage otherwise.
  Tensor parallelism splits a layer's matrices (qkv ``3h x h``, attention projection
  ``h x h``, MLP ``4h x h`` and ``h x 4h``) and the column layers' biases (qkv ``3h``, MLP
  ``4h``) ``t`` ways; the two LayerNorms (``2h`` each) and the row layers' biases (``h``
  each) stay whole on every tp rank. The vocabulary is split in ``ceil(V / t)`` rows (padded),
  the position table stays whole;
* **its state**: 4 bytes per weight, 4 per gradient, 8 of Adam moments per weight. ZeRO-1
  divides the optimizer state by ``dp``, ZeRO-2 also the gradients, ZeRO-3 also the weights
  (the ZeRO paper's ``16Ψ``, ``8Ψ + 8Ψ/N``, ``4Ψ + 12Ψ/N``, ``16Ψ/N`` in fp32);
* **its activations**: a micro-batch's saved tensors live from its forward to its
  backward, so a rank holds the micro-batches in flight: GPipe runs every forward first
  (all ``m``), 1F1B starts backwards as soon as the last stage can (pipeline rank ``r``
  holds at most ``pp - r``, and never more than ``m``).
"""

import math


def rank_params(n_layers: int, d_model: int, vocab: int, seq: int, tp: int, pp: int,
                pp_rank: int, tied: bool = False) -> int:
    """Parameters (elements) held by one tp rank of pipeline rank ``pp_rank``."""
    h, t = d_model, tp
    q, rem = divmod(n_layers, pp)
    layers = q + (1 if pp_rank < rem else 0)
    split = (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) // t
    whole = 2 * h + 2 * h + h + h  # two LayerNorms, two row biases
    out = layers * (split + whole)
    table = math.ceil(vocab / t) * h
    if pp_rank == 0:
        out += table + seq * h
    if pp_rank == pp - 1:
        out += 2 * h + (0 if tied and pp == 1 else table)
    return out


def state_bytes(n_params: int, dp: int, zero: int) -> dict:
    """Bytes of ``{"params", "grads", "optimizer"}`` on one rank holding ``n_params``
    (fp32 AdamW), ZeRO stage ``zero`` over ``dp`` ranks."""
    return {"params": 4 * n_params / (dp if zero >= 3 else 1),
            "grads": 4 * n_params / (dp if zero >= 2 else 1),
            "optimizer": 8 * n_params / (dp if zero >= 1 else 1)}


def in_flight(schedule: str, pp: int, m: int, pp_rank: int) -> int:
    """The most micro-batches pipeline rank ``pp_rank`` keeps activations for at once
    (``schedule`` is ``"gpipe"`` or ``"1f1b"``; ``pp = 1`` is gradient accumulation)."""
    if schedule == "gpipe":
        return m
    return min(m, pp - pp_rank)


# ---- design: ZeRO stage, micro-batch and recompute under a memory cap ----------------------------
def memory_plan(job: str) -> dict:
    """a: ZeRO-1 leaves 13.5 GB of state, room for micro-batches of 8 (37.5 GB) and one
    all-reduce a step; ZeRO-0 (24 GB) only fits 4, with twice the per-micro-batch overhead.
    b (16 GB): ZeRO-0 and 1 leave no room without recompute; ZeRO-2's 8.25 GB fits
    micro-batches of 2: 16 reduce-scatters (0.89 s) still cost less than recompute's third
    more compute (1.07 s), and ZeRO-3 pays three collectives per micro-batch."""
    return {"a": {"zero": 1, "micro_batch": 8, "recompute": False},
            "b": {"zero": 2, "micro_batch": 2, "recompute": False}}[job]


# The deeper hints of exercises/rank_memory.py (edu3d.course.grading.tiers): per function,
# a nudge (a check's second failure), then the answer's shape (its third).
HINTS = {'rank_params': ('per layer, tensor parallelism splits the four matrices and the two column '
                 'biases (qkv, MLP up); the two LayerNorms and two row biases stay whole; the '
                 'vocabulary is padded up to a multiple of tp before it is split',
                 'layers = n_layers // pp (+1 on the first n_layers % pp ranks); per layer '
                 '(3h*h + 3h + h*h + 4h*h + 4h + 4h*h) / tp + 6h; first stage + '
                 'ceil(vocab/tp)*h + seq*h; last stage + 2h + ceil(vocab/tp)*h (no head when '
                 'tied and pp == 1); -(-vocab // tp) rounds up'),
 'state_bytes': ('4 bytes per weight, 4 per gradient, 8 of Adam moments; ZeRO-1 shards the '
                 'optimizer, ZeRO-2 also the gradients, ZeRO-3 also the weights',
                 'params 4n / (dp if zero >= 3 else 1); grads 4n / (dp if zero >= 2 else 1); '
                 'optimizer 8n / (dp if zero >= 1 else 1)'),
 'in_flight': ('GPipe runs every forward before any backward; under 1F1B rank r starts its '
               'backwards after pp - r forwards',
               'gpipe: m; 1f1b: min(m, pp - pp_rank)'),
 'memory_plan': ('ZeRO-2 and ZeRO-3 pay a collective per micro-batch, recompute a third more '
                 'compute; a bigger micro-batch means fewer micro-batches but more activations',
                 'for each ZeRO stage, find the largest micro-batch that fits with and '
                 'without recompute, and compare the steps with '
                 'ch07_memory_grade.describe(job, plan)')}
