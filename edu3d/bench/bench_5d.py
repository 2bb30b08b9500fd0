"""``edu3d bench ep`` and ``edu3d bench cp``: what expert and context parallelism cost.

After reading this file you should understand what each row measures, on real ranks with the
one :class:`~edu3d.train.trainer.Trainer`, one training step at a time (repetitions
interleaved, medians, :mod:`edu3d.bench.harness`):

* **ep**: a mixture of experts (8 experts, top-1, every block) on ``dp = ep = n`` ranks
  against the **dense model with the same active parameters** (top-1 of experts as wide as
  the dense MLP: the same FLOPs per token, plus a router) on ``dp = n``. The row carries the
  all-to-all bytes this rank sent in one step, measured from the trace, beside the formula
  (dispatch and combine, forward and backward: ``4 · T·k·h`` elements per MoE layer, of which
  ``(EP-1)/EP`` leave the rank under uniform routing: the measured share comes from the step's
  token matrix), and the all-to-alls' share of the step. PyTorch has no public
  mixture-of-experts layer or expert-parallel API to compare with (torchtitan's lives outside
  torch), so the reference is the dense model.
* **cp**: the same model with each sequence split over ``cp = n`` ranks, for each of ring,
  all-gather and Ulysses, against ``dp = n`` (every rank the same number of tokens, whole
  sequences). Bytes per step on the ``cp`` group against the formula per layer and rank
  (``b`` rows, ``s`` tokens, ``h`` width, elements): ring forward ``2(n-1)·b·s/n·h`` (K and V
  passed on n-1 times), backward ``2(2n-1)·b·s/n·h`` (K and V again, and dK, dV passed n
  times: the last pass brings them home), plus the tokens' positions (8 bytes each pass);
  all-gather ``(n-1)/n · 2·b·s·h`` each way; Ulysses ``(n-1)/n · 4·b·s/n·h`` each way.
  PyTorch's ``context_parallel`` is CUDA-only (it swaps SDPA's CUDA kernels), so on CPU the
  reference is data parallelism; ``edu3d bench gpu`` is where a GPU comparison belongs.
"""

from __future__ import annotations

from edu3d.bench.harness import (comm_busy, interleaved_medians, layout_name, progress, report,
                                 result, traced)
from edu3d.config.layout import Layout
from edu3d.distributed.mesh import Mesh
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.train.data import SyntheticCorpus
from edu3d.config.sections import Run
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer

MODEL = dict(layers=2, heads=4, d_model=64, vocab=256)
EP_MODEL = dict(MODEL, seq=64, experts=8, topk=1)
CP_SEQ = 256


def _trainer(**options):
    args = Run.of(**options)
    _, layout = check_args(args)
    config = model_config(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
    return Trainer(GPT(config, seed=0), Mesh.build(layout), args), corpus, config


def ep_worker(mesh, reps: int) -> list[dict]:
    n = mesh.layout.world_size
    global_batch = 2 * n
    moe, corpus, config = _trainer(**EP_MODEL, dp=n, ep=n, global_batch=global_batch)
    dense, _, _ = _trainer(**MODEL, seq=EP_MODEL["seq"], dp=n, global_batch=global_batch)
    x, y = corpus.batch(1, global_batch)
    times = interleaved_medians({"moe": lambda: moe.step(x, y, 1),
                                 "dense": lambda: dense.step(x, y, 1)}, reps)
    events, seconds, out = traced(lambda: moe.step(x, y, 1))
    sent, a2a_s = comm_busy(events, "ep")
    T, k, h = global_batch // n * config.seq_len, config.topk, config.d_model
    layers = config.n_layers  # every block is an MoE layer
    rows = 4 * T * k * layers  # dispatch + combine, forward + backward
    matrix = out["ep_tokens"]
    remote = sum(v for i, row in enumerate(matrix) for j, v in enumerate(row) if i != j)
    share = remote / max(sum(map(sum, matrix)), 1)
    return [result(f"ep{n} moe e8 top1", times["moe"], "dense, same active params, dp only",
                   times["dense"], tokens=global_batch * config.seq_len,
                   comm_share={"ep": a2a_s / seconds}, a2a_bytes=sent, a2a_bytes_formula=rows * h * 4 * (n - 1) / n,
                   remote_share=share, remote_share_formula=(n - 1) / n,
                   a2a_share_of_step=a2a_s / seconds)]


def cp_worker(mesh, reps: int) -> list[dict]:
    n = mesh.layout.world_size
    base = dict(MODEL, seq=CP_SEQ, global_batch=n)
    dense, corpus, config = _trainer(**base, dp=n)
    x, y = corpus.batch(1, n)
    s, h, b, L = config.seq_len, config.d_model, n, config.n_layers
    formula = {"ring": L * 4 * (2 * (n - 1) + 2 * (2 * n - 1)) * b * s // n * h
               + L * 8 * (s // n) * 2 * (n - 1),  # positions travel with K, V both ways
               "allgather": L * 4 * 2 * (n - 1) / n * 2 * b * s * h,
               "ulysses": L * 4 * 2 * (n - 1) / n * 4 * b * s / n * h}
    rows = []
    for impl in ("ring", "allgather", "ulysses"):
        ours, _, _ = _trainer(**base, cp=n, cp_impl=impl)
        times = interleaved_medians({impl: lambda: ours.step(x, y, 1),
                                     "dp": lambda: dense.step(x, y, 1)}, reps)
        events, seconds, _ = traced(lambda: ours.step(x, y, 1))
        sent, cp_s = comm_busy(events, "cp")
        rows.append(result(f"cp{n} {impl}", times[impl], f"dp{n}, whole sequences",
                           times["dp"], tokens=n * s, comm_share={"cp": cp_s / seconds},
                           cp_bytes=sent, cp_bytes_formula=formula[impl],
                           cp_share_of_step=cp_s / seconds))
    return rows


def run_ep_benchmark(nprocs: int = 4, reps: int = 5, json_out: bool = False) -> dict:
    """``edu3d bench ep``: rows as the module docstring says."""
    progress(f"expert parallelism on {nprocs} ranks")
    run = launch(ep_worker, nprocs, args=(reps,), layout=Layout(dp=nprocs), timeout=600,
                 echo=not json_out, name="bench-ep")
    return report("ep", nprocs, run.results[0], layout=layout_name(dp=nprocs, ep=nprocs))


def run_cp_benchmark(nprocs: int = 4, reps: int = 5, json_out: bool = False) -> dict:
    """``edu3d bench cp``: rows as the module docstring says."""
    progress(f"context parallelism on {nprocs} ranks, sequence {CP_SEQ}")
    run = launch(cp_worker, nprocs, args=(reps,), layout=Layout(dp=nprocs), timeout=600,
                 echo=not json_out, name="bench-cp")
    return report("cp", nprocs, run.results[0], layout=layout_name(cp=nprocs))
