"""Chapter 07's memory timeline: one training step's bytes over time, from a live run.

After reading this file you should know where the chapter's timeline comes from and how its
captions are computed:

* :func:`record` is a launch target: every rank builds the library's
  :class:`~edu3d.train.trainer.Trainer` for ``edu3d train``'s options, takes one step (which
  allocates AdamW's state and lets the pipeline engine learn its shapes), and records the
  next with :class:`~edu3d.train.memory_recorder.MemoryRecorder`: a sample of every kind at
  each event. Rank 0 returns the document ``edu3d train --memory-timeline`` writes (every
  rank's timeline, the planner's estimate, the step's ``mem_bytes`` record);
* :func:`sweep` records a few settings (:func:`settings`: ZeRO stage, micro-batches,
  recomputation, and the gradient-reduction mode where the trainer has one) in **one**
  launch of 2 ranks, which the chapter's controls pick from; :func:`run` records one;
* :func:`peaks`, :func:`moves` and :func:`caption` turn documents into the numbers the
  chapter prints: each setting's measured peak by kind beside the planner's, and how one
  knob moves the peak with the others held. Bytes are exact and repeat bit for bit, so no
  spread is needed; nothing here reads a clock;
* :func:`pool_experiment` (CUDA only) trains a few steps of a preset on one GPU with
  sequence lengths that change from step to step, its gradients either in **one flat
  buffer** allocated once (edu3d's DP buckets and ZeRO units: ``p.grad`` a view into it,
  zeroed in place) or **per parameter** (autograd allocates them in backward,
  ``zero_grad(set_to_none=True)`` frees them after the step), and returns the caching
  allocator's counters (:func:`edu3d.train.cuda_memory.pool_stats`): reserved against
  allocated, and the bytes of free blocks split off inside segments in use.
"""

from __future__ import annotations

import torch

from edu3d.config.layout import Layout
from edu3d.distributed.mesh import Mesh
from edu3d.launch import launch
from edu3d.model.gpt import GPT, config_from
from edu3d.train.cuda_memory import pool_stats
from edu3d.train.data import SyntheticCorpus
from edu3d.train.memory_recorder import KINDS, MemoryRecorder, document, gather_timelines
from edu3d.config.sections import FLAGS, from_flags
from edu3d.train.preflight import check_args
from edu3d.train.trainer import Trainer

#: the knobs' values (:func:`settings` records some of their combinations)
GRID = {"zero": (0, 1, 2, 3), "microbatches": (1, 2, 4), "recompute": ("none", "full")}
GRAD_REDUCE = ("per-microbatch", "per-step")  # ZeRO-2/3 only, where the trainer has it
HAS_GRAD_REDUCE = "grad_reduce" in FLAGS
BASE = ["--dp", "2", "--global-batch", "8", "--steps", "2"]
KNOB_NAMES = {"zero": "ZeRO stage", "microbatches": "micro-batches",
              "recompute": "recomputation", "grad_reduce": "gradient reduction"}


def argv_of(setting: dict) -> list[str]:
    """``edu3d train``'s flags for a setting ``{"zero", "microbatches", "recompute"[,
    "grad_reduce"]}`` on the tiny model, dp=2."""
    out = BASE + ["--zero", str(setting["zero"]), "--microbatches",
                  str(setting["microbatches"]), "--recompute", setting["recompute"]]
    if setting.get("grad_reduce") and setting["zero"] >= 2:
        out += ["--grad-reduce", setting["grad_reduce"]]
    return out


def key_of(setting: dict) -> tuple:
    """A setting as a hashable key (the reduction mode only where it applies: ZeRO-2/3,
    ``per-microbatch`` when not given, the trainer's default)."""
    mode = (setting.get("grad_reduce") or GRAD_REDUCE[0]) \
        if setting["zero"] >= 2 and HAS_GRAD_REDUCE else None
    return (setting["zero"], setting["microbatches"], setting["recompute"], mode)


def settings() -> list[dict]:
    """The chapter's sweep: each knob moved away from plain DP with one micro-batch (a star,
    not the whole grid: every setting costs a step on 2 CPU ranks), and ZeRO-2/3 at 4
    micro-batches in both reduction modes when the trainer has ``--grad-reduce``. The
    panel records any other setting live."""
    star = [(0, 1, "none"), (0, 2, "none"), (0, 4, "none"), (0, 1, "full"), (1, 1, "none"),
            (1, 4, "none"), (2, 1, "none"), (3, 1, "none"), (2, 4, "none"), (3, 4, "none")]
    out = []
    for zero, m, rec in star:
        modes = GRAD_REDUCE if HAS_GRAD_REDUCE and zero >= 2 and m > 1 else (None,)
        out += [{"zero": zero, "microbatches": m, "recompute": rec, "grad_reduce": mode}
                for mode in modes]
    return out


# ---- on every rank -----------------------------------------------------------------------------
def record(mesh, argv: list[str]) -> dict | None:
    """One setting on this rank: a first step, then the second recorded. Collective; rank 0
    returns the document (:func:`edu3d.train.memory_recorder.document`), the others None."""
    args = from_flags(argv)
    config, layout = check_args(args)
    if mesh is None or mesh.layout != layout:
        mesh = Mesh.build(layout) if layout.world_size > 1 else None
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    trainer = Trainer(GPT(config, seed=args.training.seed), mesh, args)
    trainer.step(*corpus.batch(1, args.batch.global_batch), 1)
    recorder = MemoryRecorder(trainer)
    with recorder.watch(2):
        trainer.step(*corpus.batch(2, args.batch.global_batch), 2)
    stats = trainer.stats()["mem_bytes"]  # collective: what edu3d train records
    timelines = gather_timelines(recorder)
    return None if timelines is None else document(args, timelines, stats)


def record_many(mesh, argvs: list[list[str]]) -> list[dict | None]:
    """:func:`record` for several settings of the launch's world size, one after another."""
    return [record(mesh, argv) for argv in argvs]


# ---- in the notebook ---------------------------------------------------------------------------
def world_of(argv: list[str]) -> int:
    args = from_flags(argv)
    _, layout = check_args(args)
    return layout.world_size


def run(setting: dict, timeout: float = 120) -> dict:
    """Record ``setting`` live on 2 ranks; the document."""
    argv = argv_of(setting)
    return launch(record, world_of(argv), args=(argv,), timeout=timeout, echo=False,
                  name="memory-timeline", layout=Layout(dp=2)).results[0]


def sweep(chosen: list[dict] | None = None, timeout: float = 300) -> dict[tuple, dict]:
    """Every setting of ``chosen`` (default :func:`settings`) recorded in one launch of 2
    ranks: ``{key_of(setting): document}``."""
    chosen = chosen or settings()
    argvs = [argv_of(s) for s in chosen]
    docs = launch(record_many, 2, args=(argvs,), timeout=timeout, echo=False,
                  name="memory-timelines", layout=Layout(dp=2)).results[0]
    return {key_of(s): d for s, d in zip(chosen, docs)}


def fullest(doc: dict) -> dict:
    """The timeline of the rank whose peak is highest."""
    return max(doc["ranks"], key=lambda r: r["peak"]["total"])


def planned_peak(doc: dict, timeline: dict | None = None) -> dict:
    """The planner's peak row for ``timeline``'s pipeline rank (the fullest rank's)."""
    timeline = timeline or fullest(doc)
    return doc["planner"]["peak"]["per_stage"][timeline["coord"][0]]


def peaks(docs: dict[tuple, dict]) -> list[dict]:
    """One row per setting: the measured peak (the fullest rank's sample whose kinds add up
    to most, by kind) and the planner's peak, with what the planner counts that the tensors
    cannot show (``transient``: the logits' gradient inside the loss's backward)."""
    rows = []
    for doc in docs.values():
        key = key_of(doc["options"])
        tl = fullest(doc)
        plan = planned_peak(doc, tl)
        rows.append({"key": key, "label": label(key, "<br>"), "zero": key[0], "microbatches": key[1], "recompute": key[2],
                     "grad_reduce": key[3], "measured": tl["peak"]["total"],
                     "by_kind": {k: tl["peak"][k] for k in KINDS},
                     "phase": tl["peak"]["phase"], "planner": plan["total"],
                     "planner_by_kind": {k: plan[k] for k in (*KINDS, "transient")},
                     "stats_total": doc["stats"]["total"]})
    return rows


def label(key: tuple, sep: str = ", ") -> str:
    """``ZeRO-2, 4 mb, recompute none, per-step`` (``sep="<br>"``: one knob a line, for a
    chart, without recomputation when there is none)."""
    zero, m, rec, mode = key
    if sep != ", ":  # a chart's tick: short words, which the chart's axis title explains
        return sep.join([f"ZeRO-{zero}", f"{m} mb", *([f"rc {rec}"] if rec != "none" else []),
                         *([SHORT[mode]] if mode else [])])
    return sep.join([f"ZeRO-{zero}", f"{m} mb", f"recompute {rec}", *([mode] if mode else [])])


SHORT = {"per-microbatch": "per-mb", "per-step": "per-step"}  # --grad-reduce, on a tick


def moves(docs: dict[tuple, dict], knob: str, base: dict) -> list[tuple[str, int]]:
    """The measured peak as ``knob`` runs over its values, the other knobs at ``base``:
    ``[(value, bytes)]`` for the values recorded."""
    values = GRAD_REDUCE if knob == "grad_reduce" else GRID[knob]
    out = []
    for v in values:
        key = key_of({**base, knob: v})
        if key in docs:
            out.append((str(v), fullest(docs[key])["peak"]["total"]))
    return out


def size(n: float) -> str:
    """Bytes in the unit that reads best (KB, MB, GB: powers of 1000, as the charts)."""
    for name, unit in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= unit:
            return f"{n / unit:.2f} {name}"
    return f"{n:.0f} bytes"


def caption(doc: dict) -> str:
    """What the chart shows, in numbers from this run: where the fullest rank peaks and of
    what, against the planner's peak and edu3d train's record of the same step."""
    tl = fullest(doc)
    p, plan = tl["peak"], planned_peak(doc, tl)
    o = doc["options"]
    parts = ", ".join(f"{k} {size(p[k])}" for k in KINDS if p[k])
    gap = plan["total"] - p["total"]
    apart = [f"{k} {size(plan[k])} against {size(tl['peak_of'][k])}" for k in KINDS
             if abs(plan[k] - tl["peak_of"][k]) > 0.01 * max(plan[k], tl["peak_of"][k], 1)]
    return (f"dp={o['dp']} ZeRO-{o['zero']}, {o['microbatches']} micro-batch(es), recompute "
            f"{o['recompute']}: rank {tl['rank']} peaks at {size(p['total'])} in "
            f"{p['phase']} ({parts}). The planner's peak is {size(plan['total'])} "
            f"({'+' if gap >= 0 else '-'}{size(abs(gap))}: it adds each kind's own maximum, "
            f"{size(plan['comm'])} of communication buffers and {size(plan['transient'])} for "
            f"the logits' gradient, which live at other moments or inside one operation"
            + (f"; kinds whose largest value differs, planner against measured: "
               f"{', '.join(apart)}" if apart else "") + "). "
            f"edu3d train's record of the step says {size(doc['stats']['total'])}: each kind's "
            f"largest reading between compute actions, added up.")


def describe_moves(docs: dict[tuple, dict], base: dict | None = None) -> list[str]:
    """One line per knob: how the measured peak moves, the others held at ``base``."""
    base = base or {"zero": 0, "microbatches": 1, "recompute": "none", "grad_reduce": None}
    lines = []
    for knob in ("zero", "microbatches", "recompute") + (("grad_reduce",) if HAS_GRAD_REDUCE
                                                          else ()):
        held = dict(base, zero=2, microbatches=4) if knob == "grad_reduce" else base
        row = moves(docs, knob, held)
        if len(row) > 1:
            others = ", ".join(f"{KNOB_NAMES[k]} {v}" for k, v in held.items()
                               if k != knob and v is not None)
            lines.append(f"{KNOB_NAMES[knob]} ({others}): "
                         + " -> ".join(f"{v}: {size(b)}" for v, b in row))
    return lines


# ---- the memory pool, on a GPU -----------------------------------------------------------------
POOL_MODES = ("flat", "per-parameter")


def pool_experiment(grads: str, preset: str = "small", steps: int = 12, batch: int = 8,
                    lengths: tuple = (128, 72, 104, 40), device: str = "cuda") -> dict:
    """The allocator's counters after ``steps`` AdamW steps of ``preset`` on one GPU, the
    sequence length cycling through ``lengths``; ``grads`` is ``"flat"`` (one buffer,
    allocated before the first step, ``p.grad`` views of it) or ``"per-parameter"``."""
    if grads not in POOL_MODES:
        raise ValueError(f"grads={grads!r}: choose one of {', '.join(POOL_MODES)}")
    if not torch.cuda.is_available():
        raise RuntimeError("the caching allocator is CUDA's: run this on a GPU")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    config = config_from(preset)
    model = GPT(config, seed=0).to(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    flat = None
    if grads == "flat":  # one allocation, reused: the gradients are written into it
        flat = torch.zeros(sum(p.numel() for p in params), device=device)
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
    for step in range(1, steps + 1):
        n = lengths[(step - 1) % len(lengths)]
        x, y = (t[:, :n].contiguous().to(device) for t in corpus.batch(step, batch))
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        if flat is not None:
            flat.zero_()
        else:
            opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    return {"grads": grads, "preset": preset, "steps": steps, **pool_stats(device)}


def pool_compare(**kw) -> list[dict]:
    """:func:`pool_experiment` in both modes (CUDA only)."""
    return [pool_experiment(mode, **kw) for mode in POOL_MODES]


def pool_table(rows: list[dict]) -> str:
    """The two runs' counters as aligned text, in MiB."""
    keys = ("allocated_peak", "reserved_peak", "reserved_current", "inactive_split_peak",
            "inactive_split_current")
    lines = [f"{'gradients':>14} " + " ".join(f"{k:>22}" for k in keys) + "  retries"]
    for r in rows:
        lines.append(f"{r['grads']:>14} " + " ".join(f"{r[k] / 2**20:>18.2f} MiB" for k in keys)
                     + f"  {r['alloc_retries']:>7}")
    return "\n".join(lines)
