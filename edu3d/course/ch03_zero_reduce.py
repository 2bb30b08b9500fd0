"""Chapter 03, last section: ZeRO-2/3 under gradient accumulation, measured beside the planner.

After reading this file you should know where every point of the section's chart comes from:

* :data:`CASES` are the six ways of reducing gradients the chart compares: DDP, ZeRO-1, and
  ZeRO-2 and ZeRO-3 each ``per-microbatch`` (reduce-scatter every micro-batch, keep the
  ``1/N`` shard: DeepSpeed, FSDP2) or ``per-step`` (accumulate full gradients, reduce once:
  Megatron's distributed optimizer), swept over ``m`` = 1, 2, 4, 8 micro-batches;
* :func:`predicted` is the planner's figure for one case: the gradient bytes a rank holds
  during the step (:func:`edu3d.plan.estimate.state_per_rank` at the peak: what lives
  between two micro-batches) and the bytes it sends per step
  (:func:`edu3d.plan.zero_modes.dp_wire_bytes` over the padded flat units ZeRO really
  reduces, in the run's 4-byte values);
* :func:`measure` is a launch target: every rank trains one step of each case with the
  library's :class:`~edu3d.train.trainer.Trainer` and reads :meth:`Trainer.stats`: the peak
  bytes by category sampled after every forward and backward (``mem_bytes``), and the bytes
  sent per collective kind (``wire_bytes``, ring costs from the trace). :func:`run` does the
  whole sweep in one launch of ``dp`` ranks (a few seconds for the tiny model);
* :func:`table` pairs them, one row per case and ``m``, for the chart
  (:func:`edu3d.widgets.grad_reduce.grad_reduce_figure`) and for the test that they agree.

The libraries' choices, one sentence each, are :data:`edu3d.plan.zero_modes.LIBRARIES`.
"""

from __future__ import annotations

from edu3d.config.layout import Layout
from edu3d.distributed.mesh import Mesh
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.plan import estimate as plan_memory
from edu3d.plan import zero_modes
from edu3d.plan.formulas import flat_shard
from edu3d.train.data import SyntheticCorpus
from edu3d.config.sections import Run, from_flags
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer

#: (label, ZeRO stage, grad_reduce): DDP and ZeRO-1 always reduce once per step
CASES = (("DDP", 0, "per-step"), ("ZeRO-1", 1, "per-step"),
         ("ZeRO-2 per-microbatch", 2, "per-microbatch"), ("ZeRO-2 per-step", 2, "per-step"),
         ("ZeRO-3 per-microbatch", 3, "per-microbatch"), ("ZeRO-3 per-step", 3, "per-step"))
MICROBATCHES = (1, 2, 4, 8)
MODES = zero_modes.GRAD_REDUCE
#: the collectives each stage's data-parallel traffic uses (the rest: the 8-byte norm)
DP_KINDS = {0: ("all_reduce",), 1: ("reduce_scatter", "all_gather"),
            2: ("reduce_scatter", "all_gather"), 3: ("reduce_scatter", "all_gather")}


def argv(zero: int, grad_reduce: str, m: int, dp: int = 2, model: str = "tiny") -> list[str]:
    """``edu3d train``'s options for one case: one sequence per micro-batch and rank."""
    out = ["--model", model, "--dp", str(dp), "--zero", str(zero), "--microbatches", str(m),
           "--global-batch", str(dp * m)]
    return out + (["--grad-reduce", grad_reduce] if zero >= 2 else [])


def options(args: list[str]) -> Run:
    o = from_flags(args)
    check_args(o)
    return o


def predicted(zero: int, grad_reduce: str, m: int, dp: int = 2, model: str = "tiny") -> dict:
    """The planner's gradient bytes held during the step and bytes sent per step, for the
    rank the run reports (every dp rank holds the same gradient bytes)."""
    st = options(argv(zero, grad_reduce, m, dp, model))
    spec = plan_memory.spec_of(st)
    held = plan_memory.state_per_rank(spec, st, 0, 0, at="peak")
    pb, gb, _ = plan_memory.state_bytes(st.precision.dtype, st.training.optimizer, spec.course)
    units = plan_memory.units(spec, st, 0)
    # ZeRO reduces its padded flat units; DDP all-reduces the gradients as they are
    psi = (sum(flat_shard(u, dp, 0)[0] for _, u in units) if zero else
           plan_memory.held(spec, st, 0))
    return {"grads": held["grads"], "params": held["params"],
            "wire": zero_modes.dp_wire_bytes(psi, dp, zero, grad_reduce, m, pb, gb)}


def measure(mesh, argvs: list[list[str]]) -> list[dict]:
    """Launch target: one step of each option set on this rank; ``Trainer.stats()``'s peak
    bytes by category and bytes sent per collective kind, per option set."""
    out = []
    for a in argvs:
        args = options(a)
        layout = Layout(dp=args.layout.dp)
        if mesh is None or layout != mesh.layout:
            mesh = Mesh.build(layout)
        config = model_config(args)
        x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed).batch(
            1, args.batch.global_batch)
        trainer = Trainer(GPT(config, seed=args.training.seed), mesh, args)
        trainer.stats()  # forget what building it held
        trainer.step(x, y, 1)
        stats = trainer.stats()
        out.append({"mem_bytes": stats["mem_bytes"], "wire_bytes": stats["wire_bytes"]})
    return out


def sweep(dp: int = 2, model: str = "tiny", cases=CASES, ms=MICROBATCHES) -> list[tuple]:
    """``(label, zero, grad_reduce, m, argv)`` of every run of the chart."""
    return [(label, z, g, m, argv(z, g, m, dp, model)) for label, z, g in cases for m in ms]


def run(dp: int = 2, model: str = "tiny", cases=CASES, ms=MICROBATCHES,
        timeout: float = 300) -> list[dict]:
    """Measure the whole sweep in one launch of ``dp`` ranks; rank 0's reading of each run
    (``Trainer.stats`` reports the fullest rank's memory and the busiest rank's bytes)."""
    runs = sweep(dp, model, cases, ms)
    res = launch(measure, dp, args=([r[-1] for r in runs],), timeout=timeout, echo=False,
                 progress=False, name="zero-grad-reduce")
    return collect(res.results[0], runs)


def collect(readings: list[dict], runs: list[tuple]) -> list[dict]:
    """:func:`measure`'s readings (rank 0's) labelled with their :func:`sweep` entries."""
    return [{"label": label, "zero": z, "grad_reduce": g, "m": m, **r}
            for (label, z, g, m, _), r in zip(runs, readings)]


def table(measured: list[dict] | None = None, dp: int = 2, model: str = "tiny",
          cases=CASES, ms=MICROBATCHES) -> list[dict]:
    """One row per case and ``m``: the planner's ``grads``/``wire`` bytes and, when
    ``measured`` (from :func:`run`) has the run, the measured ones
    (``grads_measured``, ``wire_measured``: the stage's data-parallel collectives)."""
    got = {(r["zero"], r["grad_reduce"], r["m"]): r for r in measured or []}
    rows = []
    for label, z, g, m, _ in sweep(dp, model, cases, ms):
        row = {"label": label, "zero": z, "grad_reduce": g, "m": m,
               **predicted(z, g, m, dp, model)}
        r = got.get((z, g, m))
        if r is not None:
            row["grads_measured"] = r["mem_bytes"]["grads"]
            row["params_measured"] = r["mem_bytes"]["params"]
            row["wire_measured"] = sum(r["wire_bytes"].get(k, 0) for k in DP_KINDS[z])
        rows.append(row)
    return rows


def agreement(rows: list[dict]) -> str:
    """One line: how many measured points equal the planner's, gradient bytes and wire bytes."""
    done = [r for r in rows if "grads_measured" in r]
    same_g = sum(r["grads_measured"] == r["grads"] for r in done)
    same_w = sum(abs(r["wire_measured"] - r["wire"]) <= 0.5 for r in done)
    return (f"{len(done)} runs: gradient bytes equal the planner's in {same_g}, bytes on the "
            f"wire in {same_w}")
