"""edu3d's tiny GPT trained with Hugging Face Accelerate, on CPU ranks over gloo.

After reading this file you should understand what Accelerate does for data parallelism and
what it leaves to you:

* ``Accelerator(cpu=True)`` reads the ranks' environment (``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR`` ...) and starts the process group (gloo on CPU);
* ``accelerator.prepare(model, optimizer)`` wraps the model in PyTorch's
  ``DistributedDataParallel`` (the bucketed all-reduce of edu3d's ``--dp-impl bucketed``, its
  ``bucket_cap_mb`` being edu3d's ``--bucket-mb``) and the optimizer in an
  ``AcceleratedOptimizer`` (a thin proxy: the same ``AdamW``, ``step`` and ``param_groups``);
* ``accelerator.backward(loss)`` is ``loss.backward()`` here (no mixed precision, no
  accumulation), and DDP's hooks all-reduce the gradients bucket by bucket meanwhile;
* ``accelerator.clip_grad_norm_`` is ``torch.nn.utils.clip_grad_norm_``: after DDP's
  all-reduce every rank holds the whole averaged gradient, so the local norm *is* the global
  one (edu3d's ZeRO needs its own global norm; DDP does not).

What stays edu3d's, so the run is comparable step by step with ``edu3d train --dp 2``: the
model and its initial weights (``GPT(config, seed)``), global batch ``step`` of the
synthetic corpus cut into the ranks' rows, AdamW with edu3d's weight-decay groups, the
learning-rate schedule and the clipping threshold (:mod:`edu3d.train.optim`).

Three ways to start it, all on 127.0.0.1 only:

* :func:`notebook_launch` from a notebook cell: ``accelerate.notebook_launcher``, which forks
  the ranks from the kernel (the function must be importable, and no Accelerator may exist in
  the kernel yet);
* ``python -m edu3d.production.accelerate_train --launch edu3d/production/accelerate_cpu_2.yaml``
  runs ``accelerate launch --config_file ... -m edu3d.production.accelerate_train`` in this
  process, with the rendezvous store bound to loopback first;
* the bare ``accelerate launch --config_file ... -m edu3d.production.accelerate_train`` works
  too, but torchrun's store then listens on every interface while the run lasts.

Each rank's DDP gets a *recording* communication hook: it performs DDP's default all-reduce
(``allreduce_hook``: divide by the world size, all-reduce with SUM) and notes each bucket's
bytes and parameters, so the run can say which collectives ran.

Accelerate (and psutil, which it brings) come in through imports inside functions: they are
optional libraries, absent from a plain edu3d install.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

from edu3d.distributed.runtime import loopback_ifname
from edu3d.launch.agent import bind_stores_to_loopback
from edu3d.model.gpt import GPT
from edu3d.train.cut import shard_rows
from edu3d.train.data import SyntheticCorpus
from edu3d.train.optim import lr_at, make_optimizer, set_lr
from edu3d.config.sections import Run
from edu3d.train.preflight import model_config

CONFIG = Path(__file__).with_name("accelerate_cpu_2.yaml")


class _Recorder:
    """The state of the recording DDP comm hook: the group and one row per bucket call."""

    def __init__(self, group):
        self.group, self.calls, self.step = group, [], 0


def _recording_allreduce(state: _Recorder, bucket):
    """DDP's default hook (divide by world size, all-reduce SUM), noting what it sends."""
    buf = bucket.buffer()
    state.calls.append({"step": state.step, "op": "all_reduce", "bucket": bucket.index(),
                        "bytes": buf.numel() * buf.element_size(),
                        "params": len(bucket.parameters())})
    return allreduce_hook(state.group, bucket)


def train(steps: int = 5, overrides: dict | None = None) -> dict | None:
    """Train on every rank of a started launch; rank 0 returns the run's summary:
    ``records`` (step, loss, grad_norm, lr, step_s), ``wrapped`` (what ``prepare`` made of
    the model and the optimizer), ``collectives`` (every bucket all-reduce), ``memory``."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    torch.set_num_threads(1)
    # DDP's bucket size is a prepare() knob: edu3d's --bucket-mb becomes bucket_cap_mb
    bucket_mb = Run.of(**(overrides or {})).parallel.bucket_mb
    accelerator = Accelerator(cpu=True, kwargs_handlers=[
        DistributedDataParallelKwargs(bucket_cap_mb=bucket_mb)])
    rank, world = accelerator.process_index, accelerator.num_processes
    args = Run.of(**{"dp": world, "steps": steps, **(overrides or {})})
    config = model_config(args)
    model = GPT(config, seed=args.training.seed)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    optimizer = make_optimizer(model, args)
    wrapped = {"model_before": type(model).__name__, "optimizer_before": type(optimizer).__name__}
    model, optimizer = accelerator.prepare(model, optimizer)
    wrapped.update(model=type(model).__name__, optimizer=type(optimizer).__name__,
                   inner_optimizer=type(getattr(optimizer, "optimizer", optimizer)).__name__,
                   distributed_type=str(accelerator.distributed_type),
                   backend=dist.get_backend() if dist.is_initialized() else None,
                   world_size=world)
    rec = None
    if hasattr(model, "register_comm_hook"):
        wrapped["bucket_cap_mb"] = model.bucket_bytes_cap / 2**20
        rec = _Recorder(dist.group.WORLD)
        model.register_comm_hook(rec, _recording_allreduce)
    records = []
    for step in range(1, steps + 1):
        x, y = corpus.batch(step, args.batch.global_batch)
        x, y = shard_rows(x, rank, world), shard_rows(y, rank, world)
        if rec is not None:
            rec.step = step
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(),
                                           args.training.clip if args.training.clip > 0 else float("inf"))
        lr = lr_at(step, args)
        set_lr(optimizer, lr)
        optimizer.step()
        seconds = time.perf_counter() - t0
        mean_loss = accelerator.reduce(loss.detach().reshape(1), reduction="mean")
        records.append({"step": step, "loss": mean_loss.item(), "grad_norm": float(norm),
                        "lr": lr, "step_s": seconds})
    inner = getattr(optimizer, "optimizer", optimizer)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    memory = {"params": nbytes(model.parameters()),
              "grads": nbytes(p.grad for p in model.parameters() if p.grad is not None),
              "optimizer": nbytes(v for s in inner.state.values() for v in s.values()
                                  if torch.is_tensor(v))}
    if rec is not None:
        first = [c for c in rec.calls if c["step"] == 1]
        last = [c for c in rec.calls if c["step"] == steps]
        wrapped["buckets_step1"] = [c["bytes"] for c in first]
        wrapped["buckets"] = [c["bytes"] for c in last]  # after DDP's rebuild at step 1
    accelerator.wait_for_everyone()
    out = {"records": records, "wrapped": wrapped, "collectives": rec.calls if rec else [],
           "memory": memory, "args": args.flat()}
    accelerator.end_training()  # destroys the process group
    return out if rank == 0 else None


def train_to_file(steps: int, overrides: dict | None, path: str) -> None:
    """:func:`train`, rank 0 writing its summary to ``path`` (notebook_launcher returns
    nothing)."""
    out = train(steps, overrides)
    if out is not None:
        Path(path).write_text(json.dumps(out))


# ---- loopback only ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def loopback_only():
    """While inside: the ranks' environment for this machine (``OMP_NUM_THREADS=1``, gloo on
    the loopback interface) and every TCPStore server this process hosts bound to
    127.0.0.1 (torchrun's static rendezvous would otherwise listen on all interfaces); both
    restored after."""
    saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")}
    saved = (dist.TCPStore, c10d_rendezvous_backend.TCPStore, static_tcp_rendezvous.TCPStore)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_ifname()
    bind_stores_to_loopback()
    static_tcp_rendezvous.TCPStore = dist.TCPStore  # imported by name there: patch it too
    try:
        yield
    finally:
        dist.TCPStore, c10d_rendezvous_backend.TCPStore, static_tcp_rendezvous.TCPStore = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def notebook_launch(steps: int = 5, num_processes: int = 2, overrides: dict | None = None,
                    timeout: float = 180) -> dict:
    """``accelerate.notebook_launcher(train_to_file, num_processes=...)`` from this process
    (a notebook's kernel), on 127.0.0.1 and a free port; returns rank 0's summary.

    The ranks are forked from the kernel; a fork can inherit a lock another thread of the
    kernel held at that moment and hang. After ``timeout`` seconds the ranks this call
    started are killed (by pid) and :class:`TimeoutError` says so, instead of a hung cell."""
    import psutil
    from accelerate import notebook_launcher

    # the ranks are forked from this process: import what each would otherwise import on its
    # own (AdamW's constructor pulls in torch._dynamo, seconds per rank on a busy CPU)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    me = psutil.Process()
    before = {c.pid for c in me.children()}
    expired = threading.Event()

    def kill_ranks() -> None:
        expired.set()
        for child in me.children():
            if child.pid not in before:
                child.kill()

    timer = threading.Timer(timeout, kill_ranks)
    timer.daemon = True
    with tempfile.TemporaryDirectory(prefix="edu3d-accelerate-") as tmp, loopback_only():
        path = str(Path(tmp) / "result.json")
        timer.start()
        try:
            notebook_launcher(train_to_file, args=(steps, overrides, path),
                              num_processes=num_processes, use_port=str(free_port()),
                              master_addr="127.0.0.1")
        except Exception as exc:
            if expired.is_set():
                raise TimeoutError(f"notebook_launcher's ranks made no progress in {timeout:g} s "
                                   "and were killed; run the cell again") from exc
            raise
        finally:
            timer.cancel()
        return json.loads(Path(path).read_text())


def accelerate_launch(config: str | os.PathLike = CONFIG, steps: int = 5,
                      out: str | None = None) -> int:
    """``accelerate launch --config_file CONFIG -m edu3d.production.accelerate_train`` run
    in this process (Accelerate's own CLI), with the stores on loopback."""
    from accelerate.commands.accelerate_cli import main as accelerate_cli

    argv = ["accelerate", "launch", "--config_file", str(config),
            "--main_process_port", str(free_port()), "-m", "edu3d.production.accelerate_train",
            "--steps", str(steps)] + (["--out", out] if out else [])
    saved = sys.argv
    sys.argv = argv
    try:
        with loopback_only():
            accelerate_cli()
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv = saved
    return 0


def table(records: list[dict]) -> str:
    rows = [f"{'step':>4} {'loss':>9} {'grad norm':>9} {'lr':>8} {'step s':>7}"]
    rows += [f"{r['step']:>4} {r['loss']:>9.5f} {r['grad_norm']:>9.4f} {r['lr']:>8.1e} "
             f"{r['step_s']:>7.3f}" for r in records]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m edu3d.production.accelerate_train",
        description="edu3d's tiny GPT trained with Hugging Face Accelerate (DDP over gloo). "
                    "Run under `accelerate launch --config_file "
                    "edu3d/production/accelerate_cpu_2.yaml -m edu3d.production.accelerate_train`, "
                    "or with --launch CONFIG to do that on loopback only.")
    parser.add_argument("--steps", type=int, default=5, help="AdamW steps (default: 5)")
    parser.add_argument("--out", default=None, help="rank 0 writes its summary here (JSON)")
    parser.add_argument("--launch", metavar="CONFIG", default=None,
                        help="run `accelerate launch --config_file CONFIG` on this module, "
                             "stores bound to 127.0.0.1")
    args = parser.parse_args(argv)
    if args.launch:
        return accelerate_launch(args.launch, args.training.steps, args.out)
    result = train(args.training.steps)
    if result is not None:
        w = result["wrapped"]
        print(f"prepare(): {w['model_before']} -> {w['model']}, {w['optimizer_before']} -> "
              f"{w['optimizer']} ({w['distributed_type']}, {w['backend']}, "
              f"{w['world_size']} ranks)", flush=True)
        print(table(result["records"]), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
