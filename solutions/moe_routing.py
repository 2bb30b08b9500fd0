"""Exercise 12: the router's two rules, load balance and capacity (reference solution).

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
"""

import math

import torch


def load_balancing_loss(probs: torch.Tensor, expert_idx: torch.Tensor,
                        n_experts: int) -> torch.Tensor:
    """The load-balancing loss of one layer's ``N`` tokens, a 0-dim tensor.

    ``probs`` ``[N, E]``: the router's probabilities (each row sums to 1); ``expert_idx``
    ``[N, k]`` (int64): the experts each token was sent to. The loss must carry a gradient
    to ``probs`` (that is how it moves the router), and none through the counts."""
    n, k = expert_idx.shape
    counts = torch.bincount(expert_idx.flatten(), minlength=n_experts)
    f = counts.to(probs.dtype) / (n * k)  # share of the assignments: a count, no gradient
    p = probs.mean(0)  # mean probability: carries the gradient
    return n_experts * (f * p).sum()  # E * sum_i f_i P_i: 1 at perfect balance


def capacity_keep(gates: torch.Tensor, expert_idx: torch.Tensor, n_experts: int,
                  capacity_factor: float) -> torch.Tensor:
    """Which assignments the experts keep: a bool tensor shaped like ``gates``.

    ``gates`` ``[N, k]``: each assignment's gate; ``expert_idx`` ``[N, k]``: its expert. Every
    expert keeps at most its capacity (its fair share of the ``N*k`` assignments times
    ``capacity_factor``, rounded up to a whole number); when asked for more it keeps its
    highest gates, and of two equal gates the lower token index."""
    n, k = gates.shape
    capacity = math.ceil(n * k / n_experts * capacity_factor)
    keep = torch.zeros(n, k, dtype=torch.bool)
    for e in range(n_experts):
        rows, cols = (expert_idx == e).nonzero(as_tuple=True)  # in token order
        order = sorted(range(len(rows)), key=lambda i: (-float(gates[rows[i], cols[i]]),
                                                        int(rows[i])))
        for i in order[:capacity]:
            keep[rows[i], cols[i]] = True
    return keep



# ---- design: capacity factor and ep degree for a drop target and a memory budget ----------------
def moe_plan(job: str) -> dict:
    """The smallest capacity that meets the drop target (every slot is computed and sent),
    then the smallest ep that fits (each doubling sends more of the slots away).
    a: dropping 2 % of 8,192 assignments is 163; a capacity of 937 drops the busiest
    expert's 1100 - 937 = 163 (1.99 %): C = 937 / 512 = 1.83; ep = 2 fits (55.2 GB; ep = 1
    needs 90.6). b: no drops: the busiest expert's 1100, C = 1100 / 512 = 2.148; ep = 2
    needs 56.5 GB, ep = 4 fits (38.8 GB)."""
    return {"a": {"capacity_factor": 1.83, "ep": 2},
            "b": {"capacity_factor": 2.148, "ep": 4}}[job]


# The deeper hints of exercises/moe_routing.py (edu3d.course.grading.tiers): per function,
# a nudge (a check's second failure), then the answer's shape (its third).
HINTS = {'load_balancing_loss': ('count assignments (N*k of them), not tokens; the mean probability is '
                         "over all N tokens' full probabilities; scale by E",
                         'f = bincount(expert_idx.flatten(), minlength=E) / (N * k); P = '
                         'probs.mean(0); return E * (f * P).sum()'),
 'capacity_keep': ('capacity = ceil(N * k / E * C), the same for every expert; order an '
                   "expert's assignments by gate (highest first), then by token index",
                   'for each expert e: its (token, slot) pairs sorted by (-gate, token); keep '
                   'the first `capacity`'),
 'moe_plan': ('every slot of capacity is computed and sent, used or not; count the '
              'assignments each capacity drops from the load list; each doubling of ep '
              'halves the experts\' state and sends more of the slots away',
              'the smallest capacity whose drops meet the target (C = capacity / 512), then '
              'the smallest ep whose memory fits: compare with grade_moe.describe(job, plan)')}
