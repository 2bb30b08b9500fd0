"""The grader of exercise 04 (``exercises/tp_layers.py``): Megatron's layers on real ranks,
then a tensor-parallel degree and sequence parallelism for a memory budget.

After reading this file you should know what ``exercises/04_tensor_parallel.ipynb`` checks:

* :func:`grade` launches :func:`grade_layers` on 2 tensor-parallel ranks, which runs every
  check of :func:`layer_checks` on the learner's module: the operators ``f`` and ``g`` fed
  rank-valued inputs, the column and row layers and an MLP against ``nn.Linear``, and the
  vocabulary-parallel cross entropy against ``F.cross_entropy`` on a padded vocabulary with
  an ignored token and two confident tokens (logits near 100, whose ``e^z`` overflows fp32
  unless the maximum is subtracted first). Each result is ``None`` or why it failed;
  :func:`verdict` raises that reason for :func:`edu3d.course.grading.check`;
* the design: ``choose_tp(job)`` returns ``(tp, sp)`` for a job of :data:`JOBS`, one replica
  of a GPT per group of ``tp`` GPUs. :func:`cost` counts a GPU's bytes (16 per parameter
  over ``tp``, and every layer's activations by Korthikanti et al.'s formula: without TP
  ``sbh(34 + 5as/h)``, TP ``sbh(10 + 24/t + 5as/(ht))``, TP with sequence parallelism
  ``sbh/t (34 + 5as/h)``) and a step's time: the compute over ``tp`` GPUs plus 4
  all-reduces per layer (or their all-gather and reduce-scatter halves under SP: the same
  ring steps) of the layer's activations, over NVLink inside a node of 8 and InfiniBand
  beyond. The target: the fullest GPU within 90 % of its memory, the step within 5 % of the
  best plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from edu3d.config.layout import Layout
from edu3d.course import grading
from edu3d.course.targets import (Cost, Target, fmt_bytes, fmt_time, meet, plan_line,
                                   target_of)
from edu3d.launch.api import LaunchError, launch
from edu3d.parallel.tp import ops


def layer_checks(ex, group) -> dict:
    """name -> a function that raises (AssertionError with the reason) unless the learner's
    code is right. Rank-valued inputs for the operators; serial layers for the rest."""
    t, r = ops.group_size(group), ops.group_rank(group)

    def close(what, got, want, tol):
        err = (got.detach() - want.detach()).abs().max().item()
        assert err <= tol, f"{what} differs by {err:.2e} on rank {r}"

    def f_operator():
        x = torch.full((3,), float(r + 1), requires_grad=True)
        y = ex.IdentityAllReduce.apply(x, group)
        y.backward(torch.full((3,), float(r + 1)))
        close("forward", y, torch.full((3,), float(r + 1)), 0)
        close("backward (expected the sum over ranks)", x.grad,
              torch.full((3,), t * (t + 1) / 2), 0)

    def g_operator():
        x = torch.full((3,), float(r + 1), requires_grad=True)
        y = ex.AllReduceIdentity.apply(x, group)
        y.backward(torch.full((3,), float(r + 1)))
        close("forward (expected the sum over ranks)", y, torch.full((3,), t * (t + 1) / 2), 0)
        close("backward", x.grad, torch.full((3,), float(r + 1)), 0)
        assert torch.equal(x.detach(), torch.full((3,), float(r + 1))), "x was changed in place"

    def linear_case(kind):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 6)
        x = torch.randn(5, 8, requires_grad=True)
        gy = torch.randn(5, 6)
        (lin(x) * gy).sum().backward()
        if kind == "column":
            w = lin.weight.detach().chunk(t, 0)[r].clone().requires_grad_()
            b = lin.bias.detach().chunk(t, 0)[r].clone().requires_grad_()
            xs = x.detach().clone().requires_grad_()
            y = ex.column_parallel_linear(xs, w, b, group)
            (y * gy.chunk(t, -1)[r]).sum().backward()
            close("output", y, lin(x).chunk(t, -1)[r], 1e-6)
            close("input gradient", xs.grad, x.grad, 1e-6)
            close("weight gradient", w.grad, lin.weight.grad.chunk(t, 0)[r], 1e-6)
            close("bias gradient", b.grad, lin.bias.grad.chunk(t, 0)[r], 1e-6)
        else:
            w = lin.weight.detach().chunk(t, 1)[r].clone().requires_grad_()
            b = lin.bias.detach().clone().requires_grad_()
            xs = x.detach().chunk(t, -1)[r].clone().requires_grad_()
            y = ex.row_parallel_linear(xs, w, b, group)
            (y * gy).sum().backward()
            close("output", y, lin(x), 1e-6)
            close("input gradient", xs.grad, x.grad.chunk(t, -1)[r], 1e-6)
            close("weight gradient", w.grad, lin.weight.grad.chunk(t, 1)[r], 1e-6)
            close("bias gradient", b.grad, lin.bias.grad, 1e-6)

    def mlp():
        torch.manual_seed(1)
        fc, proj = torch.nn.Linear(4, 16), torch.nn.Linear(16, 4)
        x = torch.randn(3, 4, requires_grad=True)
        proj(F.gelu(fc(x))).pow(2).sum().backward()
        xs = x.detach().clone().requires_grad_()
        h = ex.column_parallel_linear(xs, fc.weight.detach().chunk(t, 0)[r],
                                      fc.bias.detach().chunk(t, 0)[r], group)
        y = ex.row_parallel_linear(F.gelu(h), proj.weight.detach().chunk(t, 1)[r],
                                   proj.bias.detach(), group)
        y.pow(2).sum().backward()
        close("MLP output", y, proj(F.gelu(fc(x))), 1e-6)
        close("MLP input gradient", xs.grad, x.grad, 1e-6)

    def cross_entropy(part):
        torch.manual_seed(2)
        vocab = 4 * t + 1  # padded: the last rank holds padding columns
        per = -(-vocab // t)
        logits = torch.randn(7, vocab) * 3
        logits[3:5] += 100.0  # confident tokens: e^100 is infinite in fp32
        target = torch.randint(0, vocab, (7,))
        target[2], target[5] = -100, vocab - 1
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full, target, ignore_index=-100)
        want.backward()
        padded = torch.cat([logits, torch.full((7, per * t - vocab), 5.0)], -1)
        local = padded.chunk(t, -1)[r].clone().requires_grad_()
        got = ex.vocab_parallel_cross_entropy(local, target, group, r * per, vocab)
        if part == "loss":
            close("loss", got, want, 1e-6 * want.item())
            return
        got.backward()
        want_grad = torch.cat([full.grad, torch.zeros(7, per * t - vocab)], -1).chunk(t, -1)[r]
        close("logits gradient", local.grad, want_grad, 1e-6)

    return {"f": f_operator, "g": g_operator, "column": lambda: linear_case("column"),
            "row": lambda: linear_case("row"), "mlp": mlp,
            "ce_loss": lambda: cross_entropy("loss"), "ce_grad": lambda: cross_entropy("grad")}


def grade_layers(mesh) -> dict:
    """Launch target: run every check on the learner's ``tp_layers`` module (the solution
    with ``EDU3D_SOLUTIONS=1``); ``{name: None or why it failed}``. Every rank runs the same
    code, so a stub fails at the same point everywhere and no rank is left in a collective."""
    ex = grading.load("tp_layers")
    out = {}
    for name, check in layer_checks(ex, mesh.tp).items():
        try:
            check()
            out[name] = None
        except Exception as err:  # noqa: BLE001 - reported to the learner, not raised
            out[name] = f"{type(err).__name__}: {err}"
    return out


def grade(nprocs: int = 2, timeout: float = 120) -> dict:
    """Grade exercise 04 on ``nprocs`` tensor-parallel ranks; a run that fails or hangs fails
    every check with its reason."""
    try:
        results = launch(grade_layers, nprocs, layout=Layout(tp=nprocs), timeout=timeout,
                         echo=False).results
    except LaunchError as err:
        return {"run": f"the graded run failed: {str(err)[:400]}"}
    return {name: next((r[name] for r in results if r[name]), None) for name in results[0]}


def verdict(results: dict, name: str) -> None:
    """Raise with the reason if check ``name`` failed (for :func:`edu3d.course.grading.check`)."""
    if "run" in results:
        raise AssertionError(results["run"])
    if results[name]:
        raise AssertionError(results[name])


# ---- the design: a tensor-parallel degree, with or without sequence parallelism -----------------
@dataclass(frozen=True)
class Job:
    params: float
    layers: int
    d_model: int
    heads: int
    seq: int
    gpu_gb: float


JOBS = {"a": Job(2.7e9, 32, 2560, 32, 4096, 40),
        "b": Job(2.7e9, 32, 2560, 32, 6144, 40),
        "c": Job(6.7e9, 32, 4096, 32, 8192, 40)}
FLOPS, ALPHA, NVLINK, INFINIBAND, PER_NODE = 400e12, 5e-6, 150e9, 25e9, 8
USABLE, SLACK = 0.9, 1.05


def activation_bytes(j: Job, tp: int, sp: bool) -> float:
    """One layer's activations for one sequence (16-bit, Korthikanti et al. 2022)."""
    s, h, a = j.seq, j.d_model, j.heads
    if tp == 1:
        return s * h * (34 + 5 * a * s / h)
    if sp:
        return s * h / tp * (34 + 5 * a * s / h)
    return s * h * (10 + 24 / tp + 5 * a * s / (h * tp))


def check_plan(job: str, plan) -> tuple[int, bool]:
    assert isinstance(plan, (tuple, list)) and len(plan) == 2, \
        f"job {job}: choose_tp must return (tp, sp), got {plan!r}"
    tp, sp = int(plan[0]), bool(plan[1])
    heads = JOBS[job].heads
    assert tp >= 1 and heads % tp == 0, \
        f"job {job}: tp={tp} does not divide the {heads} heads"
    return tp, sp


def cost(job: str, plan) -> Cost:
    """Seconds of one sequence's forward and backward, and bytes of one GPU, for
    ``plan = (tp, sp)``."""
    tp, sp = check_plan(job, plan)
    j = JOBS[job]
    size = j.seq * j.d_model * 2  # the activations each collective moves, bf16
    link = NVLINK if tp <= PER_NODE else INFINIBAND
    comm = j.layers * 4 * 2 * (tp - 1) * (ALPHA + size / tp / link)
    return Cost(time=6 * j.params * j.seq / (tp * FLOPS) + comm,
                memory=16 * j.params / tp + j.layers * activation_bytes(j, tp, sp))


def target(job: str) -> Target:
    plans = [(t, sp) for t in (1, 2, 4, 8, 16, 32) for sp in (False, True)]
    return target_of(plans, lambda p: cost(job, p), USABLE * JOBS[job].gpu_gb * 1e9, SLACK)


def check_design(ex, job: str) -> None:
    plan = ex.choose_tp(job)
    meet(f"job {job}: tp {plan[0]}{' with SP' if plan[1] else ''}", cost(job, plan),
         target(job))


def describe(job: str, plan) -> str:
    return plan_line(lambda: cost(job, plan), lambda: target(job), lambda c, t: (
        f"job {job}: tp {plan[0]}, sp {bool(plan[1])}: {fmt_bytes(c.memory)} per GPU (at "
        f"most {fmt_bytes(t.memory)}), {fmt_time(c.time)} per sequence (target "
        f"{fmt_time(t.time)})"))
