"""``edu3d calibrate``: this machine measured in a minute, as edu3d's ranks run on it.

After reading this file you should understand what a performance model needs to know about a
machine and how each number is measured so that a busy machine disturbs it least:

* **linear layers by size** (:func:`linears`): forward and backward (three matmuls, in the
  layouts autograd runs them) at a handful of the shapes the course's models use, in fp32
  and bf16, one thread (``OMP_NUM_THREADS=1``, as every rank runs), and at 1x1x1 (what the
  same calls cost with no arithmetic);
* **memory bandwidth** (:func:`stream`): a copy of a buffer far larger than the caches;
* **the attention core** (:func:`attention`): PyTorch's fused kernel, forward and backward;
* **eager overhead** (:func:`edu3d.bench.trainer_steps.eager`): Trainer steps of a GPT so
  narrow that its arithmetic is nil, with 1, 2 and 4 micro-batches, through the real training
  loop: what Python, the dispatcher and autograd cost per kernel and per step, which is most
  of a step of the course's tiny models on a CPU (their median: what tune reports);
* **recomputation's checkpoints**: the same Trainer steps with every block's attention
  core checkpointed (``torch.utils.checkpoint``: the saved-tensor hooks, the region's inputs
  and RNG state kept, its forward re-run from Python): what a checkpointed region costs
  beyond the kernels it recomputes;
* **whole blocks** (:func:`layers`): one GPT block forward and backward at the tiny and
  small presets' sizes, which the fit splits into the model's own ops;
* **collectives** (:func:`collectives`): one real 2-rank launch through edu3d's launcher,
  timing edu3d's traced all-reduce, all-gather, reduce-scatter and send/recv
  (:mod:`edu3d.distributed.comm`, what the trainer calls) from 4 bytes to 4 MiB, between
  slices of arithmetic as in a step, and the eager Trainer steps again on the 2 ranks:
  serial on both at once, on the wall clock (what ranks beside each other cost one another),
  data-parallel (what its hooks add) and tensor-parallel with SP (what a rank's host spends
  around each of its collectives);
* the **cores** this process may use and the host's memory.

**Load.** Other processes steal time at random: so a compute kernel is timed by this thread's
CPU time (what their load moves least), its *minimum* over repetitions. A collective waits
for its peer, so it is timed on the wall clock; the fit takes the *mean* (what a step meets:
a step sums dozens of collectives, and a sum follows their mean, which the heavy tail of a
rank woken late puts well above the median: on the 2-core VM a 64-byte all-reduce has a
median of 0.45-0.8 ms and a 90th percentile of 2.7-4.5 ms) and the source records the
median's and the minimum's (an idle machine's). Each part has a share of the budget (at least 3 repetitions each). On
a GPU everything runs there with a synchronised wall clock, collectives on NCCL.

:mod:`edu3d.bench.profile_fit` turns the measurements into the profile file that ``edu3d
plan --hardware this-machine`` and ``edu3d tune`` read (:func:`edu3d.plan.hardware.user_profiles`).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from edu3d.bench import autotune, cpu_fit, records
from edu3d.bench.trainer_steps import eager
from edu3d.config.layout import Layout
from edu3d.config.sections import Run
from edu3d.distributed import comm, runtime
from edu3d.distributed.mesh import Mesh
from edu3d.launch import LaunchError, launch
from edu3d.model.gpt import Block
from edu3d.plan import hardware, kernels, recipes
from edu3d.plan.estimate import spec_of
from edu3d.plan.stage_costs import cut_of
from edu3d.train.preflight import check_args

SHAPES = {  # (M, N, K): tokens x out x in, from the course's models (d 64-768, b·s 32-4096)
    "cpu": [(32, 64, 64), (128, 192, 64), (256, 256, 64), (128, 256, 256), (512, 1024, 256),
            (1024, 256, 1024), (512, 512, 512), (1024, 1536, 512)],
    "cuda": [(256, 256, 256), (1024, 1024, 1024), (2048, 4096, 1024), (4096, 4096, 4096),
             (8192, 8192, 4096), (8192, 8192, 8192)],
}
ATTENTION = {"cpu": (4, 8, 128, 32), "cuda": (8, 16, 2048, 128)}  # b, heads, s, head_dim
LAYERS = {  # one GPT block, forward and backward: (b, s, d_model, heads), the tiny and small presets'
    "cpu": [(4, 32, 64, 4), (2, 128, 256, 8)], "cuda": [(4, 1024, 1024, 16), (2, 2048, 2048, 16)]}
STREAM_BYTES = {"cpu": 64 * 2**20, "cuda": 2 * 2**30}
COLLECTIVE_SIZES = (4, 4096, 65536, 2**20, 4 * 2**20)  # bytes
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
STEP_WORK = 3  # small matmuls between two collectives (~0.1 ms of a step's arithmetic)
DP_REPS = 10  # data-parallel Trainer steps per micro-batch count (the ranks must agree)
SHARES = {"matmul": 0.2, "stream": 0.03, "attention": 0.05, "eager": 0.12, "recompute": 0.05,
          "layers": 0.08}  # the rest: the 2-rank launch
MIN_REPS, MAX_REPS = 3, 200


class Clock:
    """Seconds of work on this device: this thread's CPU time on a CPU (other processes'
    load moves it least), a synchronised wall clock on a GPU; with ``wall``, the wall clock
    on a CPU too (what ranks running at once lose to each other)."""

    def __init__(self, device: str, wall: bool = False):
        self.cuda, self.wall = device == "cuda", wall or device == "cuda"
        self.name = ("CUDA-synchronised wall clock" if self.cuda else "the wall clock" if wall
                     else "this thread's CPU time, one thread")

    def now(self) -> float:
        if self.wall:
            if self.cuda:
                torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()


def fastest(fn: Callable[[], object], clock: Clock, budget_s: float,
            reps: int | None = None) -> float:
    """The minimum time of ``fn`` over repetitions after one warm-up call: until ``budget_s``
    of wall time is spent (at least :data:`MIN_REPS`, at most :data:`MAX_REPS`), or exactly
    ``reps`` (ranks whose ``fn`` calls collectives must agree on the count)."""
    fn()
    best, done, end = float("inf"), 0, time.perf_counter() + budget_s
    while done < reps if reps is not None else done < MIN_REPS or (
            time.perf_counter() < end and done < MAX_REPS):
        t0 = clock.now()
        fn()
        best = min(best, clock.now() - t0)
        done += 1
    return best


# ---- one process ---------------------------------------------------------------------------------
def linears(device: str, dtype: torch.dtype, clock: Clock, budget_s: float) -> dict:
    """The fastest forward + backward of a linear layer ``Y = X·Wᵀ + b`` at each of
    :data:`SHAPES` (``(M, N, K)``: three matmuls, in the layouts autograd runs them), and at
    1x1x1 (no arithmetic: what the same calls cost in dispatch alone)."""
    shapes = SHAPES[device]
    out = []
    for m, n, k in [(1, 1, 1)] + shapes:
        x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(m, n, device=device, dtype=dtype)

        def step():
            x.grad = w.grad = b.grad = None
            F.linear(x, w, b).backward(g)

        out.append(fastest(step, clock, budget_s / (len(shapes) + 1)))
    return {"shapes": [list(s) for s in shapes], "seconds": out[1:], "dispatch_s": out[0]}


def stream(device: str, clock: Clock, budget_s: float) -> dict:
    """A copy of :data:`STREAM_BYTES` (far beyond the caches): read once, written once."""
    n = STREAM_BYTES[device] // 4
    src, dst = torch.ones(n, device=device), torch.empty(n, device=device)
    return {"bytes": n * 4, "seconds": fastest(lambda: dst.copy_(src), clock, budget_s)}


def attention(device: str, dtype: torch.dtype, clock: Clock, budget_s: float) -> dict:
    """Causal ``scaled_dot_product_attention`` forward and backward at :data:`ATTENTION`;
    FLOPs counted as :mod:`edu3d.plan.kernels` counts them (2·b·s²·h·d forward, 2.5x that back)."""
    b, h, s, d = ATTENTION[device]
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return {"shape": f"b={b} heads={h} s={s} head_dim={d} {str(dtype).split('.')[-1]}",
            "flops": 3.5 * 2.0 * b * s * s * h * d, "seconds": fastest(step, clock, budget_s)}


def layers(device: str, clock: Clock, budget_s: float) -> list[dict]:
    """One block of edu3d's GPT forward and backward at each of :data:`LAYERS`: the fastest
    time, and its ops as :mod:`edu3d.plan.kernels` lists them (what the fit splits it into)."""
    out = []
    for b, s, d, heads in LAYERS[device]:
        run = Run.of(model="tiny", layers=1, d_model=d, heads=heads, seq=s, global_batch=b,
                     microbatches=1, precision="fp32" if device == "cpu" else "bf16")
        config, _ = check_args(run)
        block = Block(config).to(device)
        x = torch.randn(b, s, d, device=device, requires_grad=True)
        g = torch.randn(b, s, d, device=device)

        def step():
            block.zero_grad(set_to_none=True)
            x.grad = None
            with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):  # as trained
                y = block(x)
            y.backward(g)

        cut = cut_of(spec_of(run), run, recipes.recipe_of("edu3d"))
        layer, _ = kernels.layer(cut, "none")
        out.append({"shape": f"b={b} s={s} d={d} heads={heads}",
                    "seconds": fastest(step, clock, budget_s / len(LAYERS[device])),
                    "ops": [[o.kind, o.flops, o.bytes, o.kernels] for o in layer]})
    return out


# ---- two processes -------------------------------------------------------------------------------
def resident_bytes() -> int:
    """This process's resident memory (``VmRSS``), 0 where ``/proc`` has none."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def collectives_worker(mesh, budget_s: float, sizes=COLLECTIVE_SIZES) -> dict | None:
    """Launch target: each collective at each size, repeated between slices of arithmetic as
    in a training step (no barrier: the ranks arrive as they come); rank 0 returns the median
    and the minimum wall time of each, with its resident memory at start."""
    rss, rank, n = resident_bytes(), dist.get_rank(), dist.get_world_size()
    dev = runtime.device()
    a, w = torch.randn(128, 64, device=dev), torch.randn(64, 256, device=dev)
    out = {op: [] for op in OPS}
    for op in OPS:
        for size in sizes:
            numel = max(1, size // 4)
            full = torch.ones(numel * (1 if op == "all_reduce" else n), device=dev)
            part = torch.ones(numel, device=dev)
            peer = (rank + 1) % n

            def once():
                if op == "all_reduce":
                    comm.all_reduce(full)
                elif op == "all_gather":
                    comm.all_gather(full, part)
                elif op == "reduce_scatter":
                    comm.reduce_scatter(part, full)
                elif rank == 0:  # a round trip, halved: one message each way
                    comm.send(part, peer)
                    comm.recv(part, peer)
                elif rank == 1:
                    comm.recv(part, 0)
                    comm.send(part, 0)
                if dev.type == "cuda":
                    torch.cuda.synchronize()

            seconds, cpu = [], []
            end = time.perf_counter() + budget_s / (len(OPS) * len(sizes))
            once()
            while True:  # every rank repeats as often as rank 0 says
                for _ in range(STEP_WORK):
                    a @ w
                t0, c0 = time.perf_counter(), time.thread_time()
                once()
                seconds.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)  # this thread's part of the wall time
                go = torch.tensor([len(seconds) < MIN_REPS or time.perf_counter() < end],
                                  dtype=torch.int32)
                dist.broadcast(go, 0)
                if not go.item() or len(seconds) >= 100:
                    break
            half = 2 if op == "send_recv" else 1
            out[op].append([numel * 4 * (1 if op == "all_reduce" else n)
                            if op != "send_recv" else numel * 4,
                            statistics.median(seconds) / half, min(seconds) / half,
                            min(cpu) / half, statistics.fmean(seconds) / half])
    together = eager(dev.type, Clock(dev.type, wall=True), 0.0, None, reps=DP_REPS)  # serial,
    # every rank at once: what ranks running beside each other cost one another
    hooks = eager(dev.type, Clock(dev.type), 0.0, mesh, reps=DP_REPS)  # data parallel: hooks
    tp = Mesh.build(Layout(tp=n))  # tensor parallel + SP: dozens of collectives a micro-batch
    wrapped = eager(dev.type, Clock(dev.type), 0.0, tp, reps=DP_REPS)
    tp.release()
    return {"ops": out, "runtime_bytes": rss, "ranks": n, "backend": dist.get_backend(),
            "data_parallel": hooks, "tensor_parallel": wrapped, "together": together} \
        if rank == 0 else None


def collectives(budget_s: float, ranks: int) -> dict:
    """One real launch of ``ranks`` ranks running :func:`collectives_worker`; ``budget_s``
    bounds its timing loops (the launch adds its start-up)."""
    try:
        run = launch(collectives_worker, ranks, args=(budget_s,), timeout=max(120.0, 6 * budget_s),
                     layout=Layout(dp=ranks), echo=False, name="calibrate", pool=False)
    except LaunchError as err:
        raise cpu_fit.CalibrationError(f"the {ranks}-rank launch failed: "
                                           f"{str(err).splitlines()[0]}") from None
    return run.results[0]


# ---- the machine ---------------------------------------------------------------------------------
def host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def about() -> str:
    """What every source starts with: when, where, with which torch."""
    return (f"measured by edu3d calibrate on {datetime.date.today().isoformat()}, "
            f"{platform.node()}, torch {torch.__version__}")


def machine(device: str, gpus: int) -> dict:
    """What the profile says of the machine beyond the timings, and where each came from."""
    cores = autotune.cores()
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return dict(name=hardware.USER_PROFILE, description=f"{props.name} x {gpus}, "
                    f"{platform.node()}: measured by edu3d calibrate",
                    memory_bytes=props.total_memory, memory_from="torch.cuda total_memory",
                    allocator_factor=max(1.0, torch.cuda.max_memory_reserved()
                                         / max(torch.cuda.max_memory_allocated(), 1)),
                    allocator_from="max_memory_reserved / max_memory_allocated after the runs",
                    ranks_per_node=max(1, gpus), ranks_per_node_from="GPUs visible", cores=cores)
    return dict(name=hardware.USER_PROFILE, description=f"{records.cpu_name()}, {cores} cores, "
                f"{platform.node()}: measured by edu3d calibrate (a CPU: gloo on loopback)",
                memory_bytes=host_memory(), memory_from="MemTotal of /proc/meminfo, shared by "
                "every rank of this machine", allocator_factor=1.0, allocator_from="no caching "
                "allocator on a CPU: tensors are allocated and freed as they come, reserved = "
                "allocated", ranks_per_node=64, ranks_per_node_from="one machine: every group "
                "of ranks stays on loopback (64, the most a profile allows)", cores=cores)


def measure(budget_s: float = 60.0, progress: Callable[[str], None] | None = None) -> dict:
    """Every measurement :func:`edu3d.bench.profile_fit.profile_from` needs, in about
    ``budget_s`` seconds."""
    say = progress or (lambda line: None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(1)  # as each rank runs (OMP_NUM_THREADS=1)
    clock, start = Clock(device), time.perf_counter()

    def part(name: str, share: float, fn):
        t0 = time.perf_counter()
        say(f"{name} ...")
        out = fn(budget_s * share)
        say(f"{name}: done in {time.perf_counter() - t0:.1f} s")
        return out

    mm = {p: part(f"{p} linear layers at {len(SHAPES[device])} sizes", SHARES["matmul"] / 2,
                  lambda b, d=d: linears(device, d, clock, b))
          for p, d in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    main = "bf16" if device == "cuda" else "fp32"
    m = {"device": device, "dtype": main, "clock": clock.name, "matmul": mm,
         "stream": part("memory bandwidth (a streaming copy)", SHARES["stream"],
                        lambda b: stream(device, clock, b)),
         "attention": part("attention core, forward and backward", SHARES["attention"],
                           lambda b: attention(device, getattr(torch, {"fp32": "float32",
                                                                       "bf16": "bfloat16"}[main]),
                                               clock, b)),
         "eager": part("eager overhead (Trainer steps of a GPT of width 8)", SHARES["eager"],
                       lambda b: eager(device, clock, b)),
         "recompute": part("recomputation's checkpoints (the same steps, every block "
                           "recomputed)", SHARES["recompute"],
                           lambda b: eager(device, clock, b, recompute="selective")),
         "layers": part(f"{len(LAYERS[device])} GPT blocks, forward and backward",
                        SHARES["layers"], lambda b: layers(device, clock, b))}
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    ranks = min(gpus, 8) if gpus >= 2 else 2
    left = max(5.0, budget_s - (time.perf_counter() - start) - 8.0)  # launch start-up ~8 s
    m["collectives"] = part(f"collectives on {ranks} ranks (one launch)", 0.0,
                            lambda b: collectives(left, ranks))
    m.update(machine(device, gpus))
    say(f"measured in {time.perf_counter() - start:.0f} s")
    return m
