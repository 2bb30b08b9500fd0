"""The grader of exercise 13 (``exercises/cp_merge.py``): the log-sum-exp merge and the zigzag
split, against :mod:`edu3d.parallel.cp` on cases the learner does not see.

After reading this file you should know what each check proves and which classic mistake it
catches (each raises ``AssertionError`` with one line naming the failing case):

* :func:`check_merge`: partial results over two key blocks merge into the library's answer
  (random rows, fp32 and bf16 inputs, an fp32 result). Averaging the two outputs fails here;
* :func:`check_merge_is_safe`: a row whose block hid every key (``lse = -inf``, output 0),
  a row that saw nothing in either block, and log-sum-exps in the hundreds (``e^lse``
  overflows fp32) all stay finite and exact. Forgetting the ``-inf`` rows gives ``nan``;
* :func:`check_positions`: every rank of cp = 1 .. 8 and several lengths holds the
  library's zigzag positions, in order. The plain split, or the mirror chunk one off
  (``2cp - r``), fails here;
* :func:`check_ring`: both functions together rebuild full causal attention on 4 simulated
  ranks, each merging the blocks of every rank's keys in ring order from an empty start
  (output 0, ``lse = -inf``). Pure tensor arithmetic in one process: each check takes
  milliseconds.

The design (:func:`check_design`): ``cp_plan(job)`` picks the context-parallel degree, its
implementation (ring, all-gather, Ulysses) and the recomputation for a long-sequence job of
:data:`JOBS` (llama2-7b) on its cluster. The planner prices it (:func:`cost`: its predicted
step on the job's nodes and links, and its fullest rank's peak); the target
(:mod:`edu3d.course.targets`): it fits 90 % of a GPU, and its step is within 2 % of the best
plan the planner accepts (every one listed, :func:`plans`: Ulysses only where cp divides the
heads). The implementation decides: job a's best is the ring, job b's Ulysses, each more than
the 2 % ahead of the others, so a plan that keeps one implementation for both fails one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from edu3d.config.sections import Run
from edu3d.course.targets import Cost, Target, meet, plan_line, step_line, target_of
from edu3d.model.shapes import spec_from
from edu3d.parallel.cp import block_attention, merge, positions
from edu3d.plan.estimate import estimate, setup
from edu3d.plan.search import Cluster, step_time

INF = float("-inf")
TOL = 1e-5


def _partials(seed: int, shape=(2, 3, 5, 4), dtype=torch.float32, lse_scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    out_a, out_b = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    lse_a, lse_b = (lse_scale * torch.randn(shape[:-1], generator=g) for _ in range(2))
    return out_a, lse_a, out_b, lse_b


def _compare(name: str, got, want) -> None:
    out, lse = got
    w_out, w_lse = want
    assert out.dtype == torch.float32 and lse.dtype == torch.float32, \
        f"{name}: merge returned {out.dtype} and {lse.dtype}; it must compute in fp32"
    assert tuple(out.shape) == tuple(w_out.shape) and tuple(lse.shape) == tuple(w_lse.shape), \
        f"{name}: shapes {tuple(out.shape)}, {tuple(lse.shape)}; expected " \
        f"{tuple(w_out.shape)}, {tuple(w_lse.shape)}"
    bad = int(out.isnan().sum() + lse.isnan().sum())
    assert not bad, f"{name}: {bad} nan values in the merged result"
    err = float((out - w_out).abs().max())
    assert err <= TOL * (1 + float(w_out.abs().max())), \
        f"{name}: the merged output is off by up to {err:.3g}"
    finite = torch.isfinite(w_lse)
    assert torch.equal(torch.isfinite(lse), finite), \
        f"{name}: the merged lse is -inf exactly where a row saw no key in either block"
    diff = torch.where(finite, lse - w_lse, torch.zeros_like(lse)).abs().max()
    scale = torch.where(finite, w_lse, torch.zeros_like(lse)).abs().max()
    assert float(diff) <= TOL * (1 + float(scale)), f"{name}: the merged lse is wrong"


def check_merge(mod) -> bool:
    for seed, dtype in ((0, torch.float32), (1, torch.float32), (2, torch.bfloat16)):
        parts = _partials(seed, dtype=dtype)
        want = merge(*parts)
        _compare(f"random rows ({str(dtype).split('.')[-1]} outputs)", mod.merge(*parts), want)
    # two partial results of real attention merge into attention over both blocks
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    p = torch.arange(6)
    a = block_attention(q, k[..., :3, :], v[..., :3, :], p, p[:3], 0.5)
    b = block_attention(q, k[..., 3:, :], v[..., 3:, :], p, p[3:], 0.5)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    got = mod.merge(*a, *b)
    err = float((got[0] - full).abs().max())
    assert err <= 1e-5, f"two halves of causal attention merged differ from full attention " \
                        f"by {err:.3g}"
    return True


def check_merge_is_safe(mod) -> bool:
    out_a, lse_a, out_b, lse_b = _partials(4)
    lse_a[..., 0] = INF  # block a hid every key of query 0
    out_a[..., 0, :] = 0
    lse_b[..., 1] = INF  # block b hid every key of query 1
    out_b[..., 1, :] = 0
    _compare("a row one block hid completely", mod.merge(out_a, lse_a, out_b, lse_b),
             merge(out_a, lse_a, out_b, lse_b))
    lse_a[..., 2] = lse_b[..., 2] = INF  # query 2 saw nothing at all so far
    out_a[..., 2, :] = out_b[..., 2, :] = 0
    got = mod.merge(out_a, lse_a, out_b, lse_b)
    _compare("a row that saw no key in either block", got, merge(out_a, lse_a, out_b, lse_b))
    big = _partials(5, lse_scale=1.0)
    big = (big[0], big[1] + 300.0, big[2], big[3] + 300.0)  # e^300 overflows fp32
    _compare("log-sum-exps around 300", mod.merge(*big), merge(*big))
    return True


CASES = [(s, cp) for cp in range(1, 9) for s in (2 * cp, 4 * cp, 6 * cp) if s <= 64] + [(64, 4)]


def check_positions(mod) -> bool:
    for seq_len, cp in CASES:
        for rank in range(cp):
            got = list(mod.zigzag_positions(seq_len, cp, rank))
            want = positions(seq_len, cp, rank, "zigzag")
            assert got == want, f"seq_len={seq_len}, cp={cp}, rank {rank}: expected " \
                                f"{want}, got {got}"
    return True


def check_ring(mod, seq_len: int = 32, cp: int = 4) -> bool:
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, seq_len, 4, generator=g) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    held = [torch.tensor(list(mod.zigzag_positions(seq_len, cp, r))) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq_len)), \
        f"the {cp} ranks' positions do not cover 0 .. {seq_len - 1} exactly once"
    scale = q.shape[-1] ** -0.5
    for r in range(cp):
        mine = held[r]
        out = torch.zeros(2, 2, len(mine), 4)
        lse = torch.full((2, 2, len(mine)), INF)
        for step in range(cp):  # the ring: at step i rank r holds rank (r - i)'s keys
            src = held[(r - step) % cp]
            part = block_attention(q[..., mine, :], k[..., src, :], v[..., src, :], mine, src,
                                   scale)
            out, lse = mod.merge(out, lse, *part)
        err = float((out - full[..., mine, :]).abs().max())
        assert err <= 1e-5, f"rank {r} of cp={cp}: ring attention built with your merge " \
                            f"differs from full attention by {err:.3g}"
    return True


# ---- the design: the cp degree and implementation for a sequence and a memory budget ------------
@dataclass(frozen=True)
class Job:
    """A long-sequence job: ``gpus`` of ``gpu_gb`` hold ``sequences`` a step of ``seq_len``
    tokens (one a micro-batch), ZeRO-3 over ``dp x cp``, bf16 with AdamW; nodes of
    ``per_node`` GPUs (NVLink inside), linked at ``inter_gbps`` GB/s per GPU (None: the H100
    profile's InfiniBand)."""

    seq_len: int
    gpus: int
    gpu_gb: float
    sequences: int
    per_node: int = 8
    inter_gbps: float | None = None


MODEL: dict = {}  # llama2-7b: 32 layers, d_model 4096, 32 heads, each its own K,V
# a: one node: the ring hides its K,V sends under each block's attention, and wins;
# b: the memory needs cp = 8 across two nodes of 4 on a slow link: the ring's cp - 1 sends of
# K,V cross it exposed, Ulysses' all-to-alls carry less: the implementation decides the step
JOBS = {"a": Job(seq_len=32768, gpus=8, gpu_gb=24, sequences=8),
        "b": Job(seq_len=65536, gpus=8, gpu_gb=24, sequences=8, per_node=4, inter_gbps=25.0)}
SLACK = 1.02  # within 2 % of the planner's best plan
IMPLS = ("ring", "allgather", "ulysses")
RECOMPUTE = ("none", "selective", "full")


def spec_of(job: str):
    return spec_from("llama2-7b", seq_len=JOBS[job].seq_len, **MODEL)


def run_of(job: str, plan) -> Run:
    """The planner's run for ``plan`` (``{"cp", "cp_impl", "recompute"}``), or
    ``AssertionError`` saying why it is no plan of the job."""
    j = JOBS[job]
    assert isinstance(plan, dict) and {"cp", "cp_impl", "recompute"} <= set(plan), \
        f"job {job}: cp_plan must return a dict with cp, cp_impl and recompute"
    cp, impl, rec = int(plan["cp"]), plan["cp_impl"], plan["recompute"]
    assert cp >= 1 and j.gpus % cp == 0, f"job {job}: cp={cp} must divide the {j.gpus} GPUs"
    assert impl in IMPLS, f"job {job}: cp_impl is 'ring', 'allgather' or 'ulysses', got {impl!r}"
    assert rec in RECOMPUTE, \
        f"job {job}: recompute is 'none', 'selective' or 'full', got {rec!r}"
    dp = j.gpus // cp
    return setup(dp=dp, cp=cp, cp_impl=impl, zero=3, micro_batch=1,
                 microbatches=j.sequences // dp, recompute=rec, precision="bf16")


def cost(job: str, plan) -> Cost:
    """The planner's step (:func:`~edu3d.plan.search.step_time`) and the fullest rank's
    peak (:func:`~edu3d.plan.estimate.estimate`) for ``plan``."""
    j, spec, run = JOBS[job], spec_of(job), run_of(job, plan)
    try:
        mem = estimate(spec, run)["total_bytes"]
    except ValueError as err:
        raise AssertionError(f"job {job}: the planner refuses {plan}: {err}") from None
    cluster = Cluster(gpus=j.gpus, gpu_mem_gb=j.gpu_gb, gpus_per_node=j.per_node,
                      inter_gbps=j.inter_gbps)
    return Cost(time=step_time(spec, run, cluster)["total"], memory=mem)


def plans(job: str):
    """Every plan the planner accepts: each cp dividing the GPUs, impl, recomputation."""
    j = JOBS[job]
    for cp in (c for c in range(1, j.gpus + 1) if j.gpus % c == 0):
        for impl in IMPLS:
            if impl == "ulysses" and spec_of(job).n_heads % cp:
                continue
            for rec in RECOMPUTE:
                yield {"cp": cp, "cp_impl": impl, "recompute": rec}


@lru_cache(maxsize=None)
def target(job: str) -> Target:
    return target_of(plans(job), lambda p: cost(job, p), 0.9 * JOBS[job].gpu_gb * 1e9, SLACK)


def check_design(ex, job: str) -> None:
    plan = ex.cp_plan(job)
    meet(f"job {job}: {plan}", cost(job, plan), target(job))


def describe(job: str, plan) -> str:
    """What ``plan`` costs next to the target, or why it is no plan."""
    return plan_line(lambda: cost(job, plan), lambda: target(job),
                     lambda c, t: step_line(f"job {job}: {plan}", c, t, "{} on the fullest rank"))
