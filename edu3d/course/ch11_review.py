"""Chapter 11's review: the classic questions on 3D parallelism, each checked by edu3d itself.

After reading this file you should be able to answer, with numbers, what an interviewer
asks about distributed training, and know where in edu3d each answer comes from:

* every :class:`Question` holds its ``truth``: a function that computes the answer with
  edu3d's own code (the ring's transfer plan :func:`edu3d.distributed.algorithms.ring_plan`, ZeRO's
  :func:`edu3d.plan.formulas.zero_bytes`, Korthikanti's count
  :func:`edu3d.plan.formulas.activation_bytes_per_layer`, the schedule simulator
  :func:`edu3d.schedules.simulate.simulate`, the planner :mod:`edu3d.plan.estimate` and
  :mod:`edu3d.plan.search`). Only the questions of judgement (which collective, when) have a
  fixed choice;
* :func:`check` grades a learner's answer (a number within ``tol``, a letter, a set, a small
  dict) with :func:`edu3d.course.grading.check`: one ``PASS``/``FAIL`` line; a pass reveals
  the question's *why*, a failure adds one hint that names the part that is off and the
  chapter that shows it, never the answer nor its reasoning (:func:`why` reveals that on
  request). The notebook ships its answers blank (``...``); with ``EDU3D_SOLUTIONS=1`` the
  reference answers of ``solutions/review_answers.py`` are graded instead, as the exercises'
  solutions are (:func:`edu3d.course.grading.load`);
* every question names its ``chapter``, its ``picture``: the knobs of the quiz panel
  (``widgets/panels/ch11_review.py``) that draw it, and its ``subject``: what that picture's
  title (or takeaway) says, so a question never sits under another question's picture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from edu3d.course import grading
from edu3d.distributed.algorithms import ring_plan
from edu3d.model.shapes import spec_from
from edu3d.plan.estimate import setup, estimate, in_flight
from edu3d.plan.formulas import activation_bytes_per_layer as act
from edu3d.plan.formulas import zero_bytes
from edu3d.plan.kernels import layer
from edu3d.plan.recipes import recipe_of
from edu3d.plan.search import Cluster, search, traffic
from edu3d.plan.stage_costs import cut_of
from edu3d.schedules import bubble_formula, build, simulate

GB = 1e9
MB = 1e6


@dataclass(frozen=True)
class Question:
    key: str
    topic: str  # DP, ZeRO, TP/SP, PP, memory, layout
    title: str  # the check's verdict line (stable: nbval compares it)
    ask: str  # the question, as the notebook states it
    truth: Callable[[], object]
    why: str  # what to reconsider (the hint of a wrong answer)
    chapter: str  # notebook file of the chapter that shows it
    picture: dict = field(default_factory=dict)  # the quiz panel's knobs for it
    subject: str = ""  # what the question is about: the words its picture's title says
    tol: float = 0.02  # relative tolerance of numbers
    wrong: object = None  # a classic wrong answer (the tests check it fails)


# ---- the truths, computed by edu3d ---------------------------------------------------------------
def ring_gb_sent(n: int = 8, size_gb: float = 1.0) -> float:
    """GB one rank sends in a ring all-reduce of ``size_gb``: its transfers in edu3d's plan
    (:func:`edu3d.distributed.algorithms.ring_plan`), each one chunk of ``size/n``."""
    return sum(t.src == 0 for t in ring_plan(n)) * size_gb / n


def zero_gb(psi: float = 7.5e9, n: int = 64) -> dict[int, float]:
    """GB per GPU of mixed-precision Adam's state for ZeRO stages 0-3 (2 + 2 + 12 bytes)."""
    return {s: round(zero_bytes(psi, n, s, 2, 2, 12)["total"] / GB, 1) for s in range(4)}


def zero_sharded() -> dict[int, set[str]]:
    """Which of params/grads/optimizer each ZeRO stage divides by the dp degree."""
    return {s: {c for c in ("params", "grads", "optimizer")
                if zero_bytes(1, 2, s)[c] < zero_bytes(1, 1, s)[c]} for s in (1, 2, 3)}


def _llama(name: str = "llama2-13b"):
    return spec_from(name)


def zero_traffic_gb(name: str = "llama2-7b", n: int = 8) -> dict[int, float]:
    """GB one rank sends per step over the data-parallel group of ``n`` for ZeRO stages 0-3,
    in bytes the planner counts (:func:`edu3d.plan.search.traffic`), at one micro-batch (the
    paper's count: reducing every one of m micro-batches, m times)."""
    spec = _llama(name)
    return {z: traffic(spec, setup(dp=n, zero=z, microbatches=1, precision="bf16"))["dp"] / GB
            for z in range(4)}


def zero3_traffic_ratio() -> float:
    """ZeRO-3's data-parallel traffic per step over plain DP's (:func:`zero_traffic_gb`)."""
    t = zero_traffic_gb("llama2-7b", 8)
    return t[3] / t[0]


def state_gb(name: str = "llama2-7b") -> float:
    """Mixed-precision Adam's state of a model on one GPU, the planner's count: 2 + 2 + 12
    bytes per parameter (and Adam's step counters)."""
    est = estimate(_llama(name), setup(precision="bf16"), at="rest")
    return sum(est[f"{c}_bytes"] for c in ("params", "grads", "optimizer")) / GB


def gpt3_layer_mb() -> dict[str, float]:
    """One GPT-3 175B layer's activations (s=2048, b=1, 16-bit), MB: serial, TP t=8, TP+SP."""
    sp = _llama("gpt3-175b")
    s, h, a = sp.seq_len, sp.d_model, sp.n_heads
    return {"none": act(s, 1, h, a) / MB, "tp": act(s, 1, h, a, t=8) / MB,
            "tp+sp": act(s, 1, h, a, t=8, sp=True) / MB}


def selective_saving(name: str = "llama2-7b") -> float:
    """Share of a 16-bit layer's activations that selective recomputation drops."""
    sp = _llama(name)
    kw = dict(d_ff=sp.ff, kv_heads=sp.kv_heads, mlp=sp.mlp)
    full = act(sp.seq_len, 1, sp.d_model, sp.n_heads, **kw)
    return 1 - act(sp.seq_len, 1, sp.d_model, sp.n_heads, recompute="selective", **kw) / full


def tp_all_reduces() -> int:
    """All-reduces per layer and micro-batch (forward + backward) that the performance model
    charges tensor parallelism (:func:`edu3d.plan.kernels.layer`'s collectives, tp 8)."""
    spec = _llama("llama2-7b")
    st = setup(tp=8, microbatches=4, precision="bf16")
    _, comms = layer(cut_of(spec, st, recipe_of("edu3d")), "none")
    return sum(c.steps for c in comms if c.axis == "tp" and c.kind == "all_reduce")


@lru_cache(maxsize=1024)
def bubble(schedule: str, pp: int, m: int, vpp: int = 1) -> float:
    """The simulated bubble fraction (F = 1, B = 2, I = W = 1, free messages)."""
    v = vpp if schedule == "interleaved" else 1
    return simulate(build(schedule, pp, m, v), pp).bubble


def in_flight_first(pp: int = 4, m: int = 8) -> dict[str, int]:
    """Micro-batches whose activations the first stage holds at its peak, per schedule."""
    return {s: in_flight(s, pp, m)[0] for s in ("gpipe", "1f1b")}


def micro_batches_for(target: float = 0.10, pp: int = 8) -> int:
    """The fewest micro-batches that bring 1F1B's bubble to ``target`` or below."""
    return next(m for m in range(1, 10_000) if bubble_formula("1f1b", pp, m) <= target)


def fits_one_gpu(name: str = "llama2-7b", gpu_gb: float = 80) -> bool:
    """Whether the planner's peak for ``name`` on one GPU (bf16, selective recomputation,
    8 micro-batches of one sequence) is within 90% of ``gpu_gb``."""
    est = estimate(_llama(name), setup(precision="bf16", microbatches=8,
                                       recompute="selective"))
    return est["total_bytes"] <= 0.9 * gpu_gb * GB


@lru_cache(maxsize=16)
def plan(name: str, gpus: int) -> tuple[dict, ...]:
    """The planner's ranking for ``name`` on ``gpus`` H100s of 80 GB (fitting first, fastest
    first): :func:`edu3d.plan.search.search`, kept for the panel's redraws."""
    return tuple(search(_llama(name), Cluster(gpus)))


def planned_layout(name: str = "llama2-13b", gpus: int = 16) -> dict[str, int]:
    """The planner's fastest layout that fits (``edu3d plan --model NAME --gpus G``)."""
    st = plan(name, gpus)[0]["setup"]
    return {"dp": st.layout.dp, "tp": st.layout.tp, "pp": st.layout.pp}


# ---- the bank --------------------------------------------------------------------------------------
QUESTIONS: tuple[Question, ...] = (
    Question(
        "ring", "DP", "Q1 ring all-reduce: GB each rank sends",
        "A data-parallel group of **N = 8** ranks all-reduces a **1 GB** gradient with a ring. "
        "How many GB does each rank send? (a number)",
        ring_gb_sent,
        "a ring all-reduce is a reduce-scatter then an all-gather, each N-1 steps of one "
        "chunk of S/N: 2(N-1)/N·S per rank, almost independent of N",
        "01_collectives.ipynb", {"picture": "ring", "n": 8}, wrong=1.0,
        subject="ring all-reduce"),
    Question(
        "dp_when", "DP", "Q2 what DDP communicates, and when",
        "What does DDP communicate, and when? **a** the parameters, before each forward; "
        "**b** the gradients, all-reduced in buckets during the backward; **c** the "
        "activations, after every layer; **d** the optimizer state, after the step. "
        "(a letter)",
        lambda: "b",
        "every replica holds the whole model; only the gradients differ, and each bucket is "
        "all-reduced as soon as its gradients are ready, overlapping the rest of the backward",
        "02_data_parallel.ipynb", {"picture": "ddp", "n": 8}, wrong="a",
        subject="what DDP communicates, and when"),
    Question(
        "zero_gb", "ZeRO", "Q3 ZeRO stages 0-3: GB per GPU of the model state",
        "The ZeRO paper's example: **Ψ = 7.5 B** parameters, **N = 64** data-parallel GPUs, "
        "mixed-precision Adam. GB per GPU of weights + gradients + optimizer state for "
        "stages 0, 1, 2, 3? (a dict `{0: ..., 1: ..., 2: ..., 3: ...}`)",
        zero_gb,
        "16Ψ without ZeRO; stage 1 shards the optimizer state (4Ψ + 12Ψ/N), stage 2 also the "
        "gradients (2Ψ + 14Ψ/N), stage 3 also the weights (16Ψ/N)",
        "03_zero.ipynb", {"picture": "zero", "model": "llama2-7b", "n": 64},
        wrong={0: 120.0, 1: 30.0, 2: 15.0, 3: 1.9}, subject="state per GPU"),
    Question(
        "zero_shards", "ZeRO", "Q4 what each ZeRO stage shards",
        "Which of `\"params\"`, `\"grads\"`, `\"optimizer\"` does each ZeRO stage divide over the "
        "data-parallel ranks? (a dict `{1: {...}, 2: {...}, 3: {...}}` of sets)",
        zero_sharded,
        "the stages add up: 1 the optimizer state, 2 also the gradients, 3 also the weights",
        "03_zero.ipynb", {"picture": "zero", "model": "llama2-7b", "n": 8},
        wrong={1: {"optimizer"}, 2: {"grads"}, 3: {"params"}},
        subject="each stage shards one more category"),
    Question(
        "zero_traffic", "ZeRO", "Q5 ZeRO-3's traffic over plain DP's",
        "Per step, how many times the data-parallel traffic of plain DP does ZeRO-3 move? "
        "(a number)",
        zero3_traffic_ratio,
        "DP, ZeRO-1 and ZeRO-2 move 2Ψ (a reduce-scatter and an all-gather); ZeRO-3 gathers "
        "the weights again for the backward: 3Ψ",
        "03_zero.ipynb", {"picture": "zero_traffic", "model": "llama2-7b", "n": 8},
        wrong=2.0, subject="data-parallel traffic"),
    Question(
        "state_16psi", "memory", "Q6 LLaMA-2 7B's training state in GB",
        "How many GB do LLaMA-2 7B's weights, gradients and Adam state take in mixed "
        "precision, before any activation? (a number)",
        state_gb,
        "2 + 2 + 12 = 16 bytes per parameter (bf16 weights and gradients, fp32 master weights "
        "and two moments) times its 6.74 B parameters",
        "07_memory.ipynb", {"picture": "zero", "model": "llama2-7b", "n": 1}, wrong=13.5,
        subject="state per GPU"),
    Question(
        "activations", "TP/SP", "Q7 a GPT-3 layer's activations: serial, TP, TP+SP",
        "One GPT-3 175B layer (s = 2048, b = 1, h = 12288, a = 96, 16-bit): MB of activations "
        "kept for the backward serially, with TP t = 8, and with TP + SP t = 8? "
        "(a dict `{\"none\": ..., \"tp\": ..., \"tp+sp\": ...}`)",
        gpt3_layer_mb,
        "Korthikanti et al.: sbh(34 + 5as/h) serially, sbh(10 + 24/t + 5as/(ht)) with TP (10 "
        "stay whole: LayerNorm, QKV and MLP inputs, dropout masks), sbh/t(34 + 5as/h) with SP",
        "07_memory.ipynb", {"picture": "activations", "model": "gpt3-175b"},
        wrong={"none": 2869.0, "tp": 358.6, "tp+sp": 358.6},
        subject="one layer's activations"),
    Question(
        "selective", "memory", "Q8 what selective recomputation saves",
        "LLaMA-2 7B at s = 4096: which share of a layer's activations does selective "
        "recomputation (recomputing the attention core) drop? (a fraction between 0 and 1)",
        selective_saving,
        "selective recomputation drops the 5as/h term (scores, softmax, its mask), which grows "
        "with s: at 4096 tokens it is most of the layer",
        "07_memory.ipynb", {"picture": "activations", "model": "llama2-7b"}, wrong=0.1,
        subject="selective recomputation"),
    Question(
        "tp_comm", "TP/SP", "Q9 TP's all-reduces per layer and micro-batch",
        "Megatron tensor parallelism without SP: how many all-reduces does one layer issue per "
        "micro-batch, forward and backward together? (a whole number)",
        tp_all_reduces,
        "one after attention's row-parallel projection and one after the MLP's in the forward "
        "(the conjugate f/g operators), and their two mirrors in the backward",
        "04_tensor_parallel.ipynb", {"picture": "tp", "model": "llama2-7b", "gpus": 16},
        tol=0.0, wrong=2, subject="all-reduces per layer"),
    Question(
        "bubble_1f1b", "PP", "Q10 1F1B's bubble at p=4, m=8",
        "1F1B with **p = 4** stages and **m = 8** micro-batches: which fraction of the step is "
        "the bubble? (a fraction)",
        lambda: bubble("1f1b", 4, 8),
        "the bubble is (p-1)/(m+p-1) of the step for GPipe and 1F1B: p-1 slots of warm-up and "
        "cool-down beside m of work",
        "05_pipeline_parallel.ipynb", {"picture": "bubble", "schedule": "1f1b", "pp": 4, "m": 8},
        wrong=3 / 8, subject="1f1b, p = 4"),
    Question(
        "bubble_interleaved", "PP", "Q11 interleaved 1F1B's bubble at p=4, m=8, v=2",
        "Interleaved 1F1B with **v = 2** chunks per rank, p = 4, m = 8: the bubble fraction? "
        "(a fraction)",
        lambda: bubble("interleaved", 4, 8, 2),
        "v chunks per rank make every slot v times shorter: (p-1)/(v·m+p-1), paid for with v "
        "times more point-to-point messages",
        "05_pipeline_parallel.ipynb",
        {"picture": "bubble", "schedule": "interleaved", "pp": 4, "m": 8}, wrong=3 / 11,
        subject="interleaved, p = 4"),
    Question(
        "zb_ratio", "PP", "Q12 ZB-H1's bubble over 1F1B's",
        "Zero-bubble ZB-H1 splits each backward into its input gradient (I) and its weight "
        "gradient (W). With F = I = W, p = 4, m = 8: ZB-H1's bubble divided by 1F1B's? "
        "(a number)",
        lambda: bubble("zb-h1", 4, 8) / bubble("1f1b", 4, 8),
        "nobody waits for a W, so ZB-H1 moves them into the cool-down: each rank idles "
        "(p-1)(F+B-2W) instead of (p-1)(F+B), a third of the time; as a share of a shorter "
        "step, (3/27)/(9/33) here",
        "05_pipeline_parallel.ipynb", {"picture": "bubble", "schedule": "zb-h1", "pp": 4, "m": 8},
        tol=0.05, wrong=0.0, subject="zb-h1, p = 4"),
    Question(
        "in_flight", "PP", "Q13 micro-batches the first stage keeps alive",
        "p = 4, m = 8: at its peak, how many micro-batches' activations does the first stage "
        "hold under GPipe and under 1F1B? (a dict `{\"gpipe\": ..., \"1f1b\": ...}`)",
        in_flight_first,
        "GPipe runs every forward before any backward: all m; 1F1B starts backwards after "
        "p-1 warm-up forwards: at most p on the first stage, fewer down the pipe",
        "05_pipeline_parallel.ipynb", {"picture": "in_flight", "schedule": "1f1b", "pp": 4,
                                       "m": 8},
        tol=0.0, wrong={"gpipe": 8, "1f1b": 8}, subject="micro-batches kept alive"),
    Question(
        "microbatches", "PP", "Q14 micro-batches for a 10% bubble at p=8",
        "With p = 8 stages and 1F1B, how many micro-batches at least keep the bubble at or "
        "below 10%? (a whole number)",
        micro_batches_for,
        "solve (p-1)/(m+p-1) <= 0.1 for m: m >= 9(p-1); more micro-batches also mean a "
        "larger global batch or smaller micro-batches",
        "05_pipeline_parallel.ipynb", {"picture": "bubble", "schedule": "1f1b", "pp": 8,
                                       "m": 63},
        tol=0.0, wrong=8, subject="1f1b, p = 8"),
    Question(
        "fits", "layout", "Q15 LLaMA-2 7B on one 80 GB GPU",
        "Does LLaMA-2 7B train on one 80 GB GPU (bf16, selective recomputation, 8 "
        "micro-batches of one 4096-token sequence, 90% of the memory usable)? "
        "(`True` or `False`)",
        fits_one_gpu,
        "the state alone is 16 bytes per parameter, about 108 GB, before any activation",
        "07_memory.ipynb", {"picture": "zero", "model": "llama2-7b", "n": 1}, wrong=True,
        subject="one GPU holds 80 GB"),
    Question(
        "layout", "layout", "Q16 the planner's layout for LLaMA-2 13B on 16 GPUs",
        "LLaMA-2 13B on 16 H100s of 80 GB (2 nodes of 8, NVLink inside, InfiniBand between), "
        "global batch 1024 sequences: which (dp, tp, pp) does edu3d's planner pick? Reason "
        "first, then confirm with `edu3d plan --model llama2-13b --gpus 16`. "
        "(a dict `{\"dp\": ..., \"tp\": ..., \"pp\": ...}`)",
        planned_layout,
        "the state (16 bytes per parameter, 208 GB) must be cut: ZeRO-1 shards the optimizer "
        "over dp at no extra traffic, two pipeline stages halve the rest for a bubble under 1% "
        "at m = 128, while TP would pay seconds of all-reduces per step; `edu3d plan` prints "
        "the planner's reasons",
        "06_3d_parallelism.ipynb", {"picture": "layout", "model": "llama2-13b", "gpus": 16},
        tol=0.0, wrong={"dp": 2, "tp": 8, "pp": 1}, subject="the planner's fastest layouts"),
)
BANK = {q.key: q for q in QUESTIONS}


# ---- grading -------------------------------------------------------------------------------------
def _same(given, truth, tol: float, where: str = "") -> None:
    """Raise AssertionError saying which part of ``given`` is off (never the right value)."""
    at = f" at {where}" if where else ""
    if isinstance(truth, bool):
        assert given is truth or given == truth and isinstance(given, bool), \
            f"{given!r}{at} is not right"
    elif isinstance(truth, dict):
        assert isinstance(given, dict), f"expected a dict with keys {sorted(truth, key=str)}"
        extra = set(map(str, given)) - set(map(str, truth))
        assert not extra and len(given) == len(truth), \
            f"expected the keys {sorted(truth, key=str)}, got {sorted(given, key=str)}"
        for k, v in truth.items():
            assert k in given, f"key {k!r} is missing"
            _same(given[k], v, tol, f"[{k!r}]")
    elif isinstance(truth, set):
        got = {str(x).strip().lower() for x in given} if isinstance(
            given, (set, list, tuple, frozenset)) else None
        assert got == {str(x).lower() for x in truth}, f"{given!r}{at} is not right"
    elif isinstance(truth, str):
        assert isinstance(given, str) and given.strip().lower() == truth.lower(), \
            f"{given!r}{at} is not right"
    else:
        ok = isinstance(given, (int, float)) and not isinstance(given, bool) and (
            math.isclose(given, truth, rel_tol=tol, abs_tol=1e-9) if tol else given == truth)
        assert ok, f"{given!r}{at} is not right" + (f" (within {tol:.0%})" if tol else "")


def verify(key: str, answer) -> None:
    """Raise AssertionError unless ``answer`` is right for question ``key``."""
    q = BANK[key]
    assert answer is not ..., "not answered yet: replace ... with your answer"
    _same(answer, q.truth(), q.tol)


def reference(key: str):
    """The reference answer to question ``key`` (``solutions/review_answers.py``)."""
    return grading.load("review_answers", solutions=True).ANSWERS[key]


def explain(key: str) -> str:
    """Question ``key``'s reasoning, and where the course shows it live."""
    q = BANK[key]
    return (f"Why: {q.why[0].upper()}{q.why[1:]}. Shown live in chapter {q.chapter[:2]} "
            f"(notebooks/{q.chapter}); the quiz panel below draws it (pick {q.title.split()[0]}).")


def why(key: str) -> None:
    """Reveal question ``key``'s reasoning, answered or not (the learner asked for it)."""
    print(explain(key))


def check(key: str, answer):
    """Grade one answer: a ``PASS``/``FAIL`` line (:func:`edu3d.course.grading.check`). A pass
    reveals the reasoning; a wrong answer's hint names the chapter to reread (and
    :func:`why`), never the answer. With ``EDU3D_SOLUTIONS=1`` the reference answer is graded."""
    q = BANK[key]
    if grading.using_solutions():
        answer = reference(key)
    verdict = grading.check(q.title, lambda: verify(key, answer),
                            hint=f"chapter {q.chapter[:2]} (notebooks/{q.chapter}); "
                                 f"review.why({key!r}) shows the reasoning")
    if verdict:
        print(explain(key))
    return verdict
