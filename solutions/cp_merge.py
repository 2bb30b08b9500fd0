"""Exercise 13: the two pieces of arithmetic context parallelism stands on (reference
solution).

* **The merge.** ``lse = log(e^lse_a + e^lse_b)`` (``torch.logaddexp``: stable, and ``-inf``
  when both are), ``out = e^(lse_a - lse)·out_a + e^(lse_b - lse)·out_b``: each block's
  output weighed by its share of the whole softmax denominator. Every exponent is <= 0, so
  nothing overflows; where ``lse`` is ``-inf`` the reference is 0 instead, so the weights
  are ``e^-inf = 0`` and the output 0, never ``nan``.
* **The zigzag split.** ``2·cp`` chunks of ``seq_len / (2·cp)`` tokens; rank ``r`` holds
  chunks ``r`` and ``2·cp - 1 - r``.
"""

import torch


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two partial attention results for the same queries.

    ``out_a, out_b``: ``[..., T, hd]`` outputs, each normalised over its own key block;
    ``lse_a, lse_b``: ``[..., T]`` their log-sum-exps (``-inf`` where the query saw nothing).
    Returns ``(out, lse)`` over both blocks, in fp32."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a - ref).unsqueeze(-1)
    wb = torch.exp(lse_b - ref).unsqueeze(-1)
    return wa * out_a.float() + wb * out_b.float(), lse


def zigzag_positions(seq_len: int, cp: int, rank: int) -> list[int]:
    """The global positions of the tokens rank ``rank`` of ``cp`` holds under the zigzag
    split, in its local order (``seq_len`` a multiple of ``2 * cp``)."""
    size = seq_len // (2 * cp)
    chunks = (rank, 2 * cp - 1 - rank)
    return [p for c in chunks for p in range(c * size, (c + 1) * size)]



# ---- design: the cp degree and implementation for a sequence and a memory budget ----------------
def cp_plan(job: str) -> dict:
    """a (32k tokens, 8 x 24 GB, one node): only full recomputation fits, from cp = 4 (19 GB);
    cp = 8 is slower (every rank's matmuls shrink with its tokens). On NVLink the ring hides
    its K,V sends under each block's attention: 11.0 s, where Ulysses' all-to-alls (11.3 s)
    and the all-gather (11.6 s) wait in the open.
    b (64k tokens, 8 x 24 GB in two nodes of 4 at 25 GB/s): only cp = 8 with full
    recomputation fits, so the cp group spans both nodes. The ring sends this rank's K,V
    cp - 1 times forward and again backward, across the slow link, far longer than the
    attention it could hide under (65 s); Ulysses' four all-to-alls move each token's q, k, v
    and output once, (cp-1)/cp of them: about five times fewer bytes (53 s)."""
    return {"a": {"cp": 4, "cp_impl": "ring", "recompute": "full"},
            "b": {"cp": 8, "cp_impl": "ulysses", "recompute": "full"}}[job]


# The deeper hints of exercises/cp_merge.py (edu3d.course.grading.tiers): per function,
# a nudge (a check's second failure), then the answer's shape (its third).
HINTS = {'merge': ('lse = log(e^lse_a + e^lse_b); each output weighs e^(lse_x - lse); where lse is '
           '-inf use 0 as the reference so the weights are 0, not nan',
           'lse = torch.logaddexp(lse_a, lse_b); ref = where(isfinite(lse), lse, 0); out = '
           'exp(lse_a - ref)[..., None] * out_a + exp(lse_b - ref)[..., None] * out_b, all in '
           'fp32'),
 'zigzag_positions': ('2*cp chunks of seq_len / (2*cp) tokens; rank r holds one chunk from the '
                      'front and its mirror image from the back',
                      'chunks r and 2*cp - 1 - r, each range(c * size, (c + 1) * size), front '
                      'one first'),
 'cp_plan': ('first find what fits: each doubling of cp halves the activations, full '
             'recomputation keeps only block inputs; then compare the implementations at the '
             'smallest cp that fits: which one hides its sends, which sends the fewest bytes '
             'over a slow link?',
             'a: cp 4, the ring, full recomputation (on NVLink its sends hide); b: cp 8, '
             'Ulysses, full recomputation (across the slow link it moves far fewer bytes than '
             'the ring); compare every plan with g.describe(job, plan)')}
