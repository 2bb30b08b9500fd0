"""Pipeline schedules as data: generators, checker, simulator, partitioning, ``edu3d schedule``.

Pure Python and fast. The compute order is compared with PyTorch's own generators
(``torch.distributed.pipelining.schedules``), called on stub objects so no stage runs.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from edu3d.model.gpt import config_from
from edu3d.schedules import partition as part
from edu3d.schedules.check import ScheduleError, check
from edu3d.commands.schedule import schedule_main
from edu3d.schedules.actions import (SCHEDULES, Action, build, chunks, compute_order,
                                     format_torch, parse_torch, placement, stage_rank, stages_of)
from edu3d.schedules.simulate import Costs, bubble_formula, simulate

CASES = [(pp, m) for pp in (2, 4, 8) for m in (pp, 2 * pp, 4 * pp)]


def torch_order(name: str, pp: int, m: int, vpp: int = 1) -> list[list[str]]:
    """PyTorch's per-rank compute order, idle slots and REDUCE_GRAD left out; an overlapped
    pair (DualPipeV's ``OVERLAP_F_B``) as its forward, then its backward, the order
    PyTorch's runtime executes them in."""
    from torch.distributed.pipelining import schedules as S

    if name == "gpipe":
        order = S.ScheduleGPipe._get_pipeline_order(
            SimpleNamespace(_num_stages=pp, _n_microbatches=m))
    elif name in ("zbv", "dualpipev"):
        cls = S.ScheduleZBVZeroBubble if name == "zbv" else S.ScheduleDualPipeV
        stub = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
        order = {r: [sub for a in cls._calculate_single_rank_operations(stub, r)
                     if a is not None for sub in (a.sub_actions or (a,))] for r in range(pp)}
    else:
        rounds = max(1, m // pp)
        stub = SimpleNamespace(n_local_stages=vpp, pp_group_size=pp, _n_microbatches=m,
                               number_of_rounds=rounds, microbatches_per_round=m // rounds)
        order = {r: S.ScheduleInterleaved1F1B._calculate_single_rank_operations(stub, r)
                 for r in range(pp)}
    return [[str(a) for a in order[r] if a is not None and a.computation_type.value in "FBIW"]
            for r in range(pp)]


def _strs(order):
    return [[str(a) for a in ops] for ops in order]


@pytest.mark.parametrize("pp,m", CASES + [(2, 3), (4, 6)])
def test_gpipe_matches_pytorch(pp, m):
    assert _strs(compute_order("gpipe", pp, m)) == torch_order("gpipe", pp, m)


@pytest.mark.parametrize("vpp", [2, 3])
@pytest.mark.parametrize("pp,m", CASES + [(4, 6), (2, 6)])
def test_interleaved_matches_pytorch(pp, m, vpp):
    assert _strs(compute_order("interleaved", pp, m, vpp)) == torch_order("interleaved", pp, m,
                                                                          vpp)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("pp,m", CASES + [(1, 2), (3, 5), (3, 7), (4, 3), (4, 9), (8, 11)])
def test_v_schedules_match_pytorch(name, pp, m):
    if name == "dualpipev" and m < 2 * pp:
        with pytest.raises(ValueError, match="at least 2\\*pp"):  # PyTorch refuses it too
            compute_order(name, pp, m)
        return
    assert _strs(compute_order(name, pp, m)) == torch_order(name, pp, m)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_v_placement_matches_pytorch(pp):
    """Rank r holds stages r and 2p-1-r; the round robin of the others is PyTorch's too."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for style in ("loop", "v"):
        mapping = generate_stage_to_rank_mapping(pp, 2 * pp, style=style)
        assert [stage_rank(s, pp, style) for s in range(2 * pp)] == [mapping[s] for s in
                                                                      range(2 * pp)]
    assert [stages_of(r, pp, 2 * pp, "v") for r in range(pp)] == [[r, 2 * pp - 1 - r]
                                                                    for r in range(pp)]


@pytest.mark.parametrize("pp,m", CASES + [(4, 3), (3, 7)])
def test_1f1b_follows_megatron_rule(pp, m):
    for r, ops in enumerate(compute_order("1f1b", pp, m)):
        w = min(pp - r - 1, m)
        kinds = "".join(a.kind for a in ops)
        assert kinds == "F" * w + "FB" * (m - w) + "B" * w
        assert [a.mb for a in ops if a.kind == "F"] == list(range(m))
        assert [a.mb for a in ops if a.kind == "B"] == list(range(m))


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("pp,m", CASES + [(3, 5)])
def test_every_schedule_checks(name, pp, m):
    vpp = chunks(name, 2)
    if name == "dualpipev" and m < 2 * pp:
        return  # refused (test_v_schedules_match_pytorch)
    report = check(build(name, pp, m, vpp), pp, m, vpp, placement(name))
    if name == "gpipe":
        assert report.peak_in_flight == [m] * pp
    if name == "1f1b":
        assert report.peak_in_flight == [min(pp - r, m) for r in range(pp)]
        assert max(report.peak_in_flight) <= pp
    if name == "zb-h1":
        assert max(report.peak_in_flight) <= pp
    if name in ("zbv", "dualpipev"):  # chunk activations, each half a stage of 1F1B's
        full = [2 * pp + (name == "dualpipev")] * pp  # DeepSeek's table: PP (stages) + 1
        assert report.peak_in_flight == full if m >= 2 * pp else max(report.peak_in_flight) <= 2 * pp


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("pp,m", CASES)
def test_simulated_bubble_equals_formula(name, pp, m):
    vpp = 2 if name == "interleaved" else 1
    sim = simulate(build(name, pp, m, vpp), pp, Costs(F=1, B=2))
    assert sim.bubble == pytest.approx(bubble_formula(name, pp, m, vpp), abs=1e-9)


def test_v_schedules_bubble_equals_formula():
    """With F = I = W per chunk, the replay of ZBV and DualPipeV idles exactly what
    bubble_formula says, for every p <= 8 and m <= 3p + 2 either schedule runs."""
    ones = Costs(F=1, B=2, I=1, W=1)
    for name in ("zbv", "dualpipev"):
        for pp in (1, 2, 3, 4, 8):
            for m in range(2 * pp if name == "dualpipev" else 1, 3 * pp + 3):
                sim = simulate(build(name, pp, m), pp, ones)
                assert sim.bubble == pytest.approx(bubble_formula(name, pp, m), abs=1e-9), \
                    (name, pp, m)
    # for the same model (a chunk is half a stage): half of ZB-H1's, a sixth of 1F1B's idle
    zb_h1 = simulate(build("zb-h1", 4, 32), 4, ones).bubble
    assert bubble_formula("zbv", 4, 32) == pytest.approx(3 / (6 * 32 + 3))
    assert zb_h1 == pytest.approx(3 / (3 * 32 + 3)) and bubble_formula("1f1b", 4, 32) == 3 / 35


def test_v_checker_knows_the_placement():
    """The V's lists are wrong under round robin (stage 2p-1 is not rank p-1's), and a V
    list whose turn is sent as a message is wrong under the V."""
    good = build("zbv", 2, 4)
    assert check(good, 2, 4, 2, "v").peak_in_flight == [4, 4]
    with pytest.raises(ScheduleError, match="lives on rank"):
        check(good, 2, 4, 2)
    with pytest.raises(ScheduleError, match="nobody sends"):
        turn = [good[0], [a for a in good[1] if a.kind != "SEND_F" or a.stage != 1]
                + [Action(2, "RECV_F", 0)]]
        check(turn, 2, 4, 2, "v")


@pytest.mark.parametrize("pp,m", CASES)
def test_zero_bubble_is_about_a_third(pp, m):
    ones = Costs(F=1, B=2, I=1, W=1)
    zb = simulate(build("zb-h1", pp, m), pp, ones).bubble
    assert zb < 0.5 * simulate(build("1f1b", pp, m), pp, ones).bubble


def test_simulated_memory_and_p2p():
    sim = simulate(build("gpipe", 4, 8), 4, Costs(p2p=0.5), activation_bytes=[10.0] * 4)
    assert sim.peak_activation_bytes == [80.0] * 4
    sim = simulate(build("1f1b", 4, 8), 4, Costs(p2p=0.5), activation_bytes=[10.0] * 4)
    assert sim.peak_activation_bytes == [40.0, 30.0, 20.0, 10.0]
    assert all(e.get("sim") for e in sim.events)
    # with latency the bubble grows past the formula
    assert sim.bubble > bubble_formula("1f1b", 4, 8)


def test_checker_catches_errors():
    good = build("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="deadlock"):
        swapped = [list(good[0]), list(good[1])]
        i = swapped[1].index(Action(1, "RECV_F", 0))
        j = swapped[1].index(Action(1, "B", 1))
        swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
        check(swapped, 2, 2)
    with pytest.raises(ScheduleError, match="never receives"):
        check([good[0], [a for a in good[1] if a != Action(1, "RECV_F", 1)]], 2, 2)
    with pytest.raises(ScheduleError, match="never runs"):
        check([[a for a in good[0] if a.mb != 1], good[1]], 2, 2)
    with pytest.raises(ScheduleError, match="lives on rank"):
        check([good[1], good[0]], 2, 2)


def test_action_notation_round_trips():
    actions = build("zb-h1", 4, 8)
    assert parse_torch(format_torch(actions)) == actions
    assert str(Action(2, "SEND_F", 3)) == "2SEND_F3"
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("F3")


def test_partition_uniform_and_balanced():
    assert part.uniform(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(ValueError, match="at least one layer"):
        part.uniform(3, 4)
    # a head as heavy as two layers pushes layers away from the last stage
    assert part.balanced([1.0] * 6, 3, 0.0, 2.0) == [(0, 3), (3, 5), (5, 6)]
    assert part.balanced([1.0] * 6, 3) == [(0, 2), (2, 4), (4, 6)]
    # rebalance from measured per-layer times
    cfg = config_from("tiny", layers=6)
    cut = part.partition(cfg, 2, measured=[3.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert cut == [(0, 2), (2, 6)]
    emb, blocks, head = part.layer_costs(config_from("small"))
    parts = part.partition(config_from("small"), 3, method="balanced")
    costs = part.stage_costs(parts, blocks, emb, head)
    assert max(costs) <= max(part.stage_costs(part.uniform(6, 3), blocks, emb, head))
    assert len(part.partition(cfg, 2, vpp=3)) == 6


def test_partition_ends_is_weighed_by_the_planner_and_refused_by_the_trainer():
    """'ends': the embedding and the head each take a layer's place (Llama 3, DeepSpeed)."""
    assert part.uniform(10, 4, ends=True) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert part.uniform(2, 4, ends=True) == [(0, 0), (0, 1), (1, 2), (2, 2)]
    with pytest.raises(ValueError, match="layer, the embedding or the head"):
        part.uniform(2, 5, ends=True)
    from edu3d.config.layout import LayoutError
    from edu3d.config.sections import Run
    from edu3d.plan.estimate import estimate_for as estimate
    from edu3d.train.preflight import check_args
    run = Run.of(model="tiny", layers=4, pp=2, global_batch=4, microbatches=2, partition="ends")
    with pytest.raises(LayoutError, match="'ends' .* is a cut the planner weighs"):
        check_args(run)
    with pytest.raises(LayoutError, match="partition 'middle': the trainer cuts"):
        check_args(run.replace(partition="middle"))
    assert estimate(run)  # the planner weighs it
    with pytest.raises(ValueError, match="partition='middle': choose one of uniform, "
                                         "balanced, ends"):
        estimate(run.replace(partition="middle"))


def test_schedule_command(capsys):
    assert schedule_main(["--name", "1f1b", "--pp", "2", "--microbatches", "4",
                          "--format", "torch"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("rank 0: 0F0 0SEND_F0")
    assert parse_torch("\n".join(lines)) == build("1f1b", 2, 4)
    assert schedule_main(["--name", "interleaved", "--pp", "2", "--vpp", "2",
                          "--microbatches", "4", "--format", "json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["bubble_simulated"] == pytest.approx(info["bubble_formula"])
    assert schedule_main(["--name", "zb-h1", "--pp", "4", "-m", "8", "--format", "table"]) == 0
    assert "peak in-flight" in capsys.readouterr().out
    assert schedule_main(["--name", "gpipe", "--pp", "2", "-m", "2", "--vpp", "2"]) == 2
    for name in ("zbv", "dualpipev"):
        assert schedule_main(["--name", name, "--pp", "2", "-m", "4", "--format", "json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["vpp"] == 2 and info["actions"][0][0] == "0F0" and "3F0" in info["actions"][0]
        assert info["bubble_simulated"] == pytest.approx(info["bubble_formula"])
    assert schedule_main(["--name", "dualpipev", "--pp", "4", "-m", "4"]) == 2
    assert "at least 2*pp = 8" in capsys.readouterr().err


def test_replay_with_measured_durations():
    """Costs.measured gives single actions their own time: equal times reproduce the formula,
    one slow backward on the last stage stretches everybody's step."""
    actions = build("1f1b", 2, 4)
    even = {(a.stage, a.kind, a.mb): (1.0 if a.kind == "F" else 2.0)
            for ops in actions for a in ops if a.is_compute}
    assert simulate(actions, 2, Costs(measured=even)).bubble == pytest.approx(
        bubble_formula("1f1b", 2, 4))
    slow = {**even, (1, "B", 0): 6.0}
    sim = simulate(actions, 2, Costs(measured=slow))
    assert sim.makespan == simulate(actions, 2, Costs(measured=even)).makespan + 4.0
    assert sim.bubble > bubble_formula("1f1b", 2, 4)
