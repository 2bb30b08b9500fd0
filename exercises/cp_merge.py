"""Exercise 13: the two pieces of arithmetic context parallelism stands on.

* **The merge.** Ring attention never sees the whole score row of a query at once: each step
  gives it the attention over one block of keys only, as an output normalised over that
  block and the block's log-sum-exp ``lse`` (the log of the softmax denominator). Two such
  partial results over disjoint key blocks must combine into *exactly* the attention over
  both blocks, as if the softmax had seen every key. Work in fp32 whatever the inputs are,
  and stay finite where a query saw no key at all in a block: its ``lse`` is ``-inf`` and
  its output 0 (the causal mask hides whole blocks), and a query may see nothing in either.
  Large ``lse`` values must not overflow.
* **The zigzag split.** Under a causal mask the plain split (rank ``r`` holds the ``r``-th
  ``1/cp`` of the sequence) gives the last rank far more work than the first. Zigzag cuts
  the sequence into ``2·cp`` equal chunks and gives each rank one early chunk and one late
  chunk, so every rank does the same work. Rank ``r``'s tokens are its two chunks, in
  order, by their *global* positions.

Run the checks in ``exercises/13_context_parallel.ipynb``.
"""


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two partial attention results for the same queries.

    ``out_a, out_b``: ``[..., T, hd]`` outputs, each normalised over its own key block;
    ``lse_a, lse_b``: ``[..., T]`` their log-sum-exps (``-inf`` where the query saw nothing).
    Returns ``(out, lse)`` over both blocks, in fp32."""
    raise NotImplementedError(
        "hint: each partial output is a softmax-weighted average over its own block; "
        "the merged one weighs each by the share of the total softmax denominator its "
        "block holds, without overflowing and without nan where a query saw nothing")


def zigzag_positions(seq_len: int, cp: int, rank: int) -> list[int]:
    """The global positions of the tokens rank ``rank`` of ``cp`` holds under the zigzag
    split, in its local order (``seq_len`` a multiple of ``2 * cp``)."""
    raise NotImplementedError(
        "hint: cut the sequence into 2*cp equal chunks and give each rank one early and "
        "one late chunk so that every rank does the same causal work")


# ---- design: the cp degree and implementation for a sequence and a memory budget ----------------
def cp_plan(job: str) -> dict:
    """``{"cp": degree, "cp_impl": "ring" | "allgather" | "ulysses", "recompute": "none" |
    "selective" | "full"}`` for a long-sequence job of llama2-7b (32 layers, d_model 4096,
    32 heads, each with its own K and V), bf16 with AdamW, ZeRO-3 over ``dp x cp``
    (``dp = GPUs / cp``), one sequence a micro-batch, 90 % of a GPU usable:

    ======  ==============  ========================================  =====================
    job     sequence        GPUs                                      sequences a step
    ======  ==============  ========================================  =====================
    ``a``   32,768 tokens   8 of 24 GB, one node (NVLink)             8
    ``b``   65,536 tokens   8 of 24 GB, two nodes of 4 GPUs, NVLink   8
                            inside, 25 GB/s per GPU between them
    ======  ==============  ========================================  =====================

    ``cp`` divides the GPUs; Ulysses hands each rank whole heads, so its ``cp`` divides the
    32 heads. The target: the fullest rank fits, and the planner's step on the job's nodes
    and links is within 2 % of the best plan it accepts (the grader: ``cost`` in
    ``edu3d/course/ch13_context_parallelism_grade.py``; try plans with
    ``g.describe(job, plan)``).
    """
    raise NotImplementedError(
        "hint: what does each doubling of cp save, and what does it cost once the sequence "
        "already fits? which implementation's sends can hide under the attention, and which "
        "sends the fewest bytes over a slow link?")
