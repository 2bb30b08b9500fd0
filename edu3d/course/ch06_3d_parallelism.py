"""Chapter 06 (3D parallelism): the functions its notebook launches, and the formulas it
prints beside the measurements.

After reading this file you should know what the capstone run does and how each axis's
bytes per step are predicted:

* :func:`capstone` trains dp2-tp2-pp2 with ZeRO-1 (the tiny model, 4 micro-batches, 1F1B)
  with the one :class:`~edu3d.train.trainer.Trainer`, and, on every rank, the serial reference
  GPT on the same batches, so the notebook can show both loss curves are one;
* :func:`axis_bytes` sums what the trace says each rank sent per axis (tp, pp, dp) in one
  step (:func:`edu3d.distributed.trace.wire_bytes`: ring costs);
* :func:`axis_formulas` predicts the same numbers from the model's shape, with the
  performance model's count (:func:`edu3d.plan.stage_costs.stage_bytes`):

  - **TP** (no sequence parallelism): per layer and micro-batch 2 all-reduces forward and 2
    backward of the activation ``b·s·h·4`` bytes, each costing ``2(t-1)/t`` of it per rank
    (plus the vocabulary-parallel embedding and LM head on the end stages);
  - **PP**: per micro-batch one activation sent forward and one gradient sent back across
    each stage boundary (``b·s·h·4`` bytes each);
  - **DP / ZeRO-1**: gradients reduce-scattered and parameters all-gathered once per step:
    ``2 Ψ_rank · 4 · (N-1)/N`` bytes, Ψ_rank the parameters this rank holds (its stage's,
    cut by TP);

* :func:`memory_estimate` gives every rank's bytes by category from the planner's one
  estimator (:func:`edu3d.plan.estimate.estimate`), the diamonds over the measured bars.
"""

from __future__ import annotations

from edu3d.course import lesson_args
from edu3d.distributed import meter, trace
from edu3d.config.layout import Layout
from edu3d.distributed.trace import wire_bytes
from edu3d.model.gpt import GPT
from edu3d.model.shapes import num_params_from_config, spec_from_config
from edu3d.plan.estimate import setup, estimate
from edu3d.plan.stage_costs import stage_bytes
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import train_step
from edu3d.train.optim import make_optimizer
from edu3d.train.preflight import model_config
from edu3d.train.trainer import Trainer

AXES = ("tp", "pp", "dp")
STATE = ("params", "grads", "optimizer")


def capstone(mesh, steps: int = 4, **overrides) -> dict:
    """Train ``steps`` steps of dp2-tp2-pp2 ZeRO-1 (or the launched layout) on this rank;
    return its losses, grad norms, measured memory per category, and the serial reference
    losses (computed on every rank, the same everywhere)."""
    layout = mesh.layout
    opts = dict(dp=layout.dp, tp=layout.tp, pp=layout.pp, zero=1, microbatches=4,
                schedule="1f1b", steps=steps)
    opts.update(overrides)
    args = lesson_args(**opts)
    config = model_config(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    trainer = Trainer(GPT(config, seed=args.training.seed), mesh, args)
    serial = GPT(config, seed=args.training.seed)
    optimizer = make_optimizer(serial, args)

    losses, norms, serial_losses, peak = [], [], [], 0
    rec = trace.current()
    for s in range(1, steps + 1):
        x, y = corpus.batch(s, args.batch.global_batch)
        with rec.context(step=s):
            out = trainer.step(x, y, s)
        peak = max(peak, trainer.engine.peak_activation_bytes)
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
        with trace.use(trace.NullRecorder()):  # the reference is not part of the run's trace
            serial_losses.append(train_step(serial, optimizer, x, y, s, args)["loss"])
    mem = meter.measure(trainer.tensors())
    mem["activations"] = int(peak)
    mem["total"] = mem["total"] + mem["activations"]
    return {"rank": mesh.rank, "coords": list(mesh.layout.coords(mesh.rank)),
            "losses": losses, "grad_norms": norms, "serial_losses": serial_losses,
            "memory": mem, "psi": num_params_from_config(config),
            "rank_params": mem["params"] // 4,  # fp32: the parameters this rank holds
            "options": opts}


def axis_bytes(events: list[dict], step: int) -> dict[int, dict[str, float]]:
    """Per rank, the bytes it sent in ``step`` on each axis (tp, pp, dp), from the trace."""
    out: dict[int, dict[str, float]] = {}
    for ev in events:
        if ev.get("step") != step or ev.get("lane") != "comm" or ev.get("sim"):
            continue
        row = out.setdefault(ev["rank"], {a: 0.0 for a in AXES})
        group = ev.get("group")
        if group in row:
            row[group] += wire_bytes(ev)
    return out



def axis_formulas(config, layout, m: int, *, stage: int, rank_params: int,
                  global_batch: int = 8, dtype_bytes: int = 4) -> dict[str, float]:
    """The formula's bytes one rank of pipeline ``stage`` sends per step on each axis: the
    performance model's count (:func:`edu3d.plan.stage_costs.stage_bytes`) for ``config``'s
    GPT on ``layout``, ``m`` micro-batches, ``rank_params`` Ψ_rank (the parameters this rank
    holds: its stage's, cut by TP)."""
    return stage_bytes(spec_from_config(config), layout, m, stage, rank_params, global_batch,
                       dtype_bytes)


def memory_estimate(config, dp: int, tp: int, pp: int, zero: int, m: int,
                    schedule: str = "1f1b", vpp: int = 1,
                    global_batch: int = 8) -> dict[int, dict]:
    """Estimated bytes per rank after a step (``{rank: {"params", "grads", "optimizer",
    "activations"}}``): the planner's estimate at rest (fp32 AdamW, exact for this GPT) of
    the rank's pipeline stage. A rank holds its stages' parameters, cut by tp except the
    replicated ones, with ZeRO sharding each unit's flat buffer (padded to a multiple of dp)
    over the dp ranks (the fullest dp rank's count); its activations are what each layer of
    its stages saves per micro-batch, times the micro-batches the schedule keeps in flight."""
    layout = Layout(dp=dp, tp=tp, pp=pp, vpp=vpp)
    # ZeRO over one rank shards nothing: the planner asks for dp >= 2, the numbers are DP's
    st = setup(dp=dp, tp=tp, pp=pp, vpp=vpp, zero=zero if dp > 1 else 0, microbatches=m,
               micro_batch=max(global_batch // (dp * m), 1), schedule=schedule)
    stages = estimate(spec_from_config(config), st, at="rest")["per_stage"]
    return {rank: {c: stages[layout.coords(rank).pp][c] for c in (*STATE, "activations")}
            for rank in range(layout.world_size)}
