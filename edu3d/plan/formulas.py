"""Memory per rank, predicted: every closed-form memory formula of the course.

After reading this file you should understand the four categories every chart uses:

``params``     the weights (full, or this rank's shard under ZeRO-3);
``grads``      the gradients (full, or a shard under ZeRO-2 and 3);
``optimizer``  the optimizer's state: Adam keeps two moments per parameter (8 bytes in fp32),
               plus an fp32 master copy of the weights in mixed precision (K = 12);
``activations`` what the forward pass saves for backward.

The **state** formula is the ZeRO paper's (Rajbhandari et al. 2019) with Ψ parameters, N
data-parallel ranks and the bytes per element as parameters; with 2-byte weights and
gradients and K = 12 it is DESIGN.md's ``16Ψ``, ``4Ψ + KΨ/N``, ``2Ψ + (2+K)Ψ/N`` and
``(4+K)Ψ/N``. What a rank really holds is measured by :mod:`edu3d.distributed.meter`; any
difference between the two comes from padding: each flat buffer is rounded up to a multiple
of N.

Activations have three counts. :func:`activation_bytes_per_layer` is Korthikanti et al.'s
(2022) count for a 16-bit GPT layer with dropout, generalized to a SwiGLU MLP and grouped
KV heads (their defaults give the paper's ``sbh(34 + 5as/h)`` exactly); the planner uses it
for real models. :func:`layer_activation_bytes` is the same term list for *this course's*
layer in fp32 (no dropout, fused attention): it equals what autograd saves, byte for byte,
so the planner can be checked against edu3d's own runs. :func:`autocast_activation_bytes_per_layer`
is that layer under ``torch.autocast``. No torch here: ``edu3d plan`` runs without it.
"""

from __future__ import annotations

RECOMPUTE_MODES = ("none", "selective", "full")


def zero_bytes(psi: int, n: int, stage: int, param_bytes: int = 4, grad_bytes: int = 4,
               optimizer_bytes: int = 8) -> dict[str, float]:
    """Predicted bytes per rank for ZeRO ``stage`` (0 = plain data parallelism).

    fp32 Adam: ``param_bytes=4, grad_bytes=4, optimizer_bytes=8``; mixed-precision Adam:
    ``2, 2, 12`` (the paper's K = 12: fp32 master weights, momentum and variance).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} must be 0, 1, 2 or 3")
    if n < 1:
        raise ValueError(f"data-parallel degree {n} must be at least 1")
    out = {"params": param_bytes * psi / (n if stage >= 3 else 1),
           "grads": grad_bytes * psi / (n if stage >= 2 else 1),
           "optimizer": optimizer_bytes * psi / (n if stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                               recompute: str | None = None, d_ff: int | None = None,
                               kv_heads: int | None = None, mlp: str = "gelu") -> float:
    """Activation bytes of one transformer layer in 16-bit (Korthikanti et al. 2022).

    ``sbh(34 + 5as/h)``; with TP ``sbh(10 + 24/t + 5as/(ht))``; with TP+SP
    ``sbh/t (34 + 5as/h)``; ``recompute="selective"`` drops the ``5as/h`` term,
    ``"full"`` keeps only the layer input ``2sbh`` (``/t`` with SP).

    The paper's 34 is: LayerNorm inputs 4, attention 11 (QKV input 2, Q and K 4, V 2, the
    projection's input 2, its dropout mask 1) and MLP 19 (input 2, GELU input 8, GELU output
    8, dropout mask 1). Of these, 10 stay whole on every TP rank (LayerNorm, QKV and MLP
    inputs, the two dropout masks) and 24 are split. A SwiGLU MLP with ``d_ff = f`` keeps
    ``8sbf`` split (gate and up outputs, SiLU output, their product) instead of GELU's
    ``4sbf`` (``16sbh`` at ``f = 4h``); grouped KV heads shrink K and V by ``kv_heads/a``.
    """
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    f = 4 * h if d_ff is None else d_ff
    kv = a if kv_heads is None else kv_heads
    whole = 10 * s * b * h
    attn_split = s * b * h * (2 + 2 + 4 * kv / a)  # Q, the projection's input, K and V
    mlp_split = s * b * f * (8 if mlp == "swiglu" else 4)
    core = 0 if recompute == "selective" else 5 * a * s * s * b  # scores, softmax, mask
    split = attn_split + mlp_split + core
    return (whole + split) / t if sp else whole + split / t


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                           mode: str = "none", value_bytes: int = 4) -> int:
    """Exactly what one layer of edu3d's GPT saves for backward, in bytes (fp32 by default).

    Korthikanti's term list for this model (no dropout, fused attention), in values:

    ============================  ==========  ===========================================
    saved for backward            values      under TP / SP
    ============================  ==========  ===========================================
    LayerNorm inputs (2)          ``2sbh``    whole on every TP rank; ``/t`` with SP
    LayerNorm mean, 1/std (2x2)   ``4sb``     whole; ``/t`` with SP
    QKV input, MLP input          ``2sbh``    whole; ``/t`` with SP (the column layer
                                              keeps only its tokens and re-gathers them)
    Q, K, V                       ``3sbh``    ``/t`` (heads)
    attention output              ``sbh``     ``/t``; the same storage as the output
                                              projection's input
    log-sum-exp per head, token   ``asb``     ``/t``; the fused kernel's only trace of
                                              the ``s x s`` softmax
    GELU input, GELU output       ``8sbh``    ``/t`` (the GELU output is the MLP
                                              projection's input)
    ============================  ==========  ===========================================

    ``mode`` is the recomputation (:mod:`edu3d.parallel.recompute`). ``none``: all of it,
    ``16sbh + 4sb + asb``. ``selective`` recomputes the attention core from Q, K, V, which
    stay saved (they are its inputs), and its output stays too (the output projection saves
    it): only the ``asb`` log-sum-exps go. ``full`` keeps the block's input, ``sbh`` (``/t``
    with SP). Korthikanti's 16-bit counts (:func:`activation_bytes_per_layer`) have
    ``34sbh``, ``2sbh`` of it dropout masks, and ``5as^2b`` for the unfused scores, softmax
    and its dropout that selective recomputation removes: here a fused kernel never stored
    them. tests/test_recompute.py measures every case on the real modules.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if mode == "full":
        return int(s * b * h * value_bytes / (t if sp else 1))
    whole = 4 * s * b * h + 4 * s * b
    split = 12 * s * b * h + (0 if mode == "selective" else a * s * b)
    values = (whole + split) / t if sp else whole + split / t
    return int(round(values * value_bytes))


def autocast_activation_bytes_per_layer(s: int, b: int, h: int, a: int,
                                        recompute: str | None = None) -> int:
    """What one layer of this course's GPT saves under ``torch.autocast`` (bf16 or fp16,
    fp32 weights: edu3d's ``--precision``), without TP, in bytes.

    The residual stream stays fp32, so the two LayerNorm inputs (``2sbh``) and their
    statistics (``4sb``) are 4-byte; each linear layer saves the 16-bit copy of its input
    it multiplied (QKV and MLP inputs, ``2sbh``) and of its weight (``12h^2`` per layer:
    autocast casts each weight once per forward and backward needs it); Q, K, V, the
    attention output and GELU's input and output are 16-bit (``12sbh``); the log-sum-exps
    fp32 (``asb``). ``"full"`` keeps the fp32 block input (``4sbh``), ``"selective"`` drops
    the log-sum-exps. Checked on CUDA against the engine's meter (tests/test_planner.py).
    """
    if recompute == "full":
        return 4 * s * b * h
    fp32 = 2 * s * b * h + 4 * s * b + (0 if recompute == "selective" else a * s * b)
    half = 2 * s * b * h + 12 * s * b * h + 12 * h * h
    return 4 * fp32 + 2 * half
