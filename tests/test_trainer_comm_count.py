"""The collectives the performance model counts are the ones a traced edu3d step issues.

On a CPU each gloo collective costs a latency of its own (a few hundred microseconds), so the
model's step time is only as good as its *count* of them. One 2-rank launch trains the tiny
model twice (tensor parallelism with sequence parallelism, and ZeRO-3, 2 micro-batches each)
with its trace on; the collectives of one step, by group and kind, must be what
:func:`edu3d.plan.trainer_comm.count` lists for them. Nothing here times anything.
"""

from __future__ import annotations

from collections import Counter

from edu3d.config.layout import Layout
from edu3d.config.sections import Run
from edu3d.distributed import trace
from edu3d.launch import launch
from edu3d.plan import recipes, trainer_comm
from edu3d.plan.estimate import spec_of
from edu3d.plan.stage_costs import cut_of

from tests import workers_trainer_comm as workers

RUNS = [dict(tp=2, sp=True, microbatches=2), dict(dp=2, zero=3, microbatches=2)]


def test_counted_collectives_are_the_traced_ones(tmp_path):
    options = [dict(model="tiny", global_batch=8, precision="fp32", **r) for r in RUNS]
    launch(workers.traced_steps, 2, args=(options,), layout=Layout(dp=2), timeout=300,
           echo=False, run_dir=tmp_path, pool=False)
    events = trace.load(tmp_path)
    for case, opts in enumerate(options):
        run = Run.of(**opts)
        spec = spec_of(run)
        cut = cut_of(spec, run, recipes.recipe_of("edu3d"))
        counted = trainer_comm.count(spec, run, cut, 0, spec.n_layers, True, True)
        assert sum(counted.values()) > 4 * spec.n_layers * run.microbatches  # the textbook's
        traced = Counter((e["group"], e["op"]) for e in events if e["lane"] == "comm"
                         and e["rank"] == 0 and e.get("case") == case and e.get("step") == 2)
        assert traced == counted, opts
