"""Exercise 06: the global gradient norm of a 3D-parallel model, and the tied embedding.

Gradient clipping needs the norm of the *serial* model's gradient, but no rank holds it all.
On a tp x pp mesh a rank holds:

* **TP shards** (the column/row linears, the vocabulary-parallel embedding): distinct
  pieces, each counted by the rank that holds it;
* **TP-replicated tensors** (LayerNorm gains and biases, row layers' biases, ``pos_emb``):
  the same whole tensor on every tp rank. Count it on every rank and the norm is too
  large: the classic bug of ``buggy_global_grad_norm`` below. Count it on tp index 0 only;
* **the tied embedding** under pipelining: the first stage's ``tok_emb.weight`` and the last
  stage's ``lm_head.weight`` are copies of one matrix. Before the optimizer their gradients
  must be *summed* between the two stages (each saw half the uses); in the norm the matrix
  counts once, on the first stage.

Each rank adds the squares of what it owns; one all-reduce (SUM) of that one number over
the model-parallel group, a square root, and every rank has the same, correct norm.
Run the checks in ``exercises/06_3d_parallelism.ipynb``.
"""

import torch
import torch.distributed as dist


def buggy_global_grad_norm(pieces: list, tp_index: int, group=None) -> torch.Tensor:
    """The classic wrong norm (given, do not change it; find its bug): every rank adds the
    squares of everything it holds, so a TP-replicated tensor (a LayerNorm, a bias) is
    counted once per tp rank. ``pieces`` as in :func:`global_grad_norm`."""
    sq = torch.zeros(1, dtype=torch.float64)
    for name, grad, replicated, tied_copy in pieces:
        if tied_copy:
            continue
        sq += grad.detach().double().pow(2).sum()
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    return sq.sqrt().float()[0]


def global_grad_norm(pieces: list, tp_index: int, group=None) -> torch.Tensor:
    """The serial model's gradient norm (a float32 scalar tensor, the same on every rank).

    ``pieces``: every gradient this rank holds, as ``(name, grad, replicated, tied_copy)``
    tuples: the serial parameter's name; this rank's gradient (a TP shard or the whole
    tensor); ``replicated``: every tp rank holds this same whole tensor; ``tied_copy``: this
    is the last stage's copy of the tied embedding. ``tp_index``: this rank's tp coordinate.
    ``group``: the ranks holding distinct pieces (tp x pp), to all-reduce over.
    """
    raise NotImplementedError(
        "hint: fix buggy_global_grad_norm: every element of the serial gradient must be "
        "counted exactly once over the group, however many ranks hold a copy of it")


@torch.no_grad()
def sum_tied_embedding_grads(grad: torch.Tensor, group=None) -> None:
    """``grad``: this stage's half of the tied embedding's gradient (the first stage's
    ``tok_emb.weight`` or the last stage's ``lm_head.weight``, this rank's TP shard of it).
    Replace it *in place* by the sum over ``group``, the 'embed' group of those two stages,
    so both copies take the same optimizer step and stay equal."""
    raise NotImplementedError(
        "hint: each of the two stages holds half of the tied matrix's gradient; both "
        "copies must end with the whole of it")


# ---- design: which layers go to which stage ---------------------------------------------------
def split_layers(job: str) -> list[int]:
    """How many transformer layers each of the ``pp`` pipeline stages holds (at least one
    each, all the layers in all), for a GPT whose first stage also holds the embedding and
    whose last stage holds the LM head and the loss (the tied embedding's two homes):

    =====  ======  ===  ==============  ========  ============  ===================
    job    layers  pp   micro-batches   memory    state/layer   activations/layer
    =====  ======  ===  ==============  ========  ============  ===================
    ``a``  24      4    16              40 GB     3.2 GB        1.0 GB
    ``b``  32      4    32              30 GB     1.6 GB        0.5 GB
    =====  ======  ===  ==============  ========  ============  ===================

    A layer's forward and backward take one unit; the embedding 0.2 units and 1.6 GB of
    state; the head and loss 6 units (a vocabulary's worth of logits), 1.6 GB of state and
    3 GB of logits per micro-batch. The schedule is 1F1B: the step takes ``m + p - 1``
    times the slowest stage, and stage ``s`` keeps ``p - s`` micro-batches of activations.
    The target: every stage fits its GPU, and the step is within 2 % of the best cut (the
    grader's model: ``cost`` in ``edu3d/course/ch06_3d_parallelism_grade.py``).
    """
    raise NotImplementedError(
        "hint: the slowest stage sets the pace; which stages carry extra work, and which "
        "keep the most micro-batches alive?")
