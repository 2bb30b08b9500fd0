"""The machine a layout search plans for: a number of GPUs of one hardware profile.

After reading this file you should know what ``edu3d plan --gpus N`` assumes about the
cluster, and where each number comes from: the hardware profile (:mod:`edu3d.plan.hardware`,
every constant cited), how many GPUs share a node, how much of a GPU's memory a layout may
use, and which memory recipe (:mod:`edu3d.plan.recipes`) the layouts are weighed with. The
older flags of ``edu3d plan`` (``--peak-tflops``, ``--intra-gbps``, ``--inter-gbps``) override
the profile's constants here; MFU is no longer one of them: the model predicts it. No torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from edu3d.plan.hardware import Profile, load_profile

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """The machine the search plans for: ``gpus`` of a hardware profile (:mod:`edu3d.plan.
    hardware`; default H100 SXM nodes of 8) and the memory recipe weighed (:mod:`edu3d.plan.
    recipes`). ``peak_tflops``, ``mfu``, ``intra_gbps`` and ``inter_gbps`` override the
    profile's bf16 peak, large-matmul efficiency (MFU itself is now predicted) and NVLink /
    inter-node bus bandwidths; left out, they take the profile's values."""

    gpus: int
    gpu_mem_gb: float = 80.0
    gpus_per_node: int = 8
    peak_tflops: float | None = None
    mfu: float | None = None  # the large-matmul efficiency, not the MFU (an output now)
    intra_gbps: float | None = None
    inter_gbps: float | None = None
    usable: float = 0.9
    hardware: str = "h100-sxm"
    recipe: str = "edu3d"

    def __post_init__(self):  # the profile's values where none was given
        prof = load_profile(self.hardware)
        for name, value in (("peak_tflops", prof.peak_flops["bf16"] / 1e12),
                            ("mfu", prof.matmul_efficiency),
                            ("intra_gbps", prof.intra_bandwidth / GB),
                            ("inter_gbps", prof.inter_bandwidth / GB)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    def describe(self) -> str:
        return (f"{self.gpus} GPUs of {self.gpu_mem_gb:g} GB ({self.usable:.0%} usable), "
                f"{self.gpus_per_node} per node, profile {self.hardware}: {self.peak_tflops:g} "
                f"TFLOP/s bf16 peak, large matmuls at {self.mfu:.0%} of it; NVLink "
                f"{self.intra_gbps:g} GB/s inside a node, {self.inter_gbps:g} GB/s across "
                f"nodes; recipe {self.recipe}")


@lru_cache(maxsize=64)
def profile_of(cl: Cluster) -> Profile:
    """The cluster's hardware profile with its overrides applied (one object per cluster:
    the model caches its costs by profile)."""
    prof = load_profile(cl.hardware)
    peak = cl.peak_tflops * 1e12
    scale = peak / prof.peak_flops["bf16"]
    flops = {k: (v * scale if v else v) for k, v in prof.peak_flops.items()}
    intra, inter = cl.intra_gbps * GB, cl.inter_gbps * GB
    return dataclasses.replace(
        prof, peak_flops=flops, matmul_efficiency=cl.mfu, gpus_per_node=cl.gpus_per_node,
        intra_bandwidth=intra, intra_gather_bandwidth=min(intra, prof.intra_gather_bandwidth *
                                                          intra / prof.intra_bandwidth),
        inter_bandwidth=inter, inter_gather_bandwidth=prof.inter_gather_bandwidth * inter /
        prof.inter_bandwidth)
