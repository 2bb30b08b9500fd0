"""The pipeline engine equals the serial model.

For every schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1), pp in {2, 4} (8 for GPipe and
1F1B, m = pp only) and m in {pp, 2pp} (and 4pp at pp = 2: more micro-batches than twice the stages take
the same code path, only longer), with a layer count that divides into the stages and one that
does not: the gradients after one step (plain SGD: Adam would hide a wrong 1/m) and the
weights after 3 AdamW steps equal the serial GPT's within 1e-5 relative (fp32; after AdamW,
beyond what rounding can do there: tests/adamw_noise.py), and so does the loss rank 0
reports. One launch per world size runs every configuration; the serial
reference is computed once per model and global batch, in the test process. The measured
peak of in-flight micro-batches is m for GPipe and at most p for 1F1B and ZB-H1.

The V-shaped schedules (ZBV, DualPipeV: two chunks per rank, rank r holding stages r and
2p-1-r) run fewer cases in the same launches (V_CONFIGS: a ZBV whose m is too small to fill
its V, both at m = 2p and 4p, even and uneven layers); their measured peak is the checker's,
2p chunk activations for ZBV and 2p+1 for DualPipeV once m >= 2p (DeepSeek's table: PP+1).
"""

from __future__ import annotations

import pytest

from edu3d.launch import launch
from edu3d.config.layout import Layout
from edu3d.schedules.actions import build
from edu3d.schedules.check import check
from tests.pp_workers import TOL, global_batch, parity, serial_reference

ADAM_STEPS = 3
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def configs(pp: int, schedules=SCHEDULES):
    """Every schedule x m in {pp, 2pp} (and 4pp for pp = 2) x an even and an uneven layer
    count."""
    out = []
    for s in schedules:
        stages = pp * (2 if s == "interleaved" else 1)
        for m in (pp, 2 * pp, 4 * pp)[:3 if pp == 2 else 2]:
            for layers in (stages, stages + 1):
                out.append(dict(schedule=s, m=m, layers=layers,
                                vpp=2 if s == "interleaved" else 1))
    return out


V_CONFIGS = {  # pp -> (schedule, m, layers): the V-shaped schedules' cases
    2: [("zbv", 2, 5), ("zbv", 4, 4), ("dualpipev", 4, 5), ("dualpipev", 8, 4)],
    4: [("zbv", 4, 8), ("zbv", 8, 9), ("dualpipev", 8, 8)],
}


def v_configs(pp: int) -> list[dict]:
    return [dict(schedule=s, m=m, layers=n) for s, m, n in V_CONFIGS.get(pp, [])]


def merged(results: list[list[dict]]) -> list[dict]:
    """Per config, the worst error over ranks."""
    rows = []
    for per_rank in zip(*results):
        row = dict(per_rank[0])
        for key in ("grad_err", "weight_err", "loss_err", "norm_err"):
            row[key] = max(r[key] for r in per_rank)
        row["peak_in_flight"] = [r["peak_in_flight"] for r in per_rank]
        rows.append(row)
    return rows


def run(pp: int, dp: int = 1, schedules=SCHEDULES, cfgs=None) -> list[dict]:
    cfgs = cfgs or configs(pp, schedules)
    refs = [serial_reference(c["layers"], global_batch(c, dp), ADAM_STEPS) for c in cfgs]
    res = launch(parity, pp * dp, args=(cfgs, refs, ADAM_STEPS),
                 layout=Layout(pp=pp, dp=dp), timeout=600, echo=False)
    return merged(res.results)


def assert_parity(rows: list[dict], pp: int) -> None:
    for r in rows:  # shown with pytest -s: the numbers behind the claim
        print(f"pp={pp} {r['schedule']:<11} m={r['m']:<2} layers={r['layers']:<2} "
              f"grad {r['grad_err']:.1e} adamw-weights {r['weight_err']:.1e} "
              f"loss {r['loss_err']:.1e} peak in-flight {r['peak_in_flight']}")
    bad = [r for r in rows if max(r["grad_err"], r["weight_err"], r["loss_err"],
                                  r["norm_err"]) > TOL]
    assert not bad, "\n".join(map(str, bad))
    for r in rows:
        if r["schedule"] == "gpipe":
            assert r["peak_in_flight"] == [r["m"]] * pp
        if r["schedule"] in ("1f1b", "zb-h1"):
            assert max(r["peak_in_flight"]) <= pp
        if r["schedule"] in ("zbv", "dualpipev"):  # world ranks: pp index = rank // dp
            want = check(build(r["schedule"], pp, r["m"]), pp, r["m"], 2, "v").peak_in_flight
            per = len(r["peak_in_flight"]) // pp
            assert r["peak_in_flight"] == [want[i // per] for i in range(pp * per)]


# The 8-rank test first: the 2- and 4-rank launches after it then run on its idle warm pool
# (edu3d.launch.warm.pool: a larger idle pool runs a smaller job) instead of starting pools of their own.
@pytest.mark.slow
def test_pp8_gpipe_and_1f1b():
    cfgs = [c for c in configs(8, ("gpipe", "1f1b")) if c["m"] == 8]  # m = pp: 8 ranks, 2 cores
    assert_parity(run(8, cfgs=cfgs), 8)


def test_pp2_every_schedule():
    assert_parity(run(2, cfgs=configs(2) + v_configs(2)), 2)


def test_pp4_every_schedule():
    assert_parity(run(4, cfgs=configs(4) + v_configs(4)), 4)


def test_pp2_with_data_parallel_sync():
    cfgs = [dict(schedule=s, m=4, layers=5, vpp=2 if s == "interleaved" else 1)
            for s in ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")]
    assert_parity(run(2, dp=2, cfgs=cfgs), 2)


def test_trainer_reproduces_edu3d_train():
    """``edu3d train --pp 2 --vpp 2 --schedule interleaved --microbatches 4``, as the lead wires
    it through the Trainer: every rank reports the serial run's loss and gradient norm."""
    from edu3d.commands.train import parse
    from edu3d.train.loop import run
    from tests.pp_workers import train_records

    model = ["--layers", "4", "--heads", "2", "--d-model", "32", "--seq", "16", "--vocab", "64",
             "--global-batch", "8", "--lr", "1e-3", "--warmup", "10"]
    steps = 5
    serial = run(parse(model + ["--steps",
                                                                               str(steps)]),
                 out=open("/dev/null", "w"))
    res = launch(train_records, 2, args=(model + ["--schedule", "interleaved",
                                                  "--microbatches", "4"], steps),
                 layout=Layout(pp=2, vpp=2), timeout=240, echo=False)
    for per_rank in res.results:
        for got, ref in zip(per_rank, serial, strict=True):
            assert abs(got["loss"] - ref["loss"]) <= TOL * ref["loss"]
            assert abs(got["grad_norm"] - ref["grad_norm"]) <= TOL * ref["grad_norm"]
