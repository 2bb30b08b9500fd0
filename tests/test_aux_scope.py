"""``--aux-scope``: which tokens the load-balancing loss counts, and which serial command a
mixture-of-experts layout then equals.

* ``global`` reduces f_i and P_i over every dp and cp rank, and each data rank takes its share
  of every micro-batch: expert parallelism, DP+EP+ZeRO and DP+CP+EP equal the plain serial
  command with the same micro-batch count, gradients (plain SGD), norms, losses and the
  weights after AdamW, as :mod:`tests.test_5d_parity` measures them (1e-5, the weights after
  the AdamW steps beyond what rounding can do there: :mod:`tests.adamw_noise`);
* ``sequence`` (DeepSeek-V3's sequence-wise loss) equals the plain serial command too;
* ``microbatch`` (the default) equals the serial command with ``dp x m`` micro-batches, and
  ``edu3d train`` says so in one line;
* the refusals: an unknown scope, a scope without experts.
"""

from __future__ import annotations

import functools

import pytest
import torch

from edu3d.config.layout import LayoutError
from edu3d.config.sections import Run
from edu3d.train.cut import shard_rows
from edu3d.train.loop import reference_microbatches
from edu3d.train.preflight import preflight
from tests.workers_5d import (MOE, argv_of, assert_parity, launch_parity, options, rel,
                              serial_reference, world_size)

TOL = 1e-5
LAYOUTS = {
    "ep2 global": f"{MOE} --ep 2 --aux-scope global",
    "ep2 m2 global": f"{MOE} --ep 2 --microbatches 2 --aux-scope global",
    "ep2 sequence": f"{MOE} --ep 2 --aux-scope sequence",
    "dp4 ep2 zero1 global": f"{MOE} --dp 4 --ep 2 --zero 1 --aux-scope global",
    "dp2 cp2 ep2 global": f"{MOE} --dp 2 --cp 2 --ep 2 --aux-scope global",
}


def _world(name: str) -> int:
    return world_size(argv_of(LAYOUTS[name]))


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict[str, dict]:
    return launch_parity(LAYOUTS, world, 5, TOL, "aux-scope")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_the_plain_serial_command(name):
    run = options(argv_of(LAYOUTS[name]))
    plain = 1 if "sequence" in name else run.microbatches
    # the reference is the serial command itself: no extra micro-batches for the data ranks
    assert reference_microbatches(run) in (plain, run.layout.dp * run.microbatches)
    if "global" in name:
        assert reference_microbatches(run) == run.microbatches
    assert_parity(name, _results(_world(name))[name], TOL)


def test_sequence_scope_needs_no_extra_microbatches():
    """A sequence never spans data ranks or micro-batches: the plain serial run (one
    micro-batch) and the dp x m reference give the same step."""
    argv = argv_of(f"{MOE} --aux-scope sequence")
    one = serial_reference(argv, 1, TOL)
    run = options(argv).replace(dp=2, microbatches=2)
    assert reference_microbatches(run) == 4
    four = serial_reference([*argv, "--dp", "2", "--microbatches", "2"], 1, TOL)
    assert max(rel(four["grads"][n], g) for n, g in one["grads"].items()) < TOL


def test_each_data_rank_takes_its_share_of_every_microbatch():
    rows = torch.arange(8)
    assert shard_rows(rows, 0, 2).tolist() == [0, 1, 2, 3]  # today's cut: contiguous
    assert shard_rows(rows, 0, 2, pieces=2).tolist() == [0, 1, 4, 5]
    assert shard_rows(rows, 1, 2, pieces=2).tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_rows(torch.arange(6), 0, 2, pieces=4)


@pytest.mark.parametrize("flags, says", [
    (dict(ep=2), "equals the serial command with --microbatches 2 and no layout flags"),
    (dict(dp=2, microbatches=2), "--microbatches 4"),
    (dict(microbatches=3, global_batch=6), "--microbatches 3"),
    (dict(ep=2, aux_scope="global"), None),
    (dict(ep=2, aux_scope="sequence"), None),
    (dict(ep=2, aux_scope="global", capacity_factor=1.0), "equals no serial command"),
    (dict(), None),
])
def test_edu3d_train_says_which_serial_command_the_run_equals(flags, says):
    warnings = preflight(Run.of(experts=4, topk=2, **flags)).warnings
    notes = [w for w in warnings if "serial command" in w]
    if says is None:
        assert not notes
    else:
        assert len(notes) == 1 and says in notes[0], notes


def test_bad_scopes_are_refused_before_any_rank_starts():
    with pytest.raises(LayoutError, match="--aux-scope 'step': choose one of microbatch, "
                                          "sequence, global"):
        preflight(Run.of(experts=4, aux_scope="step"))
    with pytest.raises(LayoutError, match="--aux-scope needs a mixture of experts"):
        preflight(Run.of(aux_scope="global"))
