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
