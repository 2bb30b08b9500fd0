"""Chapter 13's capstone: four parallel axes and a mixture of experts, one loss curve.

After reading this file you should know what the capstone run does and how its loss is
proven: :func:`capstone` trains ``edu3d train --dp 2 --cp 2 --pp 2 --experts 4 --topk 2
--ep 2`` (8 ranks: data, context and pipeline parallel, the experts shared out over pairs of
the ``dp x cp`` ranks) with the one :class:`~edu3d.train.trainer.Trainer`, and on every rank
the serial GPT on the same batches, micro-batch by micro-batch as the layout's data ranks
see them (a mixture of experts routes per group of tokens, so the reference must group them
alike; the routers score in float64, so their own rounding flips no near-tie, though a
difference in what they are fed still can, see below). :func:`group_bytes` reads the bytes
each group moved in one step from the trace.

Why the two loss curves part after the first step, though the layout is exact (its gradients
equal the serial ones within 4.4e-7 per tensor with plain SGD; ``tests/test_5d_parity.py``
holds this layout to 1e-5): AdamW's first update is ``lr·g/(|g| + 1e-8)``, so the few entries
whose gradient comes out at a few 1e-9 (the attention key bias, 0 in exact arithmetic, and
about 15 weights whose per-token terms nearly cancel) turn a 1e-10 difference of summation
order into weight differences up to 3.8e-5. Those alone do not move the loss, but at step 2
one token of layer 1 has its second and third router probabilities 5.2e-8 apart: it goes to
experts 0 and 3 here and to 1 and 3 in the serial run. That one token moves the step-2 loss
by 4.8e-5 (relative) and, through that step's gradients, 7.6e-5 at step 3. The serial GPT
alone, its step-1 gradients perturbed by 1e-10 noise, does the same in 5 draws of 8 (4.8e-5,
then 7.6e-5 to 7.8e-5); in the other 3 it stays under 1.3e-6.
"""

from __future__ import annotations

from edu3d.course.ch07_memory_plan import options as checked_options
from edu3d.course.ch13_context_parallelism import cp_wire_bytes
from edu3d.distributed import trace
from edu3d.config.layout import Layout
from edu3d.model.gpt import GPT
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import reference_microbatches, train_step
from edu3d.train.optim import make_optimizer
from edu3d.config.sections import from_flags
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer

CAPSTONE = ["--dp", "2", "--cp", "2", "--pp", "2", "--experts", "4", "--topk", "2",
            "--ep", "2", "--router-dtype", "fp64"]


def capstone_layout(argv: list[str]) -> Layout:
    """The 5D layout ``argv`` asks for, as ``edu3d train``'s checks build it."""
    return check_args(from_flags(argv))[1]


def capstone(mesh, argv: list[str] = tuple(CAPSTONE), steps: int = 3) -> dict:
    """Train ``steps`` AdamW steps of the layout ``argv`` with the one Trainer and, untraced,
    the serial GPT on the same batches (micro-batch by micro-batch as the layout's data
    ranks see them, so a mixture of experts routes the same token groups). Returns this
    rank's coordinates, both loss curves, the step's bytes per group and the memory of the
    fullest rank (``Trainer.stats``)."""
    args = checked_options(list(argv))
    config = model_config(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    trainer = Trainer(GPT(config, seed=args.training.seed), mesh, args)
    serial = GPT(config, seed=args.training.seed)
    optimizer = make_optimizer(serial, args)
    m = reference_microbatches(args)
    rec = trace.current()
    losses, serial_losses = [], []
    for s in range(1, steps + 1):
        x, y = corpus.batch(s, args.batch.global_batch)
        with rec.context(step=s):
            losses.append(trainer.step(x, y, s)["loss"])
        with trace.use(trace.NullRecorder()):  # the reference is not part of the run's trace
            serial_losses.append(train_step(serial, optimizer, x, y, s, args, m)["loss"])
    stats = trainer.stats()
    return {"rank": mesh.rank, "coord": dict(mesh.coord._asdict()), "losses": losses,
            "serial_losses": serial_losses, "mem_bytes": stats["mem_bytes"],
            "comm_s": stats["comm_s"], "params": sum(p.numel() for p in serial.parameters())}


def group_bytes(events: list[dict], step: int, rank: int = 0) -> dict[str, float]:
    """Bytes ``rank`` sent in ``step``, by group (tp, cp, dpcp, ep, ...), from the trace."""
    out: dict[str, float] = {}
    for ev in events:
        if ev.get("step") == step and ev.get("rank") == rank and ev.get("lane") == "comm":
            out[ev.get("group", "world")] = out.get(ev.get("group", "world"), 0.0) + \
                cp_wire_bytes(ev)
    return out
