"""The training loop behind ``edu3d train``, and the serial reference step.

After reading this file you should understand one training step end to end: fetch global
batch ``step`` (the same tokens whatever the layout), forward and backward, measure the
gradient norm and clip it, set the learning rate, update. Each step is recorded as
``{"step", "loss", "grad_norm", "lr", "tokens_per_s"}`` (plus the run's memory and
communication, :meth:`~edu3d.train.trainer.Trainer.stats`); a parallel layout must reproduce
these records step by step, which is how the course proves it is the same computation.

:func:`loop` drives the one :class:`~edu3d.train.trainer.Trainer`, whatever the layout;
:func:`serial_step` is written independently of it, on purpose: it is the reference the
tests compare every layout with. The run is a
:class:`~edu3d.config.sections.Run`, checked once (:mod:`edu3d.train.preflight`); the command line is parsed in
:mod:`edu3d.commands.train`, which also picks the trainer class (edu3d's
:class:`~edu3d.train.trainer.Trainer`, or PyTorch's APIs for ``--impl torch``).

Weight decay follows nanoGPT: it applies to matrices (and embeddings), not to biases or
LayerNorm gains, which only shift and scale.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

import torch

from edu3d.ckpt.checkpointer import Checkpointer
from edu3d.ckpt.format import resume_from
from edu3d.ckpt.format import steps as complete_steps
from edu3d.launch import live
from edu3d.launch import api
from edu3d.launch.api import LaunchError, LaunchTimeout, new_run_dir, node_args
from edu3d.model.gpt import GPT
from edu3d.model.balance import set_aux_scale
from edu3d.model.moe import MoE, active_params, total_params
from edu3d.model.shapes import num_params_from_config
from edu3d.parallel.fp8 import end_step
from edu3d.train import faults, memory_recorder
from edu3d.train.batching import batch_tokens, global_batch, make_corpus
from edu3d.train.data import SyntheticCorpus
from edu3d.train.optim import clip_coef, lr_at, set_lr
from edu3d.train.publish import Publisher
from edu3d.config.sections import Run
from edu3d.train.preflight import Checked, model_config, node_options, preflight
from edu3d.train.trainer import Trainer

RECORD_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_s")
MOE_KEYS = ("aux_loss", "z_loss", "tokens_per_expert", "dropped", "ep_tokens")  # --experts
# what edu3d train's records add (Trainer.stats)
TRAINER_KEYS = ("mem_bytes", "comm_s", "exposed_s", "comm_any_s", "wire_bytes")


def worker(mesh, options: dict, trainer_class=Trainer) -> list[dict]:
    """What every rank of ``edu3d train --dp/--tp/--pp`` runs (called by the launcher):
    ``options`` is the run's flags (:meth:`~edu3d.config.sections.Run.flat`), ``trainer_class``
    the one :class:`~edu3d.train.trainer.Trainer` (or ``--impl torch``'s, the same interface)."""
    run = Run.of(**options)
    config = model_config(run)
    model = GPT(config, seed=run.training.seed)  # the full serial init: shards are cut from it
    corpus = make_corpus(run, config)
    trainer = trainer_class(model, mesh, run)
    return loop(trainer, corpus, run, out=sys.stdout if mesh.rank == 0 else None)


def clip_and_step(optimizer: torch.optim.Optimizer, params, grad_norm: torch.Tensor | float,
                  step: int, run: Run) -> float:
    """Clip by a *given* total gradient norm, set the learning rate, update; returns the lr."""
    coef = clip_coef(grad_norm, run.training.clip)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    lr = lr_at(step, run)
    set_lr(optimizer, lr)
    optimizer.step()
    return lr


def serial_step(model, optimizer, x, y, step: int, run: Run,
                microbatches: int = 1) -> dict:
    """The reference step: forward and backward on the whole global batch, the total
    gradient norm, clip, learning rate, update. Returns ``{"loss", "grad_norm"}``.

    A dense model gives the same step whatever ``microbatches`` is (the batch's rows in that
    many equal pieces, each loss divided by their number). A mixture of experts does not:
    its load-balancing loss (``--aux-scope microbatch``) and its capacity limit count the
    tokens of one forward, a micro-batch. So the reference for a layout whose ranks each run
    ``b`` rows at a time runs ``rows / b`` micro-batches (:func:`reference_microbatches`)."""
    optimizer.zero_grad(set_to_none=True)
    set_aux_scale(1.0 / microbatches)
    total = 0.0
    for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
        _, loss = model(xs, ys)
        (loss / microbatches).backward()
        total += loss.item() / microbatches
    set_aux_scale(1.0)
    end_step(model)  # fp8's delayed scaling: this step's amaxes join the histories
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    clip_and_step(optimizer, params, grad_norm, step, run)
    for layer in (m for m in model.modules() if isinstance(m, MoE)):
        counts = layer.take_stats()["counts"]  # the step's assignments, every micro-batch
        if layer.balance == "bias":
            layer.update_bias(counts)
    return {"loss": total, "grad_norm": grad_norm.item()}


def reference_microbatches(run: Run) -> int:
    """How many micro-batches the serial reference of ``run``' layout runs: one per
    micro-batch of every data-parallel rank (what a mixture of experts' token groups need),
    or, under ``--aux-scope global`` without a capacity limit split over data ranks, the
    layout's own count: each micro-batch is then one group over every rank, as serially."""
    dp, m = run.layout.dp, run.microbatches
    whole = run.model.aux_scope == "global" and (run.model.capacity_factor == 0 or dp == 1)
    return m if whole else dp * m


def train_step(model, optimizer, x, y, step: int, run: Run,
               microbatches: int = 1) -> dict:
    """One serial step on the global batch ``(x, y)``, returned as a full record."""
    t0 = time.perf_counter()
    out = serial_step(model, optimizer, x, y, step, run, microbatches)
    return _record(step, out, lr_at(step, run), x.numel(), time.perf_counter() - t0)


def _record(step: int, out: dict, lr: float, tokens: int, seconds: float) -> dict:
    return {"step": step, "loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]),
            "lr": lr, "tokens_per_s": tokens / seconds}


def _emit(rec: dict, run: Run, out) -> None:
    if out is None:
        return
    if run.launch.json:
        print(json.dumps(rec), file=out, flush=True)
        return
    row = (f"{rec['step']:>5} {rec['loss']:>8.4f} {rec['grad_norm']:>10.4f} "
           f"{rec['lr']:>9.2e} {rec['tokens_per_s']:>9.0f}")
    if _is_terminal(out):  # a progress bar: one line, rewritten in place
        done = rec["step"] / run.training.steps
        bar = "#" * int(30 * done)
        end = "\n" if rec["step"] == run.training.steps else ""
        print(f"\r[{bar:<30}] {row}", end=end, file=out, flush=True)
    else:
        print(row, file=out, flush=True)


def _is_terminal(out) -> bool:
    return bool(getattr(out, "isatty", lambda: False)())


def summary(records: list[dict], seconds: list[float], wall: float | None = None) -> str:
    """The end of a run in words: throughput, the fullest rank's memory, and the share of
    the run's wall time (``wall``, else the steps' ``seconds``) some collective covered on
    rank 0, in all and on each axis, with the part no compute hid (exposed). The wall time
    is what ``--monitor``'s final table divides by: the same shares."""
    rate = sorted(r["tokens_per_s"] for r in records)[len(records) // 2]
    lines = [f"throughput: {rate:,.0f} tokens/s (median over {len(records)} steps)"]
    mem = records[-1].get("mem_bytes")
    if mem:
        parts = ", ".join(f"{k} {mem[k] / 2**20:.2f}" for k in
                          ("params", "grads", "optimizer", "activations"))
        lines.append(f"memory of the fullest rank: {mem['total'] / 2**20:.2f} MiB ({parts})")
    comm: dict[str, float] = {}
    exposed: dict[str, float] = {}
    for r in records:
        for into, key in ((comm, "comm_s"), (exposed, "exposed_s")):
            for group, s in r.get(key, {}).items():
                into[group] = into.get(group, 0.0) + s
        for into, key in ((comm, "covered"), (exposed, "exposed")):
            into["any"] = into.get("any", 0.0) + r.get("comm_any_s", {}).get(key, 0.0)
    if comm.get("any"):
        total = wall or sum(seconds)
        pct = lambda s: f"{min(100.0, 100 * s / total):.0f}%"  # noqa: E731 - spans cross step edges
        axes = ", ".join(f"{g} {pct(s)} ({pct(exposed.get(g, 0.0))} exposed)"
                         for g, s in sorted(comm.items()) if g != "any")
        lines.append(f"communication on rank 0: some collective runs during "
                     f"{pct(comm.get('any', 0.0))} of the run's time, "
                     f"{pct(exposed.get('any', 0.0))} with no compute beside it; by axis: {axes}")
    return "\n".join(lines)


def loop(trainer, corpus: SyntheticCorpus, run: Run, out=None) -> list[dict]:
    """Feed global batch ``step`` to ``trainer.step`` for every step; record and print
    every ``--log-every`` steps (and the last): between two, the loss stays on the device and
    nothing waits for it; a record's ``tokens_per_s`` covers the steps since the previous one.

    With ``--ckpt-dir`` the state is saved as ``--save-every`` says (:mod:`edu3d.ckpt.format`),
    and ``--resume`` starts after the newest complete checkpoint with the records it kept, so
    the list returned is the whole run's either way."""
    if out is not None and not run.launch.json and not _is_terminal(out):
        print(f"{'step':>5} {'loss':>8} {'grad norm':>10} {'lr':>9} {'tok/s':>9}", file=out)
    records, seconds = [], []
    ckpt = None
    if run.checkpoint.ckpt_dir:
        ckpt = Checkpointer(trainer, run, model_config(run))
        if run.checkpoint.resume:
            records = ckpt.resume()  # the records of the steps the checkpoint holds
    rank = trainer.mesh.rank
    status = Publisher.for_run(trainer, run.training.steps)  # for a live monitor; None when serial
    deferred = isinstance(trainer, Trainer)  # its step can leave the loss on the device
    memory = memory_recorder.MemoryRecorder(trainer) if run.launch.memory_timeline else None
    spent, steps_since, tokens = 0.0, 0, 0  # since the last logged step
    began = time.perf_counter()  # the wall time the monitor's final table divides by
    for step in range(len(records) + 1, run.training.steps + 1):
        faults.maybe_inject(run.launch.inject_fault, rank, step, run.launch.attempt)
        x, y = global_batch(corpus, run, step)  # y is None under --batching
        due = step % run.launch.log_every == 0 or step == run.training.steps
        t0 = time.perf_counter()
        watch = memory is not None and step == run.training.steps > 1  # --memory-timeline
        with memory.watch(step) if watch else contextlib.nullcontext():
            result = trainer.step(x, y, step, read=False) if deferred and not due else \
                trainer.step(x, y, step)
        spent += time.perf_counter() - t0  # a GPU's queued work is waited for when due
        steps_since, tokens = steps_since + 1, tokens + batch_tokens(x)
        if status is not None:
            status.after_step(step, batch_tokens(x))  # every step: the monitor counts steps, tokens
        if not due:
            continue
        seconds.append(spent)
        rec = _record(step, result, lr_at(step, run), tokens, spent)
        spent, steps_since, tokens = 0.0, 0, 0
        if y is None:  # --batching: the share of computed positions that were padding
            rec["pad_waste"] = x.waste(run.layout.dp * run.microbatches)
        rec.update({k: result[k] for k in ("skipped", "loss_scale", *MOE_KEYS)
                    if k in result})  # fp16, mixture of experts
        rec.update(trainer.stats())
        records.append(rec)
        if ckpt is not None:
            ckpt.after_step(step, records)  # saves when due; may add the time it blocked
        _emit(rec, run, out)
    wall = time.perf_counter() - began
    if status is not None:
        status.close()
    if memory is not None and memory.samples:  # --memory-timeline: the last step's
        _write_timeline(memory, run, records, out)
    if ckpt is not None:
        ckpt.close()  # waits for an asynchronous save still in flight
    if out is not None and not run.launch.json and seconds:  # the steps this process ran
        print(summary(records[-len(seconds):], seconds, wall), file=out, flush=True)
        if ckpt is not None and ckpt.history:
            blocked = sum(r.get("ckpt_blocked_s", 0.0) for r in records[-len(seconds):])
            kept = ""
            if ckpt.keep:
                kept = (f"; kept {', '.join(map(str, complete_steps(run.checkpoint.ckpt_dir)))} "
                        f"(--keep-last {ckpt.keep})")
            print(f"checkpoints: steps {', '.join(str(h['step']) for h in ckpt.history)} in "
                  f"{run.checkpoint.ckpt_dir}{kept}; training waited {blocked:.2f} s for them"
                  + (" (written in the background)" if ckpt.background else ""),
                  file=out, flush=True)
    return records


def _write_timeline(memory, run: Run, records: list[dict], out) -> None:
    """Collect every rank's timeline of the recorded step on rank 0, which writes the file
    (:mod:`edu3d.train.memory_recorder`) and says where its peak is."""
    timelines = memory_recorder.gather_timelines(memory)
    if timelines is None:
        return
    stats = records[-1].get("mem_bytes") if records and records[-1]["step"] == run.training.steps \
        else None
    doc = memory_recorder.document(run, timelines, stats)
    memory_recorder.write(run.launch.memory_timeline, doc)
    if out is not None and not run.launch.json:
        print(f"memory timeline of step {doc['step']} in {run.launch.memory_timeline}: "
              f"{memory_recorder.peak_line(doc)}", file=out, flush=True)


def _describe(run, config, corpus) -> None:
    """One line on stderr naming the model (not its whole config), its size and the losses
    to expect."""
    c = config
    shape = (f"{c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads, seq {c.seq_len}, "
             f"vocab {c.vocab_size}")
    params = f"{num_params_from_config(config):,} parameters"
    if c.n_experts:
        shape += f", {c.n_experts} experts top-{c.topk}"
        params = (f"{total_params(config):,} parameters, {active_params(config):,} active per "
                  "token")
    floor = corpus.entropy_floor()
    best = f"best possible {floor:.2f} nats" if floor is not None else \
        f"{run.batch.data}: real text, no known floor"
    print(f"{run.model.preset} ({shape}): {params}; loss at init ~ ln(vocab) = "
          f"{math.log(config.vocab_size):.2f}, {best}", file=sys.stderr, flush=True)


def run(job: Run | Checked, out=None, trainer_class=Trainer) -> list[dict]:
    """Train for ``run.training.steps`` steps, serially or on the run's layout; print to
    ``out`` (default: the current ``sys.stdout``) and return one record per step.
    ``job``: a run that passed :func:`edu3d.train.preflight.preflight` (``edu3d train``
    checks before it calls), trusted as it is, or a plain :class:`~edu3d.config.sections.Run`,
    which goes through the pre-flight here, once. ``trainer_class``:
    :class:`~edu3d.train.trainer.Trainer`, or one with its interface (``--impl torch``)."""
    out = out or sys.stdout
    checked = job if isinstance(job, Checked) else preflight(job)
    run, config = checked.run, checked.config
    if run.parallel.impl == "torch" and trainer_class is Trainer:
        raise ValueError("impl='torch' trains with PyTorch's own APIs: pass trainer_class="
                         "edu3d.production.torch_impl.TorchTrainer (as edu3d train does)")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # the course's runs are multi-process; one thread each
    for warning in checked.warnings:
        print(f"edu3d train: {warning}", file=sys.stderr, flush=True)
    ck = run.checkpoint
    if ck.ckpt_dir and ck.resume:
        step = checked.resume_step
        print(f"edu3d train: resuming from {ck.ckpt_dir} at step {step}" if step else
              f"edu3d train: no complete checkpoint in {ck.ckpt_dir}: starting at step 1",
              file=sys.stderr, flush=True)
    corpus = make_corpus(run, config)
    _describe(run, config, corpus)
    if run.world_size == 1:
        return loop(trainer_class(GPT(config, seed=run.training.seed), None, run), corpus, run,
                    out)
    return _run_parallel(run, run.layout, out, trainer_class)


def _json_record(line: str) -> dict | None:
    """A ``--json`` step record printed by rank 0, or None for any other line."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("step"), int) else None


def _run_parallel(run: Run, layout, out, trainer_class) -> list[dict]:
    """Launch ``layout.world_size`` ranks; rank 0's stdout (the records) goes to ``out``
    untouched, everything else to stderr with its rank prefix.

    With ``--max-restarts N``, a rank that dies or hangs stops every rank and the run starts
    again from the newest complete checkpoint, up to N times (torchrun's elastic agent does
    the same with ``--max-restarts``); the records returned are then the whole run's.

    With ``--json`` each step reaches ``out`` once, as it happens: a restart replays the steps
    between its checkpoint and the failure, and a replayed step already printed is not printed
    again. Recovery is exact, so the record printed is the recovered one; were a replayed loss
    ever different, stderr says so (holding records back until a checkpoint commits them
    would print nothing for minutes on a run that saves rarely)."""
    shown: dict[int, float] = {}  # --json: step -> loss of the records printed so far

    def echo(rank, stream, line):
        if rank == 0 and stream == "stdout":
            rec = _json_record(line) if run.launch.json else None
            if rec is not None and rec["step"] in shown:
                if str(rec["loss"]) != str(shown[rec["step"]]):  # (NaN equals NaN here)
                    print(f"edu3d train: step {rec['step']} replayed after the restart with "
                          f"loss {rec['loss']!r}, not {shown[rec['step']]!r} as printed",
                          file=sys.stderr, flush=True)
                return
            if rec is not None:
                shown[rec["step"]] = rec["loss"]
            print(line, file=out, flush=True)
        else:
            print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)

    print(f"launching {layout.world_size} ranks ({layout})", file=sys.stderr, flush=True)
    options = run.flat()
    restarts = run.checkpoint.max_restarts
    for attempt in range(restarts + 1):
        options["attempt"] = attempt
        view = live.Terminal(new_run_dir("train"), layout.world_size) if run.launch.monitor else None
        echoing = view.launch_options(echo) if view is not None else {"echo": echo}
        try:
            res = api.launch(worker, layout.world_size // (run.launch.nnodes or 1),  # on this node
                         args=(options, trainer_class), layout=layout,
                         timeout=run.launch.timeout, name="train", heartbeat=run.launch.heartbeat,
                         torchrun_args=node_args(**node_options(run)), **echoing)
            return res.results[0]
        except LaunchTimeout:
            raise  # the whole run's time is spent: nothing to restart into
        except LaunchError as err:
            if attempt == restarts:
                raise
            step = resume_from(run.replace(attempt=attempt + 1))
            where = f"the checkpoint of step {step}" if step else "the start (no checkpoint yet)"
            print(f"edu3d train: {str(err).splitlines()[0]}; restart {attempt + 1} of "
                  f"{restarts}: every rank starts again from {where}", file=sys.stderr,
                  flush=True)
            options["resume"] = True
        finally:
            if view is not None:
                view.close()  # the last table, also after a failure
    raise AssertionError("unreachable")
