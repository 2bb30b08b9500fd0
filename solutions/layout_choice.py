"""Exercise 11 (solution): a layout for each job, found as the Playbook's recipe says.

* ``a``: gpt2-xl (1.6 B) needs about 25 GB of state in bf16 + AdamW: 24 GB GPUs cannot
  hold it whole, so shard the optimizer state over the 8 data-parallel ranks (ZeRO-1). No TP
  or PP needed: pure data parallelism sends the least. Selective recomputation drops the
  ``s x s`` attention scores, so 4 sequences fit in a micro-batch: bigger matmuls, closer to
  the GPU's peak, and fewer launches per token than one sequence at a time.
* ``b``: llama2-7b's 112 GB of state needs model parallelism even on 80 GB: TP inside a node
  is cheap over NVLink, and ZeRO-1 plus a short pipeline finish the job; data parallelism
  crosses the nodes, once per step.
* ``c``: llama2-13b on 40 GB: TP of 2 inside the node, a 4-stage pipeline (cheap to cross
  nodes: one activation per micro-batch) with many micro-batches for a small bubble,
  selective recomputation for the activations, ZeRO-1 over the rest.
"""

LAYOUTS = {
    "a": {"dp": 8, "tp": 1, "pp": 1, "zero": 1, "micro_batch": 4, "recompute": "selective"},
    "b": {"dp": 8, "tp": 1, "pp": 2, "zero": 1, "micro_batch": 1, "recompute": "selective"},
    "c": {"dp": 4, "tp": 2, "pp": 4, "zero": 1, "micro_batch": 1, "recompute": "selective"},
}


def choose(job: str) -> dict:
    """The layout for ``job``."""
    return dict(LAYOUTS[job])


# The deeper hints of exercises/layout_choice.py (edu3d.course.grading.tiers): per function,
# a nudge (a check's second failure), then the answer's shape (its third).
HINTS = {
    "choose": ("bf16 + AdamW keeps 16 bytes per parameter: compare with 90 % of the GPU; ZeRO-1 "
               "shards 12 of them over dp for free; TP only inside a node of 8; a pipeline "
               "needs many micro-batches; full recomputation costs a third more compute",
               "a: dp 8, ZeRO-1, micro-batch 4 with selective recomputation; b: dp 8 x pp 2 (or dp 4 x tp 2 x pp 2), ZeRO-1, "
               "selective; c: dp 4 x tp 2 x pp 4, ZeRO-1, selective, micro-batch 1 "
               "(`edu3d plan` lists the rest)"),
}
