"""Exercise 12's grader: the learner's router rules against edu3d's own mixture of experts.

After reading this file you should know what the three checks of ``exercises/12_moe_routing``
compare, and why a plausible wrong answer fails each:

* :func:`check_loss_value`: on hidden random routers (``E`` 4 or 8, ``k`` 1, 2 or 4, a few
  dozen tokens, some routers skewed towards one expert), the learner's
  ``load_balancing_loss(probs, expert_idx, E)`` equals the value a real
  :class:`edu3d.model.moe.MoE` layer records for the same tokens (its ``take_stats()["aux"]``).
  Counting the share per *token* instead of per *assignment* is ``k`` times too large when
  ``k > 1``; using the gates instead of the full probabilities gives another number;
* :func:`check_loss_grad`: the gradient the learner's loss sends to the router's weight equals
  the one the layer's own aux term sends (:class:`edu3d.model.moe.AuxLoss` with the main loss'
  gradient set to zero): a loss built on detached probabilities, or one that lets a gradient
  through the counts (a soft count), fails here;
* :func:`check_capacity`: on hidden cases (capacity factors 0.5 to 2 whose capacity is not a
  whole number, gates with ties) the learner's ``capacity_keep(gates, expert_idx, E, C)``
  keeps exactly the assignments :func:`edu3d.model.moe.capacity_keep` keeps. Rounding the
  capacity down keeps one assignment too few per full expert; dropping the latest tokens
  instead of the lowest gates keeps the wrong ones; breaking ties the other way too.

Each failure names the case and what differed, never the formula.

The design (:func:`check_design`): ``moe_plan(job)`` picks the capacity factor and the
expert-parallel degree of a 16-expert, top-2 model (:data:`MODEL`) whose router sends a
rank's assignments as :data:`LOAD` says, for a job of :data:`JOBS` (a drop target and a
memory budget). :func:`cost` prices it with edu3d's own formulas: the capacity
``ceil(T·k/E · C)`` sets every expert's padded buffer, hence the experts' matmuls, the
all-to-all bytes (:func:`edu3d.plan.formulas.ep_bytes`) and the activations
(:func:`edu3d.plan.formulas.moe_mlp_activation_bytes`); ep divides the experts' state. The
target: at most the job's drop share, within its memory, and a step within 2 % of the best
plan (every ep and capacity listed, :func:`plans`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from edu3d.course.targets import (Cost, Target, fmt_bytes, fmt_time, meet, plan_line,
                                   target_of)
from edu3d.model.balance import set_aux_scale
from edu3d.model.gpt import MLP, GPTConfig
from edu3d.model.moe import MoE, capacity_keep, route
from edu3d.plan.estimate import state_bytes
from edu3d.plan.formulas import MoESpec, ep_bytes, moe_mlp_activation_bytes

LOSS_CASES = [(32, 4, 1, 0.0), (32, 4, 2, 0.0), (48, 8, 2, 0.0), (40, 8, 4, 0.0),
              (64, 4, 2, 3.0), (24, 8, 1, 3.0), (36, 8, 2, 6.0)]  # tokens, E, k, skew
CAP_CASES = [(10, 4, 2, 1.25), (13, 4, 2, 1.0), (24, 8, 2, 0.5), (30, 4, 1, 1.1),
             (17, 8, 4, 0.75), (40, 4, 2, 2.0), (9, 4, 2, 0.3)]  # tokens, E, k, C
# the exercise's printed example: 6 tokens, k = 2, E = 4, C = 1 (room for 3 per expert)
CAP_EXAMPLE = (torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5], [0.9, 0.1], [0.5, 0.5],
                             [0.8, 0.2]]),
               torch.tensor([[0, 1], [0, 2], [0, 1], [0, 3], [0, 2], [1, 0]]))


def _router_case(n: int, E: int, k: int, skew: float, seed: int):
    """A real MoE layer (d_model 16, aux coefficient 1) and ``n`` tokens for it; ``skew``
    adds a bias towards expert 0 to the router, so some cases are far from balanced."""
    config = GPTConfig(n_layers=1, n_heads=1, d_model=16, seq_len=max(n, 8), vocab_size=8,
                       n_experts=E, topk=k, aux_loss_coef=1.0, z_loss_coef=0.0)
    torch.manual_seed(seed)
    layer = MoE(config, MLP)
    x = torch.randn(1, n, 16)
    with torch.no_grad():
        layer.router.weight[0] += skew * x[0].mean(0) / x[0].mean(0).norm().clamp_min(1e-6)
    return layer, x


def _probs(layer: MoE, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.reshape(-1, x.shape[-1]) @ weight.t()).softmax(-1)


def check_loss_value(mod) -> bool:
    """The learner's loss equals the layer's recorded aux loss on every hidden case."""
    for i, (n, E, k, skew) in enumerate(LOSS_CASES):
        layer, x = _router_case(n, E, k, skew, seed=100 + i)
        with torch.no_grad():
            layer(x)
            want = layer.take_stats()["aux"]
            probs = _probs(layer, x, layer.router.weight)
            idx, _ = route(probs, k)
            got = mod.load_balancing_loss(probs, idx, E)
        assert isinstance(got, torch.Tensor) and got.numel() == 1, \
            f"load_balancing_loss returned {type(got).__name__}, not a one-number tensor"
        assert abs(float(got) - want) <= 1e-5 * max(1.0, abs(want)), \
            f"{n} tokens, E={E}, k={k}: your loss is {float(got):.5f}, edu3d's layer " \
            f"recorded {want:.5f}"
    return True


def check_loss_grad(mod) -> bool:
    """The learner's loss moves the router's weight exactly as the layer's aux term does."""
    set_aux_scale(1.0)
    for i, (n, E, k, skew) in enumerate(LOSS_CASES):
        layer, x = _router_case(n, E, k, skew, seed=200 + i)
        out = layer(x)
        (out * 0).sum().backward()  # only the aux term reaches the router
        want = layer.router.weight.grad.clone()
        weight = layer.router.weight.detach().clone().requires_grad_(True)
        probs = _probs(layer, x, weight)
        idx, _ = route(probs.detach(), k)
        loss = mod.load_balancing_loss(probs, idx, E)
        assert loss.requires_grad, "your loss has no gradient: the router could not learn " \
                                   "from it (keep the probabilities in the graph)"
        loss.backward()
        err = float((weight.grad - want).abs().max())
        assert err <= 1e-5 * max(1.0, float(want.abs().max())), \
            f"{n} tokens, E={E}, k={k}: the router's gradient from your loss differs from " \
            f"edu3d's by up to {err:.2e}"
    return True


def _cap_case(n: int, E: int, k: int, seed: int):
    """Gates ``[n, k]`` (some tied: rounded to quarters) and ``k`` different experts per
    token, a few experts more popular than others."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, E, generator=g) + torch.linspace(0.6, 0, E)
    idx = torch.topk(scores, k, dim=-1).indices
    gates = (torch.rand(n, k, generator=g) * 4).round() / 4 + 0.25
    return gates, idx


def library_keep(gates: torch.Tensor, idx: torch.Tensor, E: int, C: float) -> torch.Tensor:
    """What edu3d's layer keeps: :func:`edu3d.model.moe.capacity_keep` on the flattened
    assignments, token ``n``'s ``k`` assignments in a row."""
    n, k = gates.shape
    capacity = math.ceil(n * k / E * C)
    token = torch.arange(n).repeat_interleave(k)
    return capacity_keep(gates.flatten(), idx.flatten(), token, E, capacity).view(n, k)


def check_capacity(mod) -> bool:
    """The learner keeps exactly the assignments edu3d keeps, on every hidden case."""
    for i, (n, E, k, C) in enumerate(CAP_CASES):
        gates, idx = _cap_case(n, E, k, seed=300 + i)
        want = library_keep(gates, idx, E, C)
        got = mod.capacity_keep(gates.clone(), idx.clone(), E, C)
        got = torch.as_tensor(got)
        assert got.shape == want.shape, \
            f"{n} tokens, E={E}, k={k}: capacity_keep returned shape {tuple(got.shape)}, " \
            f"expected {tuple(want.shape)} (one flag per assignment)"
        got = got.bool()
        for e in range(E):
            mine, ref = got[idx == e], want[idx == e]
            if int(mine.sum()) != int(ref.sum()):
                raise AssertionError(
                    f"{n} tokens, E={E}, k={k}, C={C}: expert {e} keeps {int(mine.sum())} of "
                    f"its {len(ref)} assignments, edu3d keeps {int(ref.sum())}")
            if not torch.equal(mine, ref):
                rows = (idx == e).nonzero()[:, 0]
                wrong = [int(r) for r, a, b in zip(rows, mine, ref) if a != b]
                raise AssertionError(
                    f"{n} tokens, E={E}, k={k}, C={C}: expert {e} keeps the right number but "
                    f"not the right assignments (tokens {wrong[:4]} differ)")
    return True


# ---- the design: capacity factor and ep degree for a drop rate and a memory budget --------------
@dataclass(frozen=True)
class Job:
    drop: float  # the largest share of the assignments the experts may drop
    memory_gb: float  # what one rank may hold


MODEL = MoESpec("moe-4b", 16, 2048, 16, 4096, 32000, d_ff=2816, mlp="swiglu", norm="rmsnorm",
                bias=False, learned_pos=False, experts=16, topk=2)
TOKENS = 4096  # one sequence a rank per micro-batch
LOAD = (1100, 820, 700, 640, 600, 560, 520, 500, 470, 440, 400, 380, 340, 300, 240, 182)
GPUS, EPS = 8, (1, 2, 4, 8)  # one node; ep divides both the GPUs and the 16 experts
FLOPS, A2A_GBS, REST_GB = 400e12, 100.0, 12.0  # experts' matmul rate, all-to-all, the rest
JOBS = {"a": Job(drop=0.02, memory_gb=64), "b": Job(drop=0.0, memory_gb=40)}
SLACK = 1.02


def capacity(factor: float) -> int:
    """Assignments one expert keeps of a rank's micro-batch: ``ceil(T·k/E · C)``."""
    return math.ceil(TOKENS * MODEL.topk / MODEL.experts * factor)


def dropped(factor: float) -> float:
    """The share of the :data:`LOAD` assignments that no expert keeps."""
    cap = capacity(factor)
    return sum(max(0, n - cap) for n in LOAD) / (TOKENS * MODEL.topk)


def _plan(job: str, plan) -> tuple[float, int]:
    assert isinstance(plan, dict) and {"capacity_factor", "ep"} <= set(plan), \
        f"job {job}: moe_plan must return a dict with capacity_factor and ep"
    factor, ep = float(plan["capacity_factor"]), int(plan["ep"])
    assert factor > 0, f"job {job}: a capacity factor of {factor} keeps nothing"
    assert ep in EPS, f"job {job}: ep={ep}: choose 1, 2, 4 or 8 (it divides 8 GPUs and 16 experts)"
    return factor, ep


def cost(job: str, plan) -> Cost:
    """A step's expert time (their matmuls on every padded slot, the four all-to-alls of
    :func:`edu3d.plan.formulas.ep_bytes`) and the rank's bytes (the routed experts' state
    at 16 bytes a parameter, the MoE halves' activations of
    :func:`edu3d.plan.formulas.moe_mlp_activation_bytes`, the rest)."""
    factor, ep = _plan(job, plan)
    slots = MODEL.experts * capacity(factor)  # every expert's buffer, padded, on every rank
    spec = dataclasses.replace(MODEL, capacity_factor=slots / (TOKENS * MODEL.topk))
    h, layers = MODEL.d_model, MODEL.moe_layers
    matmuls = 18 * h * MODEL.e_ff * slots / FLOPS  # SwiGLU's 3 matrices, forward + backward
    a2a = ep_bytes(TOKENS, slots / TOKENS, h, ep) / (A2A_GBS * 1e9)
    weights, grads, optimizer = state_bytes("bf16")
    state = (weights + grads + optimizer) * layers * sum(k for _, k, _ in spec.expert_tensors(ep))
    acts = layers * moe_mlp_activation_bytes(spec, TOKENS, 1)
    return Cost(time=layers * (matmuls + a2a), memory=state + acts + REST_GB * 1e9)


def plans(job: str):
    """Every plan that meets the drop target: each ep, each capacity up to the busiest
    expert's load (beyond it nothing more is kept), as the factor that rounds up to it."""
    per_fair = TOKENS * MODEL.topk / MODEL.experts
    for ep in EPS:
        for cap in range(1, max(LOAD) + 1):
            factor = (cap - 0.5) / per_fair
            if dropped(factor) <= JOBS[job].drop:
                yield {"capacity_factor": factor, "ep": ep}


@functools.cache
def target(job: str) -> Target:
    return target_of(plans(job), lambda p: cost(job, p), JOBS[job].memory_gb * 1e9, SLACK)


def check_design(ex, job: str) -> None:
    plan = ex.moe_plan(job)
    what = f"job {job}: {plan}"
    c = cost(job, plan)
    lost, most = dropped(float(plan["capacity_factor"])), JOBS[job].drop
    assert lost <= most, f"{what}: the experts drop {lost:.2%} of the assignments, more than " \
                         f"the {most:.0%} allowed"
    meet(what, c, target(job))


def describe(job: str, plan) -> str:
    """What ``plan`` costs next to the target, or why it is no plan."""
    def line(c: Cost, t: Target) -> str:
        factor = float(plan["capacity_factor"])
        return (f"job {job}: {plan}: capacity {capacity(factor)} a rank, drops "
                f"{dropped(factor):.2%} (at most {JOBS[job].drop:.0%}); experts' step "
                f"{fmt_time(c.time)} (target {fmt_time(t.time)}), {fmt_bytes(c.memory)} a rank "
                f"(at most {fmt_bytes(t.memory)})")
    return plan_line(lambda: cost(job, plan), lambda: target(job), line)
