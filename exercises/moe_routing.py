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
