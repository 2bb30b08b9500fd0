"""The collectives the performance model counts are the ones a traced edu3d step issues.

On a CPU each gloo collective costs a latency of its own (a few hundred microseconds), so the
model's step time is only as good as its *count* of them. Two real 2-rank runs of the tiny
model (tensor parallelism with sequence parallelism, and ZeRO-3, 2 micro-batches each) are
traced; the collectives of one step, by group and kind, must be what
:func:`edu3d.plan.trainer_comm.count` lists for them. Nothing here times anything.
"""

from __future__ import annotations

from collections import Counter

import pytest

from edu3d.config.sections import Run
from edu3d.distributed import trace
from edu3d.launch import launch
from edu3d.plan import recipes, trainer_comm
from edu3d.plan.estimate import spec_of
from edu3d.plan.stage_costs import cut_of
from edu3d.train import loop

RUNS = {"tp+sp": dict(tp=2, sp=True, microbatches=2),
        "zero3": dict(dp=2, zero=3, microbatches=2)}


def traced(run: Run, run_dir) -> Counter:
    """``{(group, kind): calls}`` of step 2 of ``run`` on rank 0, from its trace."""
    launch(loop.worker, run.world_size, args=(run.flat(),), layout=run.layout, timeout=300,
           echo=False, run_dir=run_dir, pool=False)
    return Counter((e["group"], e["op"]) for e in trace.load(run_dir)
                   if e["lane"] == "comm" and e["rank"] == 0 and e.get("step") == 2)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_counted_collectives_are_the_traced_ones(name, tmp_path):
    run = Run.of(model="tiny", global_batch=8, steps=2, precision="fp32", **RUNS[name])
    spec = spec_of(run)
    cut = cut_of(spec, run, recipes.recipe_of("edu3d"))
    counted = trainer_comm.count(spec, run, cut, 0, spec.n_layers, True, True)
    assert sum(counted.values()) > 16  # more than the textbook's 4 per layer, for this test
    assert traced(run, tmp_path) == counted
