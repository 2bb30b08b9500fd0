"""ZeRO-2/3 with micro-batches: gradients reduced per micro-batch (the default, DeepSpeed's and
FSDP2's) or once per step (Megatron's distributed optimizer), issue 26.

* both modes equal the serial step (gradients of one step, the weights after one plain-SGD
  step, 3 AdamW steps; 1e-5 relative) at 1, 2 and 4 micro-batches, ZeRO-2 and ZeRO-3, on
  dp2 and on dp2 x pp2;
* a run's records show the mode: per micro-batch a rank's gradients peak at the 1/N shard
  (and ZeRO-3's parameters at their shards), per step at the full gradients plus the shard
  (ZeRO-3: every unit gathered), to the byte; the bytes each rank sends per step follow
  ``m`` exactly as the ring costs say; under ZeRO-1 ``--grad-reduce`` changes nothing;
* ``Zero`` as a library on a plain model with its own micro-batch loop: per micro-batch the
  user marks nothing, per step every backward but the last runs inside ``no_sync()``; both
  equal one process, and ``no_sync()`` refuses per micro-batch at stages 2-3;
* ``--impl torch`` maps the modes onto FSDP2's calls and equals serial in both;
* a bad ``--grad-reduce`` is refused before any process starts, and so is per micro-batch
  under ``--impl torch --pp`` (torch's pipelining reduces once per step);
* HSDP (``--hsdp 2`` on dp4: two replica groups of 2, in the 4-rank launch): both modes at
  ZeRO-1, 2, 3 equal the serial step; the bytes each rank sends per step over its shard
  group and across the groups (from the trace) equal
  :func:`edu3d.plan.zero_modes.hsdp_wire_bytes` to the byte, and the peak memory by category
  the planner's (shards of 1/2, not 1/4); ``Zero(model, shard_group,
  replicate_group=...)`` in a user's loop equals one process.
"""

from __future__ import annotations

import functools

import pytest

from edu3d.commands.train import parse
from edu3d.config.layout import Layout
from edu3d.distributed.trace import wire_bytes
from edu3d.launch import launch
from edu3d.plan import estimate as plan_memory
from edu3d.plan.zero_modes import hsdp_wire_bytes
from edu3d.production.torch_check import unsupported
from edu3d.parallel.zero.sharding import GRAD_REDUCE
from edu3d.train.preflight import GRAD_REDUCE as OPTION_VALUES
from tests.test_impl_torch import rounding_spread
from tests.workers_3d import options, serial_key, serial_reference
from tests.workers_zero_grad_reduce import library_cases, torch_cases, trainer_cases

TOL = 1e-5
LIB_TOL = 1e-7  # a few float32 ulps (the library model has a float32 head)
MODES = ("per-microbatch", "per-step")


def _cases(prefix: str, base: str, ms: tuple) -> dict:
    """name -> argv for ZeRO-2 and 3, each m, both modes (m = 1: one mode, they coincide)."""
    out = {}
    for stage in (2, 3):
        for m in ms:
            for mode in MODES[:1] if m == 1 else MODES:
                out[f"{prefix} zero{stage} m{m} {mode}"] = (
                    f"{base} --zero {stage} --microbatches {m} --grad-reduce {mode}".split())
    return out


HSDP = "--dp 4 --hsdp 2"  # two replica groups of two ranks: [0,1][2,3], across [0,2][1,3]
PARITY = {2: _cases("dp2", "--dp 2", (1, 2, 4)),
          4: {**_cases("dp2 pp2", "--dp 2 --pp 2", (2, 4)),
              **{f"dp4 hsdp2 zero{s} m2 {mode}": f"{HSDP} --zero {s} --microbatches 2 "
                 f"--grad-reduce {mode}".split() for s in (1, 2, 3) for mode in MODES
                 if s > 1 or mode == "per-step"}}}
MEASURE = {2: {f"zero{s} m{m} {mode}": f"--dp 2 --zero {s} --microbatches {m} --grad-reduce "
               f"{mode}".split() for s in (1, 2, 3) for m in (1, 2, 4) for mode in MODES
               if s > 1 or m == 2},
           4: {f"hsdp2 zero{s} m{m} {mode}": f"{HSDP} --zero {s} --microbatches {m} "
               f"--grad-reduce {mode}".split() for s in (2, 3) for m in (1, 2)
               for mode in (MODES if m > 1 else MODES[:1])}}

_SERIAL: dict = {}


def _serial(argv):
    key = serial_key(argv)
    if key not in _SERIAL:
        _SERIAL[key] = serial_reference(argv, 3)
    return _SERIAL[key]


# 4 ranks first: the 2-rank launches then run on its idle warm pool (edu3d.launch.warm)
@functools.lru_cache(maxsize=None)
def launched(world: int):
    cases = list(PARITY[world].items())
    layout = Layout(dp=2, pp=world // 2)
    return launch(trainer_cases, world, args=(cases, [_serial(a) for _, a in cases],
                                              list(MEASURE[world].items()), world == 4),
                  layout=layout, timeout=400, name="grad-reduce", echo=False)


def results(world: int) -> dict:
    return launched(world).results[0]


@pytest.mark.parametrize("world", [4, 2])
def test_both_modes_equal_serial(world):
    res = results(world)
    for name in PARITY[world]:
        r = res[name]
        errs = {k: r[k] for k in ("grad_err", "param_err", "loss_err", "norm_err")}
        print(f"\n{name}: " + " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        assert max(errs.values()) < TOL, (name, errs)
        assert r["losses"][-1] < r["losses"][0]


def test_records_show_each_modes_memory_and_bytes_on_the_wire():
    """From ``Trainer.stats()`` after one step on dp2 (fp32, 4 bytes an element)."""
    res = results(2)
    for s in (2, 3):
        for m in (1, 2, 4):
            for mode in MODES:
                r = res[f"zero{s} m{m} {mode}"]
                shard, padded = 4 * r["shard"], 4 * r["padded"]
                mem, wire = r["mem"], r["wire"]
                per_mb = mode == "per-microbatch" or m == 1
                print(f"\nzero{s} m{m} {mode}: grads {mem['grads']} (shard {shard}), params "
                      f"{mem['params']}, wire {wire}")
                # per step: every parameter's full gradient beside the shard
                assert mem["grads"] == shard + (0 if per_mb else 4 * r["numel"])
                if s == 2:  # the full flat buffer; the shard is a view of it
                    assert mem["params"] == padded
                else:  # the shards, and per step every unit gathered between forwards
                    assert mem["params"] == shard + (0 if per_mb else padded)
                ring = padded // 2  # (n - 1) / n of the unit buffers, n = 2
                assert wire["reduce_scatter"] == (m if per_mb else 1) * ring
                gathers = 1 if s == 2 else (2 * m if per_mb else 2)
                assert wire["all_gather"] == gathers * ring
    one = {mode: res[f"zero1 m2 {mode}"] for mode in MODES}
    assert one["per-microbatch"] == one["per-step"]  # ZeRO-1 has no choice


def test_hsdp_bytes_per_group_and_memory_equal_the_planners():
    """dp4 with two replica groups of 2, one step (fp32: 4 bytes a value): every rank sends
    ZeRO's bytes over its 2-rank shard group (m reduce-scatters or one, ZeRO-3's gathers)
    and one all-reduce of its gradient shard across the groups, to the byte; its peak memory
    is the planner's, whose shards are 1/2 of the flat units (not 1/4)."""
    run = launched(4)
    sent: dict = {}
    for e in run.events():
        if e["lane"] == "comm" and e.get("group") in ("shard", "replicate") and "case" in e:
            key = (e["case"], e["rank"], e["group"])
            sent[key] = sent.get(key, 0.0) + wire_bytes(e)
    cats = ("params", "grads", "optimizer")
    for name, argv in MEASURE[4].items():
        stage, m, mode = int(name.split()[1][4:]), int(name.split()[2][1:]), name.split()[3]
        for rank in range(4):
            r = run.results[rank][name]
            want = hsdp_wire_bytes(r["padded"], 2, 2, stage, mode, m, 4, 4)
            got = {g: sent.get((name, rank, g), 0.0) for g in ("shard", "replicate")}
            print(f"\n{name} rank {rank}: measured {got} formula {want}")
            assert got == pytest.approx(want, abs=0.5), (name, rank)
            assert want["replicate"] == 4 * r["shard"]  # 2(R-1)/R = 1 of the 4-byte shard
        st = options(argv)
        spec = plan_memory.spec_of(st)
        planned = max((plan_memory.state_per_rank(spec, st, 0, i, at="peak") for i in range(4)),
                      key=lambda d: sum(d.values()))
        mem = run.results[0][name]["mem"]  # the fullest rank's, on every rank
        assert {c: mem[c] for c in cats} == {c: planned[c] for c in cats}, name


def test_hsdp_as_a_library_equals_one_process():
    """``Zero(model, shard_group, stage, replicate_group=...)`` in a user's loop of 2
    micro-batches on 4 ranks, AdamW and SGD with momentum, every stage and mode."""
    lib = results(4)["hsdp library"]
    assert len(lib) == 2 * 3 * 2, sorted(lib)
    print(f"\nlargest |HSDP zero - one process|: {max(lib.values()):.1e}")
    assert max(lib.values()) < LIB_TOL, {k: v for k, v in lib.items() if v >= LIB_TOL}


def test_zero_as_a_library_marks_microbatches_in_either_mode():
    res = launch(library_cases, 2, timeout=240, name="grad-reduce-lib", echo=False).results
    for rank_res in res:
        errs = {k: v for k, v in rank_res.items() if isinstance(v, float)}
        assert len(errs) == 2 * 3 * 3 * 2, sorted(errs)
        print(f"\nlargest |zero - one process|: {max(errs.values()):.1e}")
        # measured: <= 1.2e-16 (float64 parts); 1.5e-8 for the float32 head per micro-batch
        # (its shard sums the micro-batches' reduced halves, another order: one float32 ulp)
        assert max(errs.values()) < LIB_TOL, {k: v for k, v in errs.items() if v >= LIB_TOL}
        n = rank_res["n_params"]  # .grad set after each of 4 micro-batches' backward:
        for s in (2, 3):
            assert rank_res[f"zero{s}/per-microbatch/kept"] == [0] * 4  # only the shard
            assert rank_res[f"zero{s}/per-step/kept"] == [n, n, n, 0]  # full until the last
        assert rank_res["zero1/per-microbatch/kept"] == rank_res["zero1/per-step/kept"]
        assert rank_res["zero1/no_sync"] == "ran"
        for s in (2, 3):
            assert "grad_reduce='per-step'" in rank_res[f"zero{s}/no_sync"]
        assert "per-batch" in rank_res["bad_mode"]


def test_impl_torch_maps_both_modes_onto_fsdp2():
    """Both modes equal serial on FSDP2, and FSDP2 does what each mode says (m = 2): per
    micro-batch m times the reduce-scatters of per step; ZeRO-3 also m times the all-gathers
    (resharded after every forward and backward), ZeRO-2 the same (whole parameters)."""
    argvs = [f"--dp 2 --zero {s} --microbatches 2 --grad-reduce {mode}".split()
             for s in (2, 3) for mode in MODES]
    res = launch(torch_cases, 2, args=(argvs, 3), timeout=300, name="grad-reduce-torch",
                 echo=False).results[0]
    for argv in argvs:
        r = res[" ".join(argv)]
        errs = {k: r[k] for k in ("grad_err", "sgd_norm_err", "sgd_loss2_err",
                                  "adam_loss_err_serial", "adam_norm_err_serial")}
        print(f"\n{' '.join(argv)}: " + " ".join(f"{k} {v:.1e}" for k, v in errs.items())
              + f" FSDP2 calls {r['calls']}")
        spread = rounding_spread(tuple(argv), 3)  # what rounding does through AdamW,
        noise = r["grad_err"] / TOL  # in proportion to the layout's own gradient noise
        allowed = {"adam_loss_err_serial": noise * spread["loss"],
                   "adam_norm_err_serial": noise * spread["grad_norm"]}
        assert all(v < TOL + allowed.get(k, 0.0) for k, v in errs.items()), errs
    for s in (2, 3):
        per_mb, per_step = (res[f"--dp 2 --zero {s} --microbatches 2 --grad-reduce {mode}"]
                            ["calls"] for mode in MODES)
        assert per_step["reduce_scatter_single"] > 0
        assert per_mb["reduce_scatter_single"] == 2 * per_step["reduce_scatter_single"]
        gathers = 2 if s == 3 else 1  # ZeRO-3 gathers per micro-batch, ZeRO-2 per step
        assert per_mb["all_gather_single"] == gathers * per_step["all_gather_single"]


def test_the_modes_are_one_list_and_per_microbatch_is_the_default():
    """(The refusals, a bad mode and per-microbatch under torch's pipelining, are cases of
    tests/test_train_layouts.py::test_bad_layouts_fail_before_any_process.)"""
    assert GRAD_REDUCE == OPTION_VALUES == MODES
    ok = parse("--dp 2 --pp 2 --zero 3 --impl torch --grad-reduce per-step".split())
    assert unsupported(ok) is None
    assert parse([]).parallel.grad_reduce == "per-microbatch"
