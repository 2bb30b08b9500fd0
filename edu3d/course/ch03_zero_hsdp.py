"""Chapter 03, HSDP section: ZeRO shards within replica groups, all-reduce across them, live.

After reading this file you should know where every number of the section comes from:

* :func:`argv` is the run: ``dp`` ranks (4 in the chapter) at a ZeRO stage with ``--hsdp R``
  replica groups of ``S = dp/R`` ranks each (``R = 1``: plain ZeRO over all of them;
  ``R = dp``: every group one rank, which is plain data parallelism);
* :func:`measure` is a launch target: for each ``R`` every rank trains two steps of the tiny
  GPT (rank 0 also the serial model, on the same batches), reports the groups it really
  joined (an all-gather of its rank over each group, as chapter 00's
  :func:`~edu3d.course.ch00_launching_ranks.mesh_report`, plus HSDP's ``shard`` and
  ``replicate``), and the peak bytes it held by category (``Trainer.stats``); every
  collective of the second step is traced with ``case = R``;
* :func:`bytes_per_group` adds up, from that trace, what each rank sent per step over its
  replica group (``shard``: ZeRO's gathers and reduce-scatters) and across the groups
  (``replicate``: the all-reduce of its gradient shard), in ring costs;
* :func:`predicted` is the formula: :func:`edu3d.plan.zero_modes.hsdp_wire_bytes` over the
  padded flat units ZeRO reduces (4-byte values) and the planner's state per rank
  (:func:`edu3d.plan.estimate.state_per_rank`, shards of ``1/S``);
* :func:`table` puts them side by side, one row per ``R``, for the chart
  (:func:`edu3d.widgets.zero.hsdp_bytes_figure`) and the check that they are equal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.config.layout import Layout
from edu3d.config.sections import Run, from_flags
from edu3d.course.ch00_launching_ranks import mesh_report
from edu3d.distributed import comm, runtime, trace
from edu3d.distributed.trace import wire_bytes
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.plan import estimate as plan_memory
from edu3d.plan.formulas import flat_shard
from edu3d.plan.zero_modes import hsdp_wire_bytes
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import train_step
from edu3d.train.optim import make_optimizer
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer

GROUPS = ("shard", "replicate")  # HSDP's two groups, as the trace names them
STATE = ("params", "grads", "optimizer")
REPLICAS = (1, 2, 4)  # the chapter's choices of R on 4 ranks
STEPS = 2


def argv(replicas: int, dp: int = 4, zero: int = 3, model: str = "tiny") -> list[str]:
    """``edu3d train``'s options: one sequence per rank and step, ``R`` replica groups."""
    return ["--model", model, "--dp", str(dp), "--zero", str(zero), "--hsdp", str(replicas),
            "--global-batch", str(dp), "--steps", str(STEPS)]


def options(replicas: int, dp: int = 4, zero: int = 3, model: str = "tiny") -> Run:
    run = from_flags(argv(replicas, dp, zero, model))
    check_args(run)
    return run


def predicted(replicas: int, dp: int = 4, zero: int = 3, model: str = "tiny") -> dict:
    """The formula's bytes per rank and step by group (``shard``, ``replicate``) and the
    planner's peak state per rank (``params``, ``grads``, ``optimizer``: its fullest rank)."""
    run = options(replicas, dp, zero, model)
    spec = plan_memory.spec_of(run)
    shard = dp // replicas
    psi = sum(flat_shard(u, shard, 0)[0] for _, u in plan_memory.units(spec, run, 0))
    sent = hsdp_wire_bytes(psi, shard, replicas, zero, "per-microbatch", 1, 4, 4)
    held = max((plan_memory.state_per_rank(spec, run, 0, i, at="peak") for i in range(dp)),
               key=lambda d: sum(d[c] for c in STATE))
    return {"R": replicas, "S": shard, "zero": zero, **sent, **{c: held[c] for c in STATE}}


def hsdp_report(mesh, replicas: int) -> dict:
    """Chapter 00's report of this rank's groups, plus HSDP's ``shard`` and ``replicate``
    under ``replicas`` groups, each proven by an all-gather of the rank over the group
    (``R = 1``: ZeRO's group is every dp rank's, and nothing is replicated). Collective."""
    out = mesh_report(mesh)
    for name in GROUPS:
        if replicas == 1 and name == "replicate":
            out["groups"][name] = [mesh.rank]
            continue
        group = mesh.group("dpcp" if replicas == 1 else name)
        members = torch.empty(dist.get_world_size(group), dtype=torch.int64,
                              device=runtime.device())
        comm.all_gather(members, torch.tensor([mesh.rank], dtype=torch.int64,
                                              device=members.device), group=group)
        out["groups"][name] = sorted(members.tolist())
    return out


def measure(mesh, replicas: list[int], zero: int = 3, model: str = "tiny") -> dict:
    """Launch target: for each ``R`` two steps on this rank (the second traced with
    ``case = R``), its groups, and the fullest rank's peak state; rank 0 adds the serial
    model's losses on the same batches."""
    out = {}
    dp = mesh.size("dp")
    for r in replicas:
        run = options(r, dp, zero, model)
        config = model_config(run)
        corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=run.training.seed)
        trainer = Trainer(GPT(config, seed=run.training.seed), mesh, run)
        losses = []
        for step in range(1, STEPS + 1):
            x, y = corpus.batch(step, run.batch.global_batch)
            with trace.current().context(case=r if step == STEPS else None):
                losses.append(trainer.step(x, y, step)["loss"])
        stats = trainer.stats()
        out[r] = {"losses": losses, "report": hsdp_report(mesh, r),
                  "mem": {c: stats["mem_bytes"][c] for c in STATE}}
        if mesh.rank == 0:
            ref = GPT(config, seed=run.training.seed)
            opt = make_optimizer(ref, run)
            out[r]["serial"] = [train_step(ref, opt, *corpus.batch(s, run.batch.global_batch),
                                           s, run)["loss"] for s in range(1, STEPS + 1)]
    return out


def bytes_per_group(events: list[dict], replicas: int) -> dict[int, dict[str, float]]:
    """``{rank: {"shard": bytes, "replicate": bytes}}`` each rank sent in the traced step of
    ``R = replicas`` (ring costs; without HSDP ZeRO's dp group counts as ``shard``)."""
    name = {"shard": "shard", "replicate": "replicate", "dpcp": "shard", "dp": "shard"}
    out: dict = {}
    for e in events:
        if e["lane"] == "comm" and e.get("case") == replicas and e.get("group") in name:
            sent = out.setdefault(e["rank"], dict.fromkeys(GROUPS, 0.0))
            sent[name[e["group"]]] += wire_bytes(e)
    return out


def run(replicas=REPLICAS, dp: int = 4, zero: int = 3, model: str = "tiny",
        timeout: float = 300, progress: bool = True):
    """One launch of ``dp`` ranks measuring every ``R``; returns the launch's result."""
    return launch(measure, dp, args=(list(replicas), zero, model), layout=Layout(dp=dp),
                  timeout=timeout, echo=False, progress=progress, name="hsdp")


def table(result=None, replicas=REPLICAS, dp: int = 4, zero: int = 3,
          model: str = "tiny") -> list[dict]:
    """One row per ``R``: the formula's (:func:`predicted`) and, with a launch's ``result``
    (from :func:`run`), the measured: the most any rank sent by group (``*_measured``),
    every rank's reading (``per_rank``), the fullest rank's state and the largest relative
    loss difference from the serial model (``loss_rel``)."""
    rows = []
    for r in replicas:
        row = predicted(r, dp, zero, model)
        if result is not None and r in result.results[0]:
            first = result.results[0][r]
            per_rank = bytes_per_group(result.events(), r)
            row["per_rank"] = per_rank
            for g in GROUPS:
                row[f"{g}_measured"] = max(v[g] for v in per_rank.values())
            row.update({f"{c}_measured": first["mem"][c] for c in STATE})
            row["loss_rel"] = max(abs(a - b) / abs(b) for a, b in
                                  zip(first["losses"], first["serial"]))
            row["reports"] = [res[r]["report"] for res in result.results]
        rows.append(row)
    return rows


def agreement(rows: list[dict]) -> str:
    """One line: in how many runs every rank's bytes per group equal the formula's."""
    done = [r for r in rows if "per_rank" in r]
    same = sum(all(abs(v[g] - r[g]) <= 0.5 for v in r["per_rank"].values() for g in GROUPS)
               for r in done)
    return f"{len(done)} runs: every rank's bytes per group equal the formula's in {same}"
