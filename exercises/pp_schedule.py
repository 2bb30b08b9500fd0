"""Exercise 05: write the 1F1B pipeline schedule, then hunt the missing 1/m.

Part 1. A schedule is data: for each pipeline rank, the ordered list of its compute actions
in PyTorch's notation, ``"<stage><kind><micro-batch>"`` (``"0F3"`` = stage 0, forward of
micro-batch 3; ``"2B0"`` = stage 2, backward of micro-batch 0). With one stage per rank,
rank ``r`` runs stage ``r``. Megatron's 1F1B rule for ``p`` ranks and ``m`` micro-batches:

* warm-up: rank ``r`` runs ``p - r - 1`` forwards (never more than ``m``);
* steady state: one forward, then one backward, until every forward has run;
* cool-down: the remaining backwards.

Forwards and backwards each take the micro-batches in order 0, 1, 2, ...

Part 2. Each micro-batch's loss is the mean over its tokens. The pipeline adds up the
gradients of ``m`` micro-batches. What must a micro-batch back-propagate so that the sum
equals the gradient of the whole batch's mean loss? And how would you *detect* a pipeline
that gets this wrong, when its loss curve under AdamW looks perfect?
"""

from __future__ import annotations


def one_f_one_b(pp: int, m: int) -> list[list[str]]:
    """Per rank ``r`` in ``0..pp-1``, rank r's compute actions, e.g. for pp=2, m=3:
    ``[["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"], ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]]``.
    """
    raise NotImplementedError(
        "hint: write each rank's list of actions following the three phases of the "
        "module docstring; the later a rank sits in the pipeline, the shorter its warm- "
        "up")


def microbatch_loss(loss, m: int):
    """What one micro-batch back-propagates, given its mean loss ``loss`` (a scalar tensor)
    and the number of micro-batches ``m``."""
    raise NotImplementedError(
        "hint: the batch's mean loss is the average of the m micro-batch means; its "
        "gradient is the sum of the micro-batches' gradients of what?")


def gradient_scale(pipeline_grads: dict, serial_grads: dict) -> float:
    """The gradient check: how many times larger the pipeline's gradient is than the
    serial model's, as the ratio of their global norms (both dicts map parameter name ->
    gradient tensor). A correct pipeline gives 1.0."""
    raise NotImplementedError(
        "hint: compare the two models' gradients as a whole, by one number each (their "
        "global size), and return how many times larger the pipeline's is")


# ---- design: beat 1F1B's bubble at 1F1B's memory ----------------------------------------------
def faster_schedule(pp: int, m: int) -> list[list[str]]:
    """Per rank, your own schedule (one stage per rank, as above) whose step is shorter
    than 1F1B's while no rank keeps more micro-batches' activations than 1F1B's rank 0
    does (``pp`` of them).

    You may split a backward ``B`` into its two halves: ``I``, the input gradient the
    previous stage is waiting for, and ``W``, the weight gradient nobody waits for
    (``"1I3"``, ``"1W3"``: run both, ``I`` first, never together with ``B``). A
    micro-batch's activations stay until its ``B`` or its ``W`` has run. The grader replays
    your lists with edu3d's checker and simulator (``F``, ``I`` and ``W`` cost one unit each,
    ``B`` two) on pp=4, m=8 and two smaller pipelines; the target is ZB-H1's step (pp=4,
    m=8: 27 units against 1F1B's 33). Write the lists yourself: a module that calls one of
    ``edu3d.schedules``' generators fails the check.
    """
    raise NotImplementedError(
        "hint: where does 1F1B sit idle, and which work could fill those gaps without "
        "anyone waiting for it? Mind what that work keeps alive")
