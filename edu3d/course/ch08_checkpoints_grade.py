"""The grader of exercise 08 (``exercises/reshard.py``): checkpoint pieces of real layouts.

Every case starts from a full serial tensor and cuts it the way a layout's ranks own it, with
the library's placement arithmetic (:func:`edu3d.ckpt.reshard.pieces`): TP boxes (the fused qkv
weight's three row blocks, a row-parallel weight's columns, the vocabulary-parallel
embedding padded to a multiple of tp), then ZeRO's flat windows, which start and end in the
middle of rows. The learner's ``full_tensor`` must rebuild the serial tensor from those
pieces, refuse pieces with a hole, and ``piece_for`` must cut what a rank of *another*
layout loads. Pure index arithmetic: no process is launched, each check takes milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edu3d.ckpt import reshard
from edu3d.course.targets import Cost, Target, fmt_bytes, meet, plan_line, target_of

# (name, full shape, TP spec (dim, parts, true size)) of tensors of the course's GPT
QKV = ("blocks.0.attn.qkv.weight", [96, 32], (0, 3, None))  # column-parallel, fused q|k|v
PROJ = ("blocks.0.attn.proj.weight", [32, 32], (1, 1, None))  # row-parallel: columns
EMB = ("tok_emb.weight", [101, 16], (0, 1, 101))  # vocabulary-parallel, 101 rows padded


def serial(name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def saved_pieces(tensor, tp: int, dp: int = 1, zero: bool = False,
                 dtype: torch.dtype = torch.float32) -> list:
    """``(placement, data)`` of every rank of a ``tp`` x ``dp`` layout: each tp rank's shard,
    cut into ``dp`` uneven ZeRO windows of its flattening when ``zero``; in ``dtype``."""
    name, shape, spec = tensor
    full = serial(name, shape).to(dtype)
    out = []
    for t in range(tp):
        boxes = reshard.tp_boxes(shape, spec, t, tp)
        local = max(hi for _, _, hi in boxes)
        cuts = [0] + [round(local * (k + 0.4) / dp) for k in range(1, dp)] + [local]
        windows = [(cuts[k], cuts[k + 1]) for k in range(dp)] if zero else [None]
        for window in windows:
            for place, _, _ in reshard.pieces(name, "param", shape, spec, t, tp, window):
                out.append((place, reshard.read(full, place)))
    return out


def rebuilds(mod, tensor, tp: int, dp: int = 1, zero: bool = False,
             dtype: torch.dtype = torch.float32) -> bool:
    got = mod.full_tensor(saved_pieces(tensor, tp, dp, zero, dtype))
    want = serial(tensor[0], tensor[1]).to(dtype)
    assert tuple(got.shape) == tuple(want.shape), \
        f"full_tensor returned shape {tuple(got.shape)}, the tensor is {tuple(want.shape)}"
    assert got.dtype == want.dtype, \
        f"full_tensor returned {got.dtype} from {want.dtype} pieces: a bf16 checkpoint must " \
        "load as bf16, not through the default dtype"
    wrong = int((got != want).sum())
    assert not wrong, f"{wrong} of {want.numel()} elements of {tensor[0]} differ from the serial tensor"
    return True


def refuses_a_hole(mod) -> bool:
    pieces = saved_pieces(PROJ, tp=2, dp=2, zero=True)
    try:
        mod.full_tensor(pieces[:1] + pieces[2:])  # one ZeRO shard lost
    except ValueError:
        return True
    raise AssertionError("full_tensor returned a tensor although a shard was missing; raise "
                         "ValueError when an element is covered by no piece")


def loads_into(mod, tensor, tp_from: int, dp_from: int, tp_to: int, dp_to: int = 1) -> bool:
    """Pieces of a tp_from x dp_from ZeRO layout, loaded into every rank of tp_to (x dp_to
    ZeRO: then each rank's piece is a run of its box that may start mid-row)."""
    name, shape, spec = tensor
    full = mod.full_tensor(saved_pieces(tensor, tp_from, dp_from, zero=True))
    want = serial(name, shape)
    targets = [place for place, _ in saved_pieces(tensor, tp_to, dp_to, zero=dp_to > 1)]
    for place in targets:
        got = mod.piece_for(full, place)
        assert torch.equal(got, reshard.read(want, place)), \
            f"piece_for gave the wrong numbers for box {place['box']}, flat {place['flat']} " \
            f"of tp{tp_to} x dp{dp_to}"
    return True


# ---- the design: how often to save, and whether asynchronously ---------------------------------
@dataclass(frozen=True)
class Job:
    step_s: float  # one training step
    save_s: float  # writing one checkpoint to storage
    snapshot_s: float  # copying the state to host memory (what an async save blocks for)
    restart_s: float  # a failure: find it, restart every rank, load the last checkpoint
    mtbf_h: float  # mean time between failures of the whole job
    state_gb: float  # the state one node snapshots
    host_gb: float  # host memory a node can spare for the snapshot


JOBS = {"a": Job(step_s=2.0, save_s=60, snapshot_s=4, restart_s=300, mtbf_h=6, state_gb=800,
                 host_gb=1000),
        "b": Job(step_s=2.0, save_s=60, snapshot_s=4, restart_s=300, mtbf_h=6, state_gb=800,
                 host_gb=512)}
SLACK = 1.01
MAX_EVERY = 4000


def cost(job: str, plan) -> Cost:
    """Expected seconds per step of useful work, and the host bytes of a node's snapshot."""
    j = JOBS[job]
    assert isinstance(plan, dict) and {"every", "async"} <= set(plan), \
        f"job {job}: checkpoint_plan must return a dict with every and async"
    every, asynchronous = int(plan["every"]), bool(plan["async"])
    assert every >= 1, f"job {job}: save every {every} steps: choose at least 1"
    if asynchronous:  # blocks for the snapshot, and waits when the last write is not done
        blocking = j.snapshot_s + max(0.0, j.save_s - every * j.step_s)
    else:
        blocking = j.save_s
    wall = j.step_s + blocking / every  # per step, without failures
    # a failure loses the restart and, on average, half an interval of work; an async save
    # is one write behind: the last finished checkpoint is older by its write
    lost = j.restart_s + every * wall / 2 + (j.save_s if asynchronous else 0.0)
    time = wall * (1 + lost / (j.mtbf_h * 3600))
    return Cost(time=time, memory=j.state_gb * 1e9 if asynchronous else 0.0)


def plans(job: str):
    for every in range(1, MAX_EVERY + 1):
        for asynchronous in (False, True):
            yield {"every": every, "async": asynchronous}


def target(job: str) -> Target:
    return target_of(plans(job), lambda p: cost(job, p), JOBS[job].host_gb * 1e9, SLACK)


def check_design(ex, job: str) -> None:
    plan = ex.checkpoint_plan(job)
    meet(f"job {job}: {plan}", cost(job, plan), target(job), fmt=lambda s: f"{s:.4g} s/step")


def describe(job: str, plan) -> str:
    """What ``plan`` costs next to the target, or why it is no plan."""
    return plan_line(lambda: cost(job, plan), lambda: target(job), lambda c, t: (
        f"job {job}: {plan}: {c.time:.4g} s per useful step (target {t.time:.4g}, "
        f"{JOBS[job].step_s:g} without failures or saves), snapshot "
        f"{fmt_bytes(c.memory)} per node (at most {fmt_bytes(t.memory)})"))
