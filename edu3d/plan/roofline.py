"""An operation's time on a machine: the roofline, a matmul's efficiency by size, and overhead.

After reading this file you should be able to time any kernel of :mod:`edu3d.plan.kernels` by
hand from a hardware profile (:mod:`edu3d.plan.hardware`):

* **the roofline** (Williams et al. 2009): a kernel is limited either by arithmetic or by
  memory, ``time = max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth)``. A matmul of
  ``4096 x 4096 x 4096`` does 137 GFLOP on 100 MB: arithmetic-bound; a LayerNorm does a
  handful of FLOPs per byte: memory-bound, whatever the GPU's FLOP/s;
* **achieved, not peak**: the best large GEMM reaches ``matmul_efficiency`` of the
  datasheet's peak (80 % on an H100), a streaming copy ``mem_efficiency`` of its bandwidth,
  FlashAttention ``attention_efficiency``. A smaller matmul does worse: its tiles do not fill
  every SM, and filling and draining the pipeline costs a fixed time. One constant captures
  it, ``matmul_half_flops``: the size at which a matmul reaches half its large-size rate,
  ``efficiency(F) = matmul_efficiency · F / (F + matmul_half_flops)``. It is what makes a
  micro-batch of 1 sequence slower per token than one of 16;
* **overhead**: the host launches every kernel (``kernel_overhead`` seconds in eager
  PyTorch, more in a framework with Python around each op). On a GPU the host runs ahead
  and the GPU runs a kernel once it is launched and the previous one is done: big kernels hide
  the launches, a stretch of tiny ones waits for the host (a micro-batch of one sequence split
  eight ways is such a stretch). Layer after layer, a step runs at the slower of the two
  rates: the GPU's work or the host's launches. On a CPU the same core does both, so the two
  add, and ranks that outnumber the cores share them (``cores``).

Precisions pick the peak: bf16/fp16 their tensor-core peak, fp8 its own (twice), fp32 TF32's
on a GPU that has it (PyTorch's matmul default in edu3d) and fp32's on a CPU.
"""

from __future__ import annotations

from edu3d.plan.hardware import Profile
from edu3d.plan.kernels import Op


def peak(profile: Profile, dtype: str, kind: str = "matmul") -> float:
    """FLOP/s of the units a ``dtype`` matmul (or attention core) runs on."""
    if dtype == "fp8" and kind == "matmul" and profile.peak_flops.get("fp8"):
        return profile.peak_flops["fp8"]
    if dtype in ("fp32", "tf32"):
        return profile.peak_flops.get("tf32") or profile.peak_flops["fp32"]
    return profile.peak_flops.get(dtype if dtype in ("bf16", "fp16") else "bf16") or \
        profile.peak_flops["bf16"]


def matmul_efficiency(profile: Profile, flops: float) -> float:
    """The fraction of peak a matmul of ``flops`` reaches: the large-size asymptote times
    ``F / (F + F_half)``."""
    return profile.matmul_efficiency * flops / (flops + profile.matmul_half_flops)


def op_time(op: Op, profile: Profile, dtype: str) -> float:
    """Seconds one op keeps its device busy (the roofline; no launch overhead)."""
    memory = op.bytes / (profile.mem_bandwidth * profile.mem_efficiency)
    if op.kind == "memory" or not op.flops:
        return memory
    if op.kind == "attention":
        rate = peak(profile, dtype, "attention") * profile.attention_efficiency
    else:
        per_kernel = op.flops / max(op.kernels, 1)  # a batched matmul: its pieces' size
        rate = peak(profile, dtype) * matmul_efficiency(profile, per_kernel)
    return max(op.flops / (rate * profile.sustained), memory)


def stretch_time(ops, profile: Profile, dtype: str, ranks_per_core: float = 1.0,
                 framework: float = 0.0) -> float:
    """Seconds a sequence of ops takes on one rank, launches included. The host spends the
    profile's ``kernel_overhead`` plus ``framework`` seconds (the framework's own Python) on
    each kernel it launches. On a GPU it runs ahead: a kernel starts when it has been launched
    and the one before it is done, so big kernels hide the launches and a stretch of tiny ones
    waits for the host. A stretch is one layer's phase, repeated layer after layer, and the
    host's lead carries from one layer to the next (a stream queues about a thousand launches
    before the host waits: Stack Overflow question 53970187), so in the steady state a layer
    costs the slower of the two: its device time or its launches. On a CPU one core does
    both, so the two add, and ranks beyond the cores share them (``ranks_per_core``)."""
    per_kernel = profile.kernel_overhead + framework
    if profile.cores is not None:
        device = sum(op_time(o, profile, dtype) for o in ops)
        return (device + per_kernel * sum(o.kernels for o in ops)) * max(1.0, ranks_per_core)
    device = sum(op_time(o, profile, dtype) for o in ops)
    return max(device, per_kernel * sum(o.kernels for o in ops))


def achieved(ops, profile: Profile, dtype: str) -> float:
    """The FLOP-weighted fraction of peak the matmuls of ``ops`` reach (for explanations:
    "matmuls at 78 % of peak")."""
    mats = [o for o in ops if o.kind == "matmul" and o.flops]
    flops = sum(o.flops for o in mats)
    if not flops:
        return 0.0
    return flops / sum(op_time(o, profile, dtype) for o in mats) / peak(profile, dtype)
