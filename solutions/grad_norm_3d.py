"""Exercise 06 (solution): the global gradient norm of a 3D-parallel model, and the tied
embedding's gradient across the first and last pipeline stage."""

import torch
import torch.distributed as dist


def buggy_global_grad_norm(pieces: list, tp_index: int, group=None) -> torch.Tensor:
    """The classic wrong norm: every rank adds the squares of everything it holds, so a
    TP-replicated tensor (a LayerNorm, a bias) is counted once per tp rank."""
    sq = torch.zeros(1, dtype=torch.float64)
    for name, grad, replicated, tied_copy in pieces:
        if tied_copy:
            continue
        sq += grad.detach().double().pow(2).sum()
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    return sq.sqrt().float()[0]


def global_grad_norm(pieces: list, tp_index: int, group=None) -> torch.Tensor:
    """The serial model's gradient norm from the pieces this rank holds: each element of the
    serial gradient counted exactly once over ``group``."""
    sq = torch.zeros(1, dtype=torch.float64)
    for name, grad, replicated, tied_copy in pieces:
        if replicated and tp_index != 0:
            continue  # the same whole tensor on every tp rank: tp index 0 counts it
        if tied_copy:
            continue  # the first stage's copy of the tied embedding counts it
        sq += grad.detach().double().pow(2).sum()
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    return sq.sqrt().float()[0]


@torch.no_grad()
def sum_tied_embedding_grads(grad: torch.Tensor, group=None) -> None:
    """Replace ``grad`` (this stage's half of the tied embedding's gradient) in place by the
    sum over the first and the last pipeline stage."""
    dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)




# ---- design: which layers go to which stage ---------------------------------------------------
def split_layers(job: str) -> list[int]:
    """Balance the work, then the memory. The head weighs 6 layers: the last stage takes
    fewer layers. The first stage keeps ``p`` micro-batches alive under 1F1B, the next
    ``p - 1``, and so on: the early stages take fewer layers than the work alone would
    give them. a: the uniform cut does not fit stage 0 (44.8 GB), [5, 6, 7, 6] does, at the
    same pace; b: [7, 9, 11, 5] evens the middle and the head's stage at 11 units."""
    return {"a": [5, 6, 7, 6], "b": [7, 9, 11, 5]}[job]


# The deeper hints of exercises/grad_norm_3d.py (edu3d.course.grading.tiers): per function,
# a nudge (a check's second failure), then the answer's shape (its third).
HINTS = {'global_grad_norm': ('a replicated piece counts on tp index 0 only, the tied copy on the '
                      'first stage only; one all-reduce of the squares, then the square root',
                      'sq = sum of grad.double().pow(2).sum() over pieces, skipping '
                      '(replicated and tp_index != 0) and tied_copy; dist.all_reduce(sq, '
                      'op=dist.ReduceOp.SUM, group=group); return sq.sqrt().float()[0]'),
 'sum_tied_embedding_grads': ('one collective over the group you are given sums the two '
                              'halves, in place',
                              'dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)'),
 'split_layers': ('the step is m + p - 1 times the slowest stage; the last stage also runs '
                  'the head (6 layers of work); stage s keeps p - s micro-batches alive',
                  'start from an even cut of the work (the head counted as 6 layers), then '
                  'move layers from the first stages to later ones until stage 0 fits: try '
                  'cuts with ch06_3d_parallelism_grade.describe')}
