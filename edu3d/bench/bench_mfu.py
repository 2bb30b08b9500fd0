"""``edu3d bench mfu``: model FLOPs utilisation of GPT-2 small on one GPU, edu3d's
:class:`~edu3d.train.trainer.Trainer` beside a bare nanoGPT-shaped loop, in one run.

After reading this file you should understand how MFU is measured and what it counts:

* **the work**: training FLOPs per token ``6N + 12·L·h·s`` (PaLM, appendix B; nanoGPT's
  ``estimate_mfu``): each weight of a matrix multiply does a multiply-add per token forward
  and two backward (6N), and attention's ``QK^T`` and ``AV`` add ``12·L·h·s``. ``N`` is
  nanoGPT's count, every parameter but the position table (with GPT-2's tied embedding the
  token table *is* the LM head's matrix, 768 x 50,304 multiply-adds per token);
* **the rate**: tokens per second over timed steps (after warm-up and compilation), the
  device synchronised before and after, so queued work is counted;
* **the peak**: the device's dense bf16 peak from :data:`PEAKS` (say which one was used), or
  ``--peak-tflops`` for a device not in the table; ``MFU = tokens/s x FLOPs/token / peak``.

The run: GPT-2 small (124M), bf16 autocast with fp32 master weights, sequence 1024, the
vocabulary padded to 50,304, compiled, the largest micro-batch that fits (found by trying,
doubling from 1 then bisecting, eager, before compiling). Both sides see the same batches,
copied from page-locked memory without blocking; repetitions alternate edu3d, bare, edu3d,
bare and each side's median is kept. The goal: MFU >= 45 % on one H100, and edu3d >= bare.
With ``--launched`` a third row runs the same Trainer in a launched rank of a
``tp = pp = dp = 1`` layout (the composed path must cost nothing when an axis is 1).

``edu3d bench mfu`` needs CUDA: on a CPU it refuses in one line. ``python -m
edu3d.bench.bench_mfu --allow-cpu --peak-tflops P --model tiny`` runs the same code on the
CPU as an estimate against a peak you give.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from edu3d.bench import harness as bench
from edu3d.config.layout import Layout
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.train.data import SyntheticCorpus
from edu3d.train.optim import kernel_for, lr_at, param_groups
from edu3d.config.sections import Run
from edu3d.train.preflight import check_args
from edu3d.train.trainer import Trainer

# dense bf16 tensor-core peaks, FLOP/s (NVIDIA's data sheets; "with sparsity" is twice these)
PEAKS = {"H100 SXM": 989e12, "H100 PCIe": 756e12, "H200": 989e12, "A100": 312e12}
REFERENCE = "bare loop (nanoGPT: whole-model torch.compile, fused AdamW)"


def peak_for(device_name: str) -> tuple[str, float] | None:
    """``(table entry, FLOP/s)`` for a CUDA device name, or None when it is not in the table.
    ``NVIDIA H100 80GB HBM3`` is the SXM part; the PCIe part says ``PCIe``; an H100 NVL or
    another part is unknown (give ``--peak-tflops``)."""
    name = device_name.upper()
    if "H100" in name:
        if "PCIE" in name:
            return "H100 PCIe", PEAKS["H100 PCIe"]
        if "SXM" in name or "HBM3" in name:
            return "H100 SXM", PEAKS["H100 SXM"]
        return None
    for key in ("H200", "A100"):
        if key in name:
            return key, PEAKS[key]
    return None


def flops_counted(config) -> dict:
    """The terms of ``6N + 12·L·h·s`` for ``config`` (nanoGPT's N: all parameters but the
    position table; an untied token table is a lookup and is left out too)."""
    d, vocab = config.d_model, config.padded_vocab
    n = config.n_layers * config.block_params + 2 * d + d * vocab  # blocks, ln_f, LM head
    attention = 12 * config.n_layers * d * config.seq_len
    return {"N": n, "six_n": 6 * n, "attention": attention, "per_token": 6 * n + attention}


def formula(config) -> str:
    f = flops_counted(config)
    return (f"FLOPs/token = 6N + 12·L·h·s = 6 x {f['N']:,} + 12 x {config.n_layers} x "
            f"{config.d_model} x {config.seq_len} = {f['six_n']:,} + {f['attention']:,} = "
            f"{f['per_token']:,}")


def bare_step(model, optimizer, x, y, step, args, device) -> torch.Tensor:
    """nanoGPT's step: batch in, autocast forward, backward, clip, fused AdamW, zero_grad."""
    x, y = (t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
            for t in (x, y))
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args)
    bf16 = args.precision.dtype == "bf16"
    with torch.autocast(device.type, dtype=torch.bfloat16 if bf16 else torch.float32, enabled=bf16):
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.training.clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _fits(model, b: int, config, device) -> bool:
    """One eager forward and backward of ``b`` sequences in bf16 on ``device``."""
    try:
        x = torch.randint(0, config.vocab_size, (b, config.seq_len), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(x, x)
        loss.backward()
        _sync(device)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def largest_micro_batch(model, config, device, limit: int = 256) -> int:
    """The largest micro-batch whose step fits, by trying: 1, 2, 4, ... then bisecting."""
    ok, b = 0, 1
    while b <= limit and _fits(model, b, config, device):
        ok, b = b, 2 * b
    if ok == 0:
        raise RuntimeError("not even one sequence fits on this device")
    lo, hi = ok, min(b, limit + 1)  # lo fits, hi does not (or is past the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(model, mid, config, device) else (lo, mid)
    return lo


def measure(model: str = "gpt2-small", micro_batch: int | None = None, steps: int = 10,
            reps: int = 3, warmup: int = 3, compile: bool = True, peak: float | None = None,
            peak_name: str | None = None, device: str = "cuda", launched: bool = False) -> dict:
    """Both sides on one device; the report with tokens/s, TFLOPS and MFU of each."""
    dev = torch.device(device)
    args = Run.of(model=model, precision="bf16", vocab_pad=64, compile=compile, steps=steps,
                  log_every=steps, lr=3e-4)
    config, _ = check_args(args)
    bare = GPT(config, seed=0).to(dev)
    trainer = Trainer(GPT(config, seed=0).to(dev), None, args)  # resident during the search
    if micro_batch is None and dev.type != "cuda":
        micro_batch = 1
    if micro_batch is None:
        bench.progress("searching the largest micro-batch that fits (eager)")
        micro_batch = largest_micro_batch(bare, config, dev)
    groups = param_groups(bare.parameters(), args.training.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=args.training.lr, betas=(0.9, 0.95), **kernel_for(groups))
    bare_model = torch.compile(bare) if compile else bare
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)

    def edu3d_side(n):
        for s in range(1, n + 1):
            trainer.step(*batches[s % 4], s, read=False)

    def bare_side(n):
        for s in range(1, n + 1):
            bare_step(bare_model, optimizer, *batches[s % 4], s, args, dev)

    sides = {"edu3d": edu3d_side, "bare": bare_side}
    while True:  # both models' AdamW moments, allocated at the first step, may not fit yet
        batches = [corpus.batch(s, micro_batch) for s in range(1, 5)]  # data is not timed
        bench.progress(f"micro-batch {micro_batch}: warm-up ({warmup} steps each, compiling)")
        try:
            for fn in sides.values():
                fn(warmup)
            _sync(dev)
            break
        except torch.OutOfMemoryError:
            if micro_batch == 1:
                raise
            micro_batch = micro_batch * 3 // 4
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    times: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(reps):
        for name, fn in sides.items():
            _sync(dev)
            t0 = time.perf_counter()
            fn(steps)
            _sync(dev)
            times[name].append((time.perf_counter() - t0) / steps)
        bench.progress_rep(i, reps, times)
    rows = {k: statistics.median(v) for k, v in times.items()}
    if launched:
        del trainer
        rows["edu3d launched tp=pp=dp=1"] = launch(
            launched_worker, 1, args=(model, micro_batch, steps, reps, warmup, compile),
            layout=Layout(), timeout=1200, echo=False, name="bench-mfu").results[0]
    return report(config, micro_batch, rows, peak, peak_name, dev)


def launched_worker(mesh, model, micro_batch, steps, reps, warmup, compile) -> float:
    """The Trainer in a launched rank (``edu3d train --tp 1 --pp 1 --dp 1``'s path): the
    median seconds of one step."""
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    args = Run.of(model=model, precision="bf16", vocab_pad=64, compile=compile, steps=steps,
                    log_every=steps, lr=3e-4, global_batch=micro_batch)
    config, _ = check_args(args)
    trainer = Trainer(GPT(config, seed=0).to(dev), mesh, args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
    batches = [corpus.batch(s, micro_batch) for s in range(1, 5)]
    for s in range(1, warmup + 1):
        trainer.step(*batches[s % 4], s, read=False)
    out = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        for s in range(1, steps + 1):
            trainer.step(*batches[s % 4], s, read=False)
        _sync(dev)
        out.append((time.perf_counter() - t0) / steps)
    return statistics.median(out)


def report(config, micro_batch: int, seconds: dict, peak: float, peak_name: str, dev) -> dict:
    """Tokens/s, achieved TFLOPS and MFU of each side from its median step time."""
    tokens = micro_batch * config.seq_len
    per_token = flops_counted(config)["per_token"]
    rows = []
    for name, s in seconds.items():
        tok_s = tokens / s
        rows.append({"name": name, "step_s": s, "tokens_per_s": tok_s,
                     "tflops": tok_s * per_token / 1e12, "mfu": tok_s * per_token / peak})
    ref = seconds["bare"]
    results = [bench.result(r["name"], r["step_s"], REFERENCE, ref,
                            **{k: v for k, v in r.items() if k != "name"})
               for r in rows if r["name"] != "bare"]
    out = bench.report("mfu", 1, results)
    out.update(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               peak_used=f"{peak_name}: {peak / 1e12:g} TFLOPS dense bf16", micro_batch=micro_batch,
               seq_len=config.seq_len, formula=formula(config), rows=rows)
    return out


def format_report(rep: dict) -> str:
    lines = [f"MFU on {rep['device']}, micro-batch {rep['micro_batch']} x {rep['seq_len']} "
             f"tokens; peak used: {rep['peak_used']}", rep["formula"],
             "MFU = tokens/s x FLOPs/token / peak",
             f"{'':<28} {'step ms':>9} {'tokens/s':>10} {'TFLOPS':>8} {'MFU':>7}"]
    for r in rep["rows"]:
        lines.append(f"{r['name']:<28} {r['step_s'] * 1e3:>9.1f} {r['tokens_per_s']:>10.0f} "
                     f"{r['tflops']:>8.2f} {100 * r['mfu']:>6.1f}%")
    return "\n".join(lines)


def resolve_peak(peak_tflops: float | None, allow_cpu: bool) -> tuple[str, float]:
    """The peak to divide by, or ``SystemExit(2)`` with one line saying what to give."""
    if not torch.cuda.is_available() and not allow_cpu:
        _refuse("needs CUDA and this machine has no GPU; on a GPU run `edu3d bench mfu`, or "
                "estimate here with `python -m edu3d.bench.bench_mfu --allow-cpu --peak-tflops "
                "P --model tiny`")
    if peak_tflops is not None:
        return "given (--peak-tflops)", peak_tflops * 1e12
    if not torch.cuda.is_available():
        _refuse("--allow-cpu: give the CPU's peak with --peak-tflops P (no table entry for it)")
    found = peak_for(torch.cuda.get_device_name())
    if found is None:
        _refuse(f"{torch.cuda.get_device_name()!r} is not in the peak table ("
                f"{', '.join(PEAKS)}): give its dense bf16 peak with --peak-tflops P")
    return found


def _refuse(message: str):
    print(f"edu3d bench mfu: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_benchmark(nprocs: int = 1, json_out: bool = False, reps: int = 3, **opts) -> dict:
    """``edu3d bench mfu``: one GPU, GPT-2 small, the table's peak."""
    if nprocs != 1:
        _refuse(f"-n {nprocs}: MFU is measured on one device; use -n 1")
    name, peak = resolve_peak(opts.pop("peak_tflops", None), opts.pop("allow_cpu", False))
    if not torch.cuda.is_available():
        opts.setdefault("device", "cpu")
    rep = measure(reps=reps, peak=peak, peak_name=name, **opts)
    if not json_out:
        print(format_report(rep), file=sys.stderr)
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edu3d.bench.bench_mfu",
                                description="MFU of edu3d's Trainer and a bare loop on one GPU.")
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--micro-batch", type=int, default=None, help="default: the largest that fits")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--launched", action="store_true",
                   help="add the Trainer in a launched tp=pp=dp=1 rank")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--allow-cpu", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rep = run_benchmark(json_out=True, reps=a.reps, model=a.model, micro_batch=a.micro_batch,
                        steps=a.steps, compile=not a.no_compile, launched=a.launched,
                        peak_tflops=a.peak_tflops, allow_cpu=a.allow_cpu)
    print(json.dumps(rep) if a.json else format_report(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
