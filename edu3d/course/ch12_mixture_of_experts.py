"""Chapter 12 (mixture of experts): the runs its notebook makes, and the formulas beside them.

After reading this file you should know what each section of the chapter measures and
which formula it is held against:

* :func:`train_serial` trains the lesson's tiny mixture of experts (2 layers, ``d_model``
  32, 4 experts, top-2) in this process with the one :class:`~edu3d.train.trainer.Trainer`
  and ``edu3d train``'s own loop, so each step's record carries ``tokens_per_expert``
  (first MoE layer), ``aux_loss`` and ``dropped``; :func:`router_view` reads the router of
  the first MoE layer on one batch (every token's probabilities, chosen experts and gates);
* :func:`balance_runs` trains the same model three ways (aux loss off, on, DeepSeek-V3's
  bias) and :func:`imbalance` scores each step by its busiest expert's load over the mean
  (1 = perfect balance, ``E/k`` at collapse); the Switch loss is ``E · Σ_i f_i · P_i`` (1
  when balanced, ``E/k`` at collapse), counted over a *group* of tokens;
* :func:`scope_runs` launches expert parallelism twice, the load-balancing loss counted over
  each data rank's micro-batch (``--aux-scope microbatch``) and over the whole step
  (``global``), and :func:`scope_series` reads the balance of each rank's micro-batch and of
  the whole step from both (:func:`scope_takeaway` says what they show);
* :func:`capacity_runs` trains with several capacity factors; an expert keeps at most
  :func:`capacity` ``= ceil(T·k/E · C)`` assignments of a micro-batch's ``T`` tokens;
  :func:`capacity_summary` reads each run's dropped share and final loss against dropless;
* :func:`ep_worker` (launched by :func:`launch_ep`) trains the same model with expert
  parallelism: each step's ``ep_tokens`` is the rank-to-rank token matrix of the all-to-all;
  :func:`a2a_bytes` reads what each all-to-all carried from the trace and
  :func:`a2a_formula` predicts it: dispatch and combine each move ``T·k·h`` elements per
  rank and MoE layer, of which ``(EP-1)/EP`` leave the rank (balanced routing), forward and
  again in backward; :func:`label_a2a` names the trace's exchanges (dispatch, combine);
* :func:`memory_rows` sets every rank's measured bytes beside a dense model's: the same
  ``d_model`` (one MLP per block), and a dense model with the MoE's *active* parameters
  (``16 Ψ_active`` bytes in fp32 AdamW), which is what the MoE costs per token in FLOPs;
  :func:`memory_takeaway` compares the rows as drawn.
"""

from __future__ import annotations

import math

import torch

from edu3d.course import lesson_args
from edu3d.distributed import meter, trace
from edu3d.config.layout import Layout
from edu3d.model.gpt import GPT
from edu3d.model.moe import MoE, active_params, route, total_params
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import loop
from edu3d.train.preflight import model_config
from edu3d.train.trainer import Trainer
from edu3d.launch import launch

LESSON = dict(layers=2, d_model=32, heads=2, seq=32, experts=4, topk=2, lr=1e-2,
              global_batch=8)
BALANCE = {"aux loss off": dict(aux_loss_coef=0.0),
           "aux loss 0.1": dict(aux_loss_coef=0.1),
           "bias (DeepSeek-V3)": dict(aux_loss_coef=0.0, balance="bias")}
BIAS_RATE = 0.01  # the bias balancer's step (DeepSeek-V3 uses 1e-3 over far longer runs)
FACTORS = (0.0, 0.5, 1.0, 1.25, 2.0)  # capacity factors recorded (0: dropless)
BYTES = 4  # fp32


def options(**overrides):
    """The lesson's MoE options (``edu3d train --model tiny --layers 2 --d-model 32 --heads 2
    --experts 4 --topk 2``) with ``overrides``."""
    return lesson_args(**{**LESSON, **overrides})


def train_serial(steps: int = 30, bias_rate: float = BIAS_RATE, **overrides):
    """Train the lesson's MoE in this process: ``(records, model, corpus)``. The records
    are ``edu3d train --json``'s, step by step; ``model`` is the trained GPT."""
    torch.set_num_threads(1)  # as edu3d train does: many threads on a small model only contend
    args = options(steps=steps, **overrides)
    config = model_config(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    model = GPT(config, seed=args.training.seed)
    trainer = Trainer(model, None, args)
    for layer in trainer.moe.values():
        layer.bias_rate = bias_rate
    with trace.use(trace.NullRecorder()):
        records = loop(trainer, corpus, args)
    return records, model, corpus


def router_view(model, corpus, step: int = 1, global_batch: int = 8) -> dict:
    """The first MoE layer's router on global batch ``step``: ``probs`` [N, E], the chosen
    ``experts`` [N, k] and their ``gates`` [N, k] (as the layer routes: with its bias when
    it balances by bias), as lists."""
    layer = next(m for m in model.modules() if isinstance(m, MoE))
    seen = {}
    hook = layer.register_forward_pre_hook(lambda m, inp: seen.setdefault("x", inp[0]))
    x, _ = corpus.batch(step, global_batch)
    try:
        with torch.no_grad(), trace.use(trace.NullRecorder()):
            saved = layer.take_stats()
            model(x)
            layer.stats = saved
    finally:
        hook.remove()
    flat = seen["x"].reshape(-1, seen["x"].shape[-1]).float()
    probs = (flat @ layer.router.weight.float().t()).softmax(-1)
    bias = layer.expert_bias if layer.balance == "bias" else None
    idx, gates = route(probs, layer.topk, bias, layer.norm_topk)
    return {"probs": probs.tolist(), "experts": idx.tolist(), "gates": gates.tolist(),
            "tokens": len(flat)}


def imbalance(counts: list[int]) -> float:
    """The busiest expert's load over the mean load: 1 at perfect balance, ``E/k`` at
    collapse (a token sends its k assignments to k different experts, so one expert gets at
    most every token, ``T``, against a mean of ``T·k/E``)."""
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else 1.0


def cv(counts: list[int]) -> float:
    """The coefficient of variation of the loads (standard deviation / mean; 0 = balanced)."""
    t = torch.tensor(counts, dtype=torch.float64)
    return float(t.std(unbiased=False) / t.mean()) if t.mean() else 0.0


def switch_loss(counts: list[int], mean_probs: list[float], k: int) -> float:
    """``E · Σ_i f_i · P_i`` from the loads ``counts`` (``f_i = counts_i / (N·k)``) and the
    mean probabilities ``P_i``: the Switch/GShard balance loss (1 when balanced, ``E/k`` at
    collapse)."""
    total = sum(counts)
    return len(counts) * sum(c / total * p for c, p in zip(counts, mean_probs))


def balance_runs(steps: int = 40) -> dict[str, list[dict]]:
    """``{name: records}`` for the three balancers of :data:`BALANCE`, same seed and data."""
    return {name: train_serial(steps, **over)[0] for name, over in BALANCE.items()}


def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """The most assignments one expert keeps of ``tokens`` tokens: ``ceil(T·k/E · C)``."""
    return math.ceil(tokens * k / experts * factor)


def capacity_runs(steps: int = 20, factors=FACTORS) -> dict[float, list[dict]]:
    """``{capacity factor: records}`` (0: dropless), same seed and data."""
    return {c: train_serial(steps, capacity_factor=c)[0] for c in factors}


def capacity_summary(runs: dict[float, list[dict]], tokens: int, k: int) -> dict[float, dict]:
    """Per factor: ``dropped_pct`` (the mean share of the ``tokens·k`` assignments dropped
    per step), ``final`` (the last step's loss) and ``gap`` (that loss minus dropless's)."""
    base = runs[0.0][-1]["loss"]
    return {c: {"dropped_pct": 100 * sum(r["dropped"] for r in recs) / (len(recs) * tokens * k),
                "final": recs[-1]["loss"], "gap": recs[-1]["loss"] - base}
            for c, recs in runs.items()}


def capacity_takeaway(summary: dict[float, dict]) -> str:
    """What the capacity runs show, read from :func:`capacity_summary`: the factors that
    drop nothing, and which factor's final loss lies furthest from dropless."""
    limited = {c: v for c, v in summary.items() if c > 0}
    none = [c for c, v in limited.items() if v["dropped_pct"] == 0]
    far = max(limited, key=lambda c: abs(limited[c]["gap"]))
    most = max(limited, key=lambda c: limited[c]["dropped_pct"])
    return (f"C = {most:g} drops the most ({limited[most]['dropped_pct']:.1f}% of the "
            f"assignments); " + (f"C = {', '.join(f'{c:g}' for c in none)} "
                                 f"{'drops' if len(none) == 1 else 'drop'} nothing; "
                                 if none else "every factor drops something; ")
            + f"the final loss lies furthest from dropless at C = {far:g} "
            f"({limited[far]['gap']:+.3f} nats), the others within "
            f"{max(abs(v['gap']) for c, v in limited.items() if c != far):.3f}")


def tokens_per_microbatch(args) -> int:
    """``T``: the tokens one rank routes in one forward (its micro-batch of sequences)."""
    m = args.microbatches or 1
    return args.batch.global_batch // (args.layout.dp * m) * args.model.seq


# ---- expert parallelism: a launched run --------------------------------------------------
def ep_worker(mesh, overrides: dict) -> dict:
    """Every rank: train the lesson's MoE on the launched layout (``dp x ep``), each step in
    the trace; return rank 0's records, this rank's measured bytes, the experts it holds and
    ``loads``: per step, the assignments its own micro-batch gave each expert (first MoE
    layer), the group ``--aux-scope microbatch`` balances."""
    args = options(dp=mesh.layout.dp, ep=mesh.layout.ep, **overrides)
    config = model_config(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    trainer = Trainer(GPT(config, seed=args.training.seed), mesh, args)
    layer = trainer.moe[min(trainer.moe)]
    loads, before = [], {}
    layer.register_forward_pre_hook(lambda m, i: before.update(c=m.stats["counts"].clone()))
    layer.register_forward_hook(
        lambda m, i, o: loads.append((m.stats["counts"] - before["c"]).tolist()))
    records = loop(trainer, corpus, args)
    held = sorted({int(n.split(".experts.")[1].split(".")[0])
                   for n, _ in trainer.par.module.named_parameters() if ".experts." in n})
    return {"rank": mesh.rank, "records": records, "memory": meter.measure(trainer.tensors()),
            "experts": held, "loads": loads}


def launch_ep(ep: int = 2, dp: int | None = None, steps: int = 3, timeout: float = 120,
              **overrides):
    """Launch ``dp`` ranks (default ``ep``) training with expert parallelism ``ep``."""
    dp = dp or ep
    return launch(ep_worker, dp, args=(dict(steps=steps, **overrides),),
                  layout=Layout(dp=dp, ep=ep), timeout=timeout, echo=False, name=f"ch12-ep{ep}")


def scope_runs(steps: int = 20, ep: int = 2, aux_loss_coef: float = 0.1) -> dict:
    """``{scope: run}``: expert parallelism on ``ep`` ranks with the load-balancing loss
    (``aux_loss_coef``) counted per data rank's micro-batch and over the whole step."""
    return {scope: launch_ep(ep, steps=steps, aux_scope=scope, aux_loss_coef=aux_loss_coef)
            for scope in ("microbatch", "global")}


def scope_series(run) -> dict[str, list[float]]:
    """From one :func:`scope_runs` run, per step: the imbalance of the whole step's
    assignments (every rank's loads summed: what ``global`` balances) and of the busiest
    data rank's own micro-batch (what ``microbatch`` balances)."""
    per_rank = [r["loads"] for r in sorted(run.results, key=lambda r: r["rank"])]
    steps = range(len(per_rank[0]))
    whole = [[sum(col) for col in zip(*(loads[s] for loads in per_rank))] for s in steps]
    return {"whole step": [imbalance(c) for c in whole],
            "each rank's micro-batch (busiest)": [max(imbalance(loads[s]) for loads in per_rank)
                                                 for s in steps]}


def scope_takeaway(series: dict[str, dict[str, list[float]]], last: int = 10) -> str:
    """Means over the last ``last`` steps of each scope's two curves, as drawn, one line per
    scope (``<br>`` between them: the chart's takeaway takes two lines)."""
    parts = []
    for scope, curves in series.items():
        means = {name.split(" (")[0]: sum(v[-last:]) / len(v[-last:])
                 for name, v in curves.items()}
        parts.append(f"{scope}: " + ", ".join(f"{name} {m:.2f}" for name, m in means.items()))
    return f"busiest expert / mean, last {last} steps; " + "<br>".join(parts)


def label_a2a(events: list[dict], n_experts: int) -> list[dict]:
    """The trace with each expert-parallel all-to-all named by what it carries: ``counts``
    (the rows each rank will send, ``E`` int64), then per MoE layer ``dispatch`` and
    ``combine`` in forward; in backward (inside a ``B`` span) the gradients travel back by
    the same exchanges in reverse order (``combine (bwd)``, then ``dispatch (bwd)``)."""
    back = {}
    for e in events:
        if e.get("lane") == "compute" and e["op"] in ("B", "backward"):
            back.setdefault(e["rank"], []).append((e["t0"], e["t1"]))
    out, seen = [], {}
    for e in sorted(events, key=lambda e: (e["rank"], e["t0"])):
        if e.get("op") != "all_to_all" or e.get("group") != "ep":
            out.append(e)
            continue
        if e.get("bytes") == n_experts * 8:
            out.append({**e, "op": "counts"})
            continue
        key = (e["rank"], e.get("step"))
        bwd = any(a <= e["t0"] <= b for a, b in back.get(e["rank"], []))
        i = seen.get((key, bwd), 0)
        seen[(key, bwd)] = i + 1
        names = ("combine (bwd)", "dispatch (bwd)") if bwd else ("dispatch", "combine")
        out.append({**e, "op": names[i % 2]})
    return out


def a2a_bytes(events: list[dict], step: int) -> dict[int, dict[str, int]]:
    """Per rank, the bytes of each kind of exchange in ``step`` (after :func:`label_a2a`)."""
    out: dict[int, dict[str, int]] = {}
    for e in events:
        if e.get("step") == step and e.get("group") == "ep" and e.get("lane") == "comm":
            row = out.setdefault(e["rank"], {})
            row[e["op"]] = row.get(e["op"], 0) + int(e.get("bytes", 0))
    return out


def a2a_formula(tokens: int, k: int, h: int, ep: int, moe_layers: int,
                dtype_bytes: int = BYTES) -> dict[str, float]:
    """Per rank and step (one micro-batch of ``tokens``): ``sent``, the bytes dispatch hands
    the all-to-all (``T·k·h``, every assignment's row, its own included), and ``leaves``, the
    part bound for other ranks when routing is balanced (``(EP-1)/EP`` of it); the same
    again for combine, and both again in backward."""
    sent = tokens * k * h * dtype_bytes * moe_layers
    return {"sent": sent, "leaves": sent * (ep - 1) / ep}


def leaving_share(matrix: list[list[int]]) -> float:
    """The share of the rows in a rank-to-rank token matrix that leave their sender."""
    total = sum(map(sum, matrix))
    diag = sum(matrix[i][i] for i in range(len(matrix)))
    return (total - diag) / total if total else 0.0


# ---- memory ------------------------------------------------------------------------------
def param_counts(**overrides) -> dict[str, int]:
    """The lesson MoE's parameters: ``total`` (all experts) and ``active`` (per token)."""
    config = model_config(options(**overrides))
    return {"total": total_params(config), "active": active_params(config)}


def dense_bytes(steps: int = 1) -> dict:
    """Measured bytes of the dense model with the lesson's ``d_model`` (one MLP per block)."""
    args = options(experts=0, steps=steps)
    config = model_config(args)
    trainer = Trainer(GPT(config, seed=args.training.seed), None, args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    with trace.use(trace.NullRecorder()):
        loop(trainer, corpus, args)
    return meter.measure(trainer.tensors())


def memory_rows(dense: dict, serial_moe: dict, ep_runs: dict[int, list[dict]],
                active: int) -> list[dict]:
    """Rows for the memory chart (weights, gradients, optimizer state in bytes): the dense
    model, a dense model with the MoE's active parameters (``4 + 4 + 8`` bytes each), the
    MoE on one rank, and each rank of every expert-parallel run (``{ep: results}``)."""
    cats = ("params", "grads", "optimizer")
    rows = [{"name": "dense, same d_model", **{c: dense[c] for c in cats}},
            {"name": "dense, MoE's active params (16 Ψ_active)", "params": 4 * active,
             "grads": 4 * active, "optimizer": 8 * active, "formula": True},
            {"name": "MoE, 1 rank (all 4 experts)", **{c: serial_moe[c] for c in cats}}]
    for ep, results in sorted(ep_runs.items()):
        for r in sorted(results, key=lambda r: r["rank"]):
            rows.append({"name": f"MoE ep={ep}, rank {r['rank']} (experts "
                                 f"{','.join(map(str, r['experts']))})",
                         **{c: r["memory"][c] for c in cats}})
    return rows


def memory_takeaway(rows: list[dict], counts: dict[str, int]) -> str:
    """What the memory chart shows, read from its ``rows``: each row's bytes against the dense
    model with the MoE's active parameters (``16 Ψ_active``), the fullest rank of each
    expert-parallel degree, as the chart prints them (two decimals), on two lines (``<br>``)."""
    same = 16 * counts["active"]
    total = {r["name"]: r["params"] + r["grads"] + r["optimizer"] for r in rows}
    one = next(v for n, v in total.items() if n.startswith("MoE, 1 rank"))
    degrees = sorted({int(n.split("ep=")[1].split(",")[0]) for n in total if "ep=" in n})

    def versus(x: float) -> str:
        r = round(x / same, 2)
        return f"{r:.2f}x (" + ("below" if r < 1 else "equal" if r == 1 else "above") + ")"

    fullest = {ep: max(v for n, v in total.items() if n.startswith(f"MoE ep={ep},"))
               for ep in degrees}
    return (f"total {counts['total']:,} params, active {counts['active']:,}<br>a rank against "
            f"the dense equivalent (16 Ψ_active): one rank {versus(one)}; "
            + "; ".join(f"ep={ep} {versus(v)}" for ep, v in fullest.items()))
