"""Exercise 12: the router's two rules, load balance and capacity.

A mixture-of-experts layer sends every token to ``k`` of ``E`` expert MLPs. Its router scores
the token (``probs``: a softmax over the experts, one row per token), the top ``k`` become the
token's *assignments* (``expert_idx[n]``, ``k`` different experts) and their probabilities,
renormalised, its *gates* (how much of each expert's output the token takes). Two things keep
such a layer trainable and its experts busy, and you write both:

* **the load-balancing loss** (Switch Transformer, GShard). Left alone, a router learns to
  send most tokens to the few experts that happened to start ahead; they get better, get
  chosen more, and the others starve. The loss multiplies, per expert, the share of the
  layer's assignments that went to it (a count: it has no gradient) by the mean probability
  the router gave it (that has one): pushing down the probability of the experts that are
  already busy. Scaled so that it is 1 at perfect balance, whatever ``E``, and ``E`` when
  every token picks the same experts;
* **the capacity**. Real systems give every expert a fixed buffer per batch (static shapes,
  a bounded all-to-all): room for its fair share of the assignments times a *capacity
  factor* ``C``, rounded up to whole assignments. An expert asked for more keeps the
  assignments it matters most for (the highest gates) and drops the rest; two assignments
  with the same gate are ordered by token, the lower index first, so that every rank seeing
  the same tokens makes the same choice. A dropped assignment costs its token that expert's
  contribution (the residual connection carries the token on).

Both take tensors shaped as the router makes them: ``N`` tokens, ``E`` experts, ``k`` choices.
Run the checks in ``exercises/12_moe_routing.ipynb``.
"""

import torch


def load_balancing_loss(probs: torch.Tensor, expert_idx: torch.Tensor,
                        n_experts: int) -> torch.Tensor:
    """The load-balancing loss of one layer's ``N`` tokens, a 0-dim tensor.

    ``probs`` ``[N, E]``: the router's probabilities (each row sums to 1); ``expert_idx``
    ``[N, k]`` (int64): the experts each token was sent to. The loss must carry a gradient
    to ``probs`` (that is how it moves the router), and none through the counts."""
    raise NotImplementedError(
        "hint: per expert, multiply the share of all N*k assignments it received "
        "(counted from expert_idx, no gradient) by the mean probability the router gave "
        "it (from probs, with gradient); sum over experts and scale so that perfect "
        "balance gives 1")


def capacity_keep(gates: torch.Tensor, expert_idx: torch.Tensor, n_experts: int,
                  capacity_factor: float) -> torch.Tensor:
    """Which assignments the experts keep: a bool tensor shaped like ``gates``.

    ``gates`` ``[N, k]``: each assignment's gate; ``expert_idx`` ``[N, k]``: its expert. Every
    expert keeps at most its capacity (its fair share of the ``N*k`` assignments times
    ``capacity_factor``, rounded up to a whole number); when asked for more it keeps its
    highest gates, and of two equal gates the lower token index."""
    raise NotImplementedError(
        "hint: first find the one capacity every expert gets, then let each expert "
        "asked for more keep the assignments that matter most to it (equal ones settled "
        "the same way on every rank)")


# ---- design: capacity factor and ep degree for a drop target and a memory budget ----------------
def moe_plan(job: str) -> dict:
    """``{"capacity_factor": C, "ep": degree}`` for a mixture of experts trained on one node
    of 8 GPUs: 16 MoE blocks of 16 SwiGLU experts (d_model 2048, expert width 2816), top-2,
    one sequence of 4,096 tokens a rank per micro-batch. Its router sends a rank's 8,192
    assignments to the 16 experts as (every rank alike)::

        1100, 820, 700, 640, 600, 560, 520, 500, 470, 440, 400, 380, 340, 300, 240, 182

    An expert keeps at most ``ceil(T·k/E · C)`` assignments of a rank (your
    ``capacity_keep``), and its buffer holds that many slots whether it is full or not: the
    experts compute every slot (18 · 2048 · 2816 FLOPs each, forward and backward, at
    400 TFLOP/s) and the all-to-alls send every slot (``edu3d.plan.formulas.ep_bytes``, at
    100 GB/s). ``ep`` (1, 2, 4 or 8) splits the experts' state (16 bytes a parameter) over
    that many ranks; the MoE halves' activations (``moe_mlp_activation_bytes``) grow with
    the slots; the rest of a rank holds 12 GB.

    ======  ============================  ==================
    job     dropped assignments           memory of a rank
    ======  ============================  ==================
    ``a``   at most 2 %                   64 GB
    ``b``   none                          40 GB
    ======  ============================  ==================

    The target: the drops and the memory within the job's limits, and the experts' step
    within 2 % of the best plan (the grader: ``cost`` in
    ``edu3d/course/ch12_mixture_of_experts_grade.py``; try plans with
    ``grade_moe.describe(job, plan)``).
    """
    raise NotImplementedError(
        "hint: every slot of capacity costs compute and all-to-all bytes whether it is used "
        "or not, and every doubling of ep costs more of the all-to-all: how little of each "
        "does the job allow?")
