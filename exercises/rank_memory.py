"""Exercise 07: the bytes one rank holds, from the layout alone .

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

Run the checks in ``exercises/07_memory.ipynb``.
"""


def rank_params(n_layers: int, d_model: int, vocab: int, seq: int, tp: int, pp: int,
                pp_rank: int, tied: bool = False) -> int:
    """Parameters (elements) held by one tp rank of pipeline rank ``pp_rank``."""
    raise NotImplementedError(
        "hint: count the elements this rank holds: its layers, split or kept whole as "
        "tensor parallelism does, plus the ends of the model its stage holds")


def state_bytes(n_params: int, dp: int, zero: int) -> dict:
    """Bytes of ``{"params", "grads", "optimizer"}`` on one rank holding ``n_params``
    (fp32 AdamW), ZeRO stage ``zero`` over ``dp`` ranks."""
    raise NotImplementedError(
        "hint: add the bytes of weights, gradients and Adam's moments, and divide by dp "
        "only what the ZeRO stage shards")


def in_flight(schedule: str, pp: int, m: int, pp_rank: int) -> int:
    """The most micro-batches pipeline rank ``pp_rank`` keeps activations for at once
    (``schedule`` is ``"gpipe"`` or ``"1f1b"``; ``pp = 1`` is gradient accumulation)."""
    raise NotImplementedError(
        "hint: a micro-batch's activations live from its forward until its backward: "
        "how many forwards has a rank run before its first backward?")


# ---- design: ZeRO stage, micro-batch and recompute under a memory cap ----------------------------
def memory_plan(job: str) -> dict:
    """``{"zero": 0-3, "micro_batch": samples, "recompute": bool}`` for one rank of a
    data-parallel job (dp = 8, 32 samples per rank per step, plain gradient accumulation,
    fp32 AdamW: 16 bytes per parameter, 1.5e9 parameters):

    =====  ==========  ========================  =============================
    job    GPU memory  activations of a sample   with recompute (block inputs)
    =====  ==========  ========================  =============================
    ``a``  40 GB       3.0 GB                    0.5 GB
    ``b``  16 GB       3.0 GB                    0.5 GB
    =====  ==========  ========================  =============================

    Time: 0.1 s of compute per sample (a third more with recompute) and 0.02 s per
    micro-batch. Communication is not overlapped; one reduce-scatter or all-gather of the
    fp32 model moves ``(dp - 1) / dp * 4 * params`` bytes at 100 GB/s. ZeRO-0 and ZeRO-1
    all-reduce the gradients once per step (two of those), ZeRO-2 reduce-scatters them after
    every micro-batch and all-gathers the weights once after the step, ZeRO-3 gathers the
    weights for every micro-batch's forward and backward and reduce-scatters its gradients.
    The micro-batch must divide the 32 samples. The target: the rank fits its GPU, and the
    step is within 2 % of the best plan (the grader's model: ``cost`` in
    ``edu3d/course/ch07_memory_grade.py``).
    """
    raise NotImplementedError(
        "hint: what does each ZeRO stage save, and what does it cost per micro-batch?")
