"""Every composition of TP, PP and DP/ZeRO equals the serial model.

For each layout (world sizes 2 to 8): the gradients of one step (plain SGD: Adam would hide a
wrong 1/dp or 1/m), the weights after that SGD step, and the losses and gradient norms of 3
AdamW steps, each against the serial reference step (:func:`edu3d.train.loop.train_step`), within
1e-5 relative (fp32). The worst error per layout is printed (``pytest -s``) for the record.
The serial reference does not depend on the layout: it is computed once per model, data and
optimizer, in the test process, and handed to the ranks.
"""

from __future__ import annotations

import functools

import pytest

from edu3d.launch import launch
from edu3d.config.layout import Layout
from tests.workers_3d import parity_many, serial_key, serial_reference

TOL = 1e-5
ADAM_STEPS = 3

LAYOUTS = {
    "dp2-tp2-pp2 1f1b": "--dp 2 --tp 2 --pp 2 --schedule 1f1b --microbatches 4",
    "dp2-tp2-pp2 zero1": "--dp 2 --tp 2 --pp 2 --zero 1 --microbatches 2",
    "dp2 zero2 pp2 gpipe": "--dp 2 --zero 2 --pp 2 --schedule gpipe --microbatches 4",
    "dp2 zero3 tp2": "--dp 2 --zero 3 --tp 2",
    "dp4 zero3 tp2": "--dp 4 --zero 3 --tp 2",
    # HSDP: ZeRO-3 within two replica groups of 2 dp ranks, all-reduced across them
    "dp4 zero3 tp2 sp hsdp2 m2 per-step": "--dp 4 --zero 3 --tp 2 --sp --hsdp 2 "
                                          "--microbatches 2 --grad-reduce per-step",
    "tp2 sp pp2 interleaved vpp2": "--tp 2 --sp --pp 2 --vpp 2 --schedule interleaved "
                                   "--microbatches 4",
    "dp2 pp2 zb-h1": "--dp 2 --pp 2 --schedule zb-h1 --microbatches 4",
    "pp2 tied": "--pp 2 --tie --microbatches 2",
    "tp2 pp2 5 layers": "--tp 2 --pp 2 --layers 5 --microbatches 2",
    "dp2 m4": "--dp 2 --microbatches 4",
    "dp2 zero3 pp2 m4 prefetch": "--dp 2 --zero 3 --pp 2 --microbatches 4 --prefetch",
    "dp2-tp2 sp zero2 tied m2": "--dp 2 --tp 2 --sp --zero 2 --tie --microbatches 2",
    "dp2-tp2-pp2 tied zero1 gpipe": "--dp 2 --tp 2 --pp 2 --tie --zero 1 --schedule gpipe",
    "dp2-tp2-pp2 zero3 tied sp": "--dp 2 --tp 2 --pp 2 --zero 3 --tie --sp --microbatches 2",
    # the V schedules: rank 0 holds the first and the last stage, so one tied matrix there
    "pp2 zbv tied": "--pp 2 --tie --schedule zbv --microbatches 4",
    "dp2 zero1 pp2 zbv tied": "--dp 2 --zero 1 --pp 2 --tie --schedule zbv --microbatches 4",
    "dp2 zero2 pp2 dualpipev tied": "--dp 2 --zero 2 --pp 2 --tie --schedule dualpipev "
                                    "--microbatches 4",
    "tp2 sp pp2 dualpipev": "--tp 2 --sp --pp 2 --schedule dualpipev --microbatches 4",
}


def _layout(argv: list[str]) -> Layout:
    get = {k: int(argv[argv.index(f"--{k}") + 1]) if f"--{k}" in argv else 1
           for k in ("dp", "tp", "pp", "vpp")}
    return Layout(**get)


_SERIAL: dict[tuple, dict] = {}


def _serial(argv: list[str]) -> dict:
    """The serial reference for ``argv``, shared by every layout with the same model, data
    and optimizer (:func:`~tests.workers_3d.serial_key`)."""
    key = serial_key(argv)
    if key not in _SERIAL:
        _SERIAL[key] = serial_reference(argv, ADAM_STEPS)
    return _SERIAL[key]


@functools.lru_cache(maxsize=None)
def _results(layout: Layout) -> dict[str, dict]:
    """Every option set of ``layout``, run in one launch (a launch costs seconds of start-up;
    the layouts sharing a mesh share it)."""
    names = [n for n in LAYOUTS if _layout(LAYOUTS[n].split()) == layout]
    argvs = [LAYOUTS[n].split() for n in names]
    refs = [_serial(argv) for argv in argvs]
    run = launch(parity_many, layout.world_size, args=(argvs, refs),
                 layout=layout, timeout=300, name="parity3d")
    return dict(zip(names, run.results[0]))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_serial(name):
    layout = _layout(LAYOUTS[name].split())
    res = _results(layout)[name]
    print(f"\n{name} (ws {layout.world_size}): grad {res['grad_err']:.1e} "
          f"param {res['param_err']:.1e} loss {res['loss_err']:.1e} norm {res['norm_err']:.1e}")
    assert res["grad_err"] < TOL
    assert res["param_err"] < TOL
    assert res["loss_err"] < TOL
    assert res["norm_err"] < TOL
    assert res["losses"][-1] < res["losses"][0]  # it trains


PAPER_COUNT = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


def test_zero_traffic_under_pipelining_does_not_grow_with_microbatches():
    """dp2 x pp2 with --grad-reduce per-step: from the trace, the dp traffic of one step is
    2Ψ (ZeRO-1, ZeRO-2) and 3Ψ (ZeRO-3) of the rank's stage parameters, for 2 and 4
    micro-batches alike: gradients are reduced once after the last backward, and ZeRO-3
    gathers once for the forwards and once for the backwards, not once per micro-batch."""
    from tests.workers_3d import zero_traffic

    configs = [(s, m) for s in (1, 2, 3) for m in (2, 4)]
    run = launch(zero_traffic, 4, args=(configs,), layout=Layout(dp=2, pp=2), timeout=240,
                 name="zero-traffic")
    events = run.events()
    for rank, rows in enumerate(run.results):
        for row in rows:
            case = f"zero{row['stage']}/m{row['m']}"
            moved = sum(PAPER_COUNT.get(e["op"], 0) * e["bytes"] / 4 for e in events
                        if e.get("case") == case and e["rank"] == rank and e["lane"] == "comm"
                        and e.get("group") == "dp")
            want = (3 if row["stage"] == 3 else 2) * row["psi"]
            print(f"\nrank {rank} {case}: {moved / row['psi']:.4f} Ψ of the stage")
            assert abs(moved / want - 1) < 0.01, (rank, case, moved / row["psi"])
