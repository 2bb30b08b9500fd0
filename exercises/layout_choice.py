"""Exercise 11: choose the layout, as the planner would, for three jobs.

Chapter 11 put the course's rules side by side; here you use them. For each job below pick
``dp``, ``tp``, ``pp``, the ZeRO stage, the micro-batch size (sequences) and the
recomputation (``"none"``, ``"selective"`` or ``"full"``), so that

* the layout uses every GPU (``dp * tp * pp`` of them) and the global batch splits evenly
  (``global_batch`` divisible by ``dp * micro_batch``; the rest are micro-batches);
* the fullest rank's memory fits (90 % of a GPU's, in bf16 mixed precision with AdamW,
  1F1B with sequence parallelism on when ``tp > 1``);
* its step is within 10 % of the fastest layout that fits, by the planner's cost model
  (``edu3d.plan.search`` on the performance model, ``edu3d.plan.step``: each matmul at
  the efficiency its size reaches on an H100, the bubble, each axis's collectives over
  NVLink inside a node of 8 and InfiniBand across nodes, overlapped where they can be).

Reason it out first (what must be sharded to fit? which axis may cross nodes?), then check
with ``edu3d plan`` if you like. The jobs:

========  ============  =====  ================  ============
job       model         GPUs   memory per GPU    global batch
========  ============  =====  ================  ============
``a``     gpt2-xl       8      24 GB             64
``b``     llama2-7b     16     80 GB (2 nodes)   256
``c``     llama2-13b    32     40 GB (4 nodes)   512
========  ============  =====  ================  ============

Run the checks in ``exercises/11_layout_choice.ipynb``.
"""


def choose(job: str) -> dict:
    """The layout for ``job`` (``"a"``, ``"b"`` or ``"c"``): a dict with the keys ``dp``,
    ``tp``, ``pp``, ``zero``, ``micro_batch`` and ``recompute``."""
    raise NotImplementedError(
        "hint: for each job, first make the model's state and activations fit on one GPU "
        "(shard what must be sharded), then keep the chattiest axis on the fastest links "
        "and leave the rest to data parallelism")
