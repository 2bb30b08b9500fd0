"""Context and expert parallelism equal the serial model, on the one Trainer.

Every layout below, in fp32 with the routers scored in float64: the gradients of one
plain-SGD backward (Adam would hide a wrong divisor) and the global gradient norm, the
weights after that SGD step, the losses and norms of 5 AdamW steps and the weights after
them, each within 1e-5 relative of :func:`edu3d.train.loop.serial_step` run micro-batch by
micro-batch as the layout's ranks see the batch (a mixture of experts' load-balancing loss
and capacity count the tokens of one micro-batch). After AdamW, beyond what rounding can do
there: AdamW divides each gradient by its own root mean square, so an entry whose gradients
are all ~0 turns float noise into a large move, which then spreads; :mod:`tests.adamw_noise`
derives, entry by entry, how far noise the gradient checks accept can move each weight.
Layouts of one world size share one launch; the serial references are computed here, in the
test process.

Model: 2 layers, d_model 32, 4 heads, sequence 16, vocabulary 64; MoE: 4 experts, top-2.
"""

from __future__ import annotations

import functools

import pytest

from tests.workers_5d import MOE, argv_of, assert_parity, launch_parity, world_size

TOL = 1e-5
ADAM_STEPS = 5

LAYOUTS = {
    # expert parallelism: dropless and capacity 1.0, each balancing mode
    "ep2": f"{MOE} --ep 2",
    "ep4 capacity1": f"{MOE} --ep 4 --capacity-factor 1.0",
    "dp2 ep2 bias": f"{MOE} --dp 2 --ep 2 --balance bias --aux-loss-coef 0",
    "dp2 ep2 tp2 zloss": f"{MOE} --dp 2 --ep 2 --tp 2 --z-loss-coef 1e-2",
    "ep2 pp2 m2 shared": f"{MOE} --ep 2 --pp 2 --microbatches 2 --shared-experts 1",
    "dp4 ep2 zero1 capacity1": f"{MOE} --dp 4 --ep 2 --zero 1 --capacity-factor 1.0",
    "dp4 ep2 m2": f"{MOE} --dp 4 --ep 2 --microbatches 2",
    # context parallelism
    "cp2 ring": "--cp 2",
    "cp4 ring": "--cp 4",
    "cp4 allgather": "--cp 4 --cp-impl allgather",
    "cp4 ulysses": "--cp 4 --cp-impl ulysses",
    "cp2 plain": "--cp 2 --cp-split plain",
    "dp2 cp2 tp2": "--dp 2 --cp 2 --tp 2",
    "cp2 pp2": "--cp 2 --pp 2 --microbatches 2",
    "dp2 cp2 zero3 recompute": "--dp 2 --cp 2 --zero 3 --recompute selective",
    # HSDP: ZeRO within replica groups (a group: the cp pair; dp4's dp/2 x cp), all-reduced
    # across; the experts' shards within edp/2 ranks
    "dp2 cp2 zero3 hsdp2 m2": "--dp 2 --cp 2 --zero 3 --hsdp 2 --microbatches 2",
    "dp4 ep2 zero2 hsdp2 m2 per-step": f"{MOE} --dp 4 --ep 2 --zero 2 --hsdp 2 --microbatches 2 "
                                       "--grad-reduce per-step",
    "dp4 cp2 ep2 zero3 hsdp2": f"{MOE} --dp 4 --cp 2 --ep 2 --zero 3 --hsdp 2",
    "dp4 pp2 zero1 hsdp2 tied m2": "--dp 4 --pp 2 --zero 1 --hsdp 2 --tie --microbatches 2",
    "cp2 ep2 capacity1": f"{MOE} --cp 2 --ep 2 --capacity-factor 1.0",
    # four axes with experts
    "dp2 cp2 tp2 ep2": f"{MOE} --dp 2 --cp 2 --tp 2 --ep 2",
    # chapter 13's capstone layout (8 ranks): its notebook compares only losses, 1e-4
    "dp2 cp2 pp2 ep2": f"{MOE} --dp 2 --cp 2 --pp 2 --ep 2",
}


def _world(name: str) -> int:
    return world_size(argv_of(LAYOUTS[name]))


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict[str, dict]:
    """Every layout of ``world`` ranks, in one launch."""
    return launch_parity(LAYOUTS, world, ADAM_STEPS, TOL, "parity5d")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_serial(name):
    res = _results(_world(name))[name]
    assert_parity(f"{name} (ws {_world(name)})", res, TOL)
    if "--experts" in LAYOUTS[name]:
        rec = res["record"]
        tokens = 8 * 16  # the global batch's tokens
        assert sum(rec["tokens_per_expert"]) == tokens * 2
        assert rec["aux_loss"] > 0.5 and rec["dropped"] >= 0
        if "--ep" in LAYOUTS[name]:
            assert len(rec["ep_tokens"]) == int(LAYOUTS[name].split("--ep ")[1].split()[0])


def test_expert_divisor_is_dp_times_cp():
    """Experts' gradients summed over edp, divided by dp x cp: dividing by edp instead
    (a bug public frameworks shipped) makes them ep times too large, and the test sees it."""
    res = _results(4)
    wrong = [r["wrong_divisor_err"] for r in res.values() if "wrong_divisor_err" in r]
    assert wrong, "no layout with edp > 1 and plain DP ran"
    assert min(wrong) > 0.1
