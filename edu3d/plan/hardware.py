"""Hardware profiles: the handful of constants that describe one GPU and its links, as data.

After reading this file you should understand that a performance model needs very few numbers
about a machine, and that each one is either a datasheet figure or a *measurement*:

``peak_flops``         dense tensor-core FLOP/s per precision (the datasheet prints them "with
                       sparsity", twice the dense figure);
``mem_bandwidth``      HBM bytes/s (datasheet) and ``memory`` bytes;
``matmul_efficiency``  the best fraction of bf16 peak a large GEMM reaches (a microbenchmark);
``mem_efficiency``     the fraction of HBM bandwidth a streaming copy reaches (a microbenchmark);
``kernel_overhead``    seconds an eager PyTorch op costs before its kernel runs;
``runtime_memory``     bytes a rank loses before any tensor (CUDA context, library workspaces);
``allocator_factor``   peak reserved / peak allocated of PyTorch's caching allocator;
``link.intra``         NVLink all-reduce: ``alpha`` seconds per algorithm step, ``bandwidth``
                       bus bandwidth in bytes/s (nccl-tests' *busbw*);
``link.inter``         the same across nodes for 2 nodes, and ``falloff``: the fraction of bus
                       bandwidth lost each time the node count doubles (:meth:`Profile.inter_bandwidth_at`).

Every constant in a profile file is ``{"value", "unit", "source"}``: the source is a citation, or
says that the value was borrowed or is a bound. Measured numbers are data, not code, because they
change with software (cuBLAS, NCCL) and with the cluster, and a reader must be able to see where
each came from. No torch here: ``edu3d plan`` runs without it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

HARDWARE_DIR = Path(__file__).with_name("data") / "hardware"
PRECISIONS = ("bf16", "fp16", "fp32", "tf32", "fp8")

# (dotted key, lowest, highest): a value outside the range is a typo or a wrong unit.
CONSTANTS = (
    ("mem_bandwidth", 1e11, 1e14),
    ("memory", 1e9, 1e12),
    ("matmul_efficiency", 0.05, 1.0),
    ("mem_efficiency", 0.05, 1.0),
    ("kernel_overhead", 1e-7, 1e-3),
    ("runtime_memory", 0.0, 2e10),
    ("allocator_factor", 1.0, 2.0),
    ("gpus_per_node", 1, 64),
    ("link.intra.alpha", 1e-8, 1e-3),
    ("link.intra.bandwidth", 1e8, 1e13),
    ("link.inter.alpha", 1e-8, 1e-2),
    ("link.inter.bandwidth", 1e8, 1e13),
    ("link.inter.falloff", 0.0, 0.95),
)
PEAK_RANGE = (1e12, 1e17)


class ProfileError(ValueError):
    """A hardware profile that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class Profile:
    """One machine's constants (SI units: FLOP/s, B/s, B, s); ``sources`` maps each dotted key
    to its citation. ``peak_flops[p]`` is ``None`` where the GPU has no such unit (A100 fp8)."""

    name: str
    description: str
    peak_flops: Mapping[str, float | None]
    mem_bandwidth: float
    memory: float
    matmul_efficiency: float
    mem_efficiency: float
    kernel_overhead: float
    runtime_memory: float
    allocator_factor: float
    gpus_per_node: int
    intra_alpha: float
    intra_bandwidth: float
    inter_alpha: float
    inter_bandwidth: float
    inter_falloff: float
    sources: Mapping[str, str]

    def inter_bandwidth_at(self, nodes: int) -> float:
        """Bus bandwidth across ``nodes`` nodes: the 2-node figure, less ``inter_falloff`` per
        doubling beyond 2 (the form the profiles' falloff was fitted with)."""
        if nodes < 2:
            raise ValueError(f"inter-node bandwidth needs at least 2 nodes, got {nodes}")
        return self.inter_bandwidth * (1 - self.inter_falloff) ** math.log2(nodes / 2)


def profiles() -> list[str]:
    """The names of the shipped profiles (file stems under ``data/hardware``)."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (``"h100-sxm"``) or any profile file by path; refused in one
    line naming the file and the key when a constant is missing or out of range."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = HARDWARE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise ProfileError(f"unknown hardware profile {str(name_or_path)!r}; "
                               f"choose one of {', '.join(profiles())} or give a .json path")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ProfileError(f"{path}: cannot read a JSON profile ({err})") from None
    return profile_from_dict(data, str(path))


def profile_from_dict(data: dict, where: str) -> Profile:
    """Check every constant of a parsed profile (``where`` names it in errors) and build it."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: a profile is a JSON object, got {type(data).__name__}")
    values: dict[str, float | None] = {}
    sources: dict[str, str] = {}
    for precision in PRECISIONS:
        key = f"peak_flops.{precision}"
        value = constant(data, key, where, sources, nullable=True)
        if value is not None:
            in_range(value, *PEAK_RANGE, key, where)
        values[key] = value
    if values["peak_flops.bf16"] is None:
        raise ProfileError(f"{where}: peak_flops.bf16 is null; every profile needs a bf16 peak")
    for key, low, high in CONSTANTS:
        values[key] = in_range(constant(data, key, where, sources), low, high, key, where)
    if values["gpus_per_node"] != int(values["gpus_per_node"]):
        raise ProfileError(f"{where}: gpus_per_node = {values['gpus_per_node']} is not a whole number")
    for key in ("name", "description"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ProfileError(f"{where}: missing {key!r} (a non-empty string)")
    return Profile(
        name=data["name"], description=data["description"],
        peak_flops={p: values[f"peak_flops.{p}"] for p in PRECISIONS},
        mem_bandwidth=values["mem_bandwidth"], memory=values["memory"],
        matmul_efficiency=values["matmul_efficiency"], mem_efficiency=values["mem_efficiency"],
        kernel_overhead=values["kernel_overhead"], runtime_memory=values["runtime_memory"],
        allocator_factor=values["allocator_factor"], gpus_per_node=int(values["gpus_per_node"]),
        intra_alpha=values["link.intra.alpha"], intra_bandwidth=values["link.intra.bandwidth"],
        inter_alpha=values["link.inter.alpha"], inter_bandwidth=values["link.inter.bandwidth"],
        inter_falloff=values["link.inter.falloff"], sources=sources)


def constant(data: dict, key: str, where: str, sources: dict[str, str],
             nullable: bool = False) -> float | None:
    """The value of the dotted ``key``; its source goes into ``sources``."""
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ProfileError(f"{where}: missing constant {key} "
                               "(add {\"value\", \"unit\", \"source\"} for it)")
        node = node[part]
    if not isinstance(node, dict) or not {"value", "unit", "source"} <= node.keys():
        raise ProfileError(f"{where}: {key} must be an object with value, unit and source")
    if not isinstance(node["source"], str) or len(node["source"]) < 10:
        raise ProfileError(f"{where}: {key} has no source; cite a datasheet, a measurement or a file")
    sources[key] = node["source"]
    value = node["value"]
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where}: {key} = {value!r} is not a finite number")
    return float(value)


def in_range(value: float, low: float, high: float, key: str, where: str) -> float:
    """``value`` if ``low <= value <= high``, else a one-line error naming file, key and range."""
    if not low <= value <= high:
        raise ProfileError(f"{where}: {key} = {value:g} is outside [{low:g}, {high:g}]; "
                           "check the unit (SI: FLOP/s, B/s, B, s)")
    return value


def matmul_rate(profile: Profile, precision: str) -> float:
    """FLOP/s a large matrix product reaches in ``precision``: the peak times the profile's
    ``matmul_efficiency``. Under ``fp8`` only the blocks' linear layers run at this rate
    (attention's own products and the LM head stay bf16, torchtitan's recipe). The one
    efficiency is measured in bf16; FP8 GEMMs reach a little less of their peak (the H100
    profile's source: 70.9 % against 80.3 %), so the FP8 rate is an upper bound."""
    peak = profile.peak_flops.get(precision)
    if peak is None:
        raise ValueError(f"{profile.name} has no {precision} tensor cores (its peak_flops."
                         f"{precision} is null): plan it in bf16, or pick an H100-class profile")
    return peak * profile.matmul_efficiency
