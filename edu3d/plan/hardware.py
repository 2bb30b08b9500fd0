"""Hardware profiles: the handful of constants that describe one GPU and its links, as data.

After reading this file you should understand that a performance model needs very few numbers
about a machine, and that each one is either a datasheet figure or a *measurement*:

``peak_flops``         dense tensor-core FLOP/s per precision (the datasheet prints them "with
                       sparsity", twice the dense figure);
``mem_bandwidth``      HBM bytes/s (datasheet) and ``memory`` bytes;
``matmul_efficiency``  the best fraction of bf16 peak a large GEMM reaches (a microbenchmark);
``matmul_half_flops``  the FLOPs of a matmul that reaches half that rate (smaller ones do worse);
``attention_efficiency`` the fraction of bf16 peak FlashAttention reaches at long sequences;
``sustained``          the fraction of those microbenchmark rates a long training run sustains
                       (clocks under the power cap, gaps between kernels): *fitted* to published
                       single-node runs, the one constant here that is not a measurement;
``mem_efficiency``     the fraction of HBM bandwidth a streaming copy reaches (a microbenchmark);
``kernel_overhead``    seconds an eager PyTorch op costs before its kernel runs;
``runtime_memory``     bytes a rank loses before any tensor (CUDA context, library workspaces);
``allocator_factor``   peak reserved / peak allocated of PyTorch's caching allocator;
``link.intra``         NVLink: ``alpha`` seconds per algorithm step, ``bandwidth`` the all-reduce
                       bus bandwidth in bytes/s (nccl-tests' *busbw*), ``gather_bandwidth`` the
                       all-gather / reduce-scatter one (also all-to-all's and a send's rate);
``link.inter``         the same across 2 whole nodes, and ``falloff``: the fraction of bus
                       bandwidth lost each time the node count doubles (:meth:`Profile.inter_bandwidth_at`);
``cores``              optional, a CPU profile's cores (``edu3d calibrate`` writes it): ranks
                       beyond it share them, and an op's launch and its work add up;
``step_overhead``      optional (a CPU profile): seconds per parameter tensor per step of the
                       eager loops over tensors (optimizer, norm, clip), :mod:`edu3d.plan.cpu`;
``hook_overhead``      optional (a CPU profile): seconds per parameter tensor per micro-batch of
                       data parallelism's gradient hooks, :mod:`edu3d.plan.cpu`;
``corun``              optional (a CPU profile): how much slower a rank's work runs while
                       the other ranks run beside it (>= 1), :mod:`edu3d.plan.cpu`;
``sync_overhead``      optional (a CPU profile): seconds per parameter tensor per step that a
                       data-parallel step costs beyond the serial one once per step (the
                       gradient synchronisation's set-up and wait), :mod:`edu3d.plan.cpu`;
``collective_overhead`` optional (a CPU profile): host seconds each collective edu3d issues
                       costs its rank beyond the collective's own time (wrapping, copies,
                       waking up), :mod:`edu3d.plan.cpu`;
``checkpoint_overhead`` optional (a CPU profile): host seconds each checkpointed region
                       (one a block under ``--recompute``) costs a micro-batch beyond the
                       kernels it recomputes, :mod:`edu3d.plan.cpu`;
``collectives``        optional (a CPU profile): ``alpha`` and ``bandwidth`` of each of gloo's
                       ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``send_recv``, measured
                       one by one (:mod:`edu3d.plan.cpu`).

A CPU core reaches ~1e10-1e11 FLOP/s and ~1e10 B/s, so the ranges below start there.
``edu3d calibrate`` writes ``this-machine`` to :func:`user_profiles` (``$EDU3D_PROFILES``, else
``~/.cache/edu3d/profiles``), where :func:`load_profile` finds it by name.

Every constant in a profile file is ``{"value", "unit", "source"}``: the source is a citation, or
says that the value was borrowed or is a bound. Measured numbers are data, not code, because they
change with software (cuBLAS, NCCL) and with the cluster, and a reader must be able to see where
each came from. No torch here: ``edu3d plan`` runs without it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Mapping

HARDWARE_DIR = Path(__file__).with_name("data") / "hardware"
PRECISIONS = ("bf16", "fp16", "fp32", "tf32", "fp8")

# (dotted key, lowest, highest): a value outside the range is a typo or a wrong unit.
CONSTANTS = (
    ("mem_bandwidth", 1e9, 1e14),
    ("memory", 1e9, 1e12),
    ("matmul_efficiency", 0.05, 1.0),
    ("matmul_half_flops", 1e3, 1e13),
    ("attention_efficiency", 0.01, 1.0),
    ("sustained", 0.2, 1.0),
    ("mem_efficiency", 0.05, 1.0),
    ("kernel_overhead", 1e-7, 1e-3),
    ("runtime_memory", 0.0, 2e10),
    ("allocator_factor", 1.0, 2.0),
    ("gpus_per_node", 1, 64),
    ("link.intra.alpha", 1e-8, 1e-3),
    ("link.intra.bandwidth", 1e8, 1e13),
    ("link.intra.gather_bandwidth", 1e8, 1e13),
    ("link.inter.alpha", 1e-8, 1e-2),
    ("link.inter.bandwidth", 1e8, 1e13),
    ("link.inter.gather_bandwidth", 1e8, 1e13),
    ("link.inter.falloff", 0.0, 0.95),
)
PEAK_RANGE = (1e9, 1e17)
USER_PROFILE = "this-machine"  # the name edu3d calibrate writes
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")  # a CPU profile's


class ProfileError(ValueError):
    """A hardware profile that cannot be used; the message names the file and the key."""


@dataclass(frozen=True, eq=False)
class Profile:
    """One machine's constants (SI units: FLOP/s, B/s, B, s); ``sources`` maps each dotted key
    to its citation. ``peak_flops[p]`` is ``None`` where the GPU has no such unit (A100 fp8).
    Compared (and hashed) by identity: the planner caches costs per profile object."""

    name: str
    description: str
    peak_flops: Mapping[str, float | None]
    mem_bandwidth: float
    memory: float
    matmul_efficiency: float
    matmul_half_flops: float
    attention_efficiency: float
    sustained: float
    mem_efficiency: float
    kernel_overhead: float
    runtime_memory: float
    allocator_factor: float
    gpus_per_node: int
    intra_alpha: float
    intra_bandwidth: float
    intra_gather_bandwidth: float
    inter_alpha: float
    inter_bandwidth: float
    inter_gather_bandwidth: float
    inter_falloff: float
    sources: Mapping[str, str]
    cores: int | None = None
    step_overhead: float = 0.0
    hook_overhead: float = 0.0
    sync_overhead: float = 0.0
    corun: float = 1.0
    collective_overhead: float = 0.0
    checkpoint_overhead: float = 0.0
    collectives: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def inter_bandwidth_at(self, nodes: int, gather: bool = False) -> float:
        """Bus bandwidth across ``nodes`` nodes: the 2-node figure (all-reduce's, or with
        ``gather`` all-gather's), less ``inter_falloff`` per doubling beyond 2 (the form the
        profiles' falloff was fitted with)."""
        if nodes < 2:
            raise ValueError(f"inter-node bandwidth needs at least 2 nodes, got {nodes}")
        two = self.inter_gather_bandwidth if gather else self.inter_bandwidth
        return two * (1 - self.inter_falloff) ** math.log2(nodes / 2)


def profiles() -> list[str]:
    """The names of the shipped profiles (file stems under ``data/hardware``)."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.json"))


def user_profiles() -> Path:
    """Where a user's profiles live: ``$EDU3D_PROFILES``, else ``$XDG_CACHE_HOME/edu3d/profiles``
    (``~/.cache/edu3d/profiles``)."""
    if os.environ.get("EDU3D_PROFILES"):
        return Path(os.environ["EDU3D_PROFILES"])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "edu3d" / "profiles"


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (``"h100-sxm"``) or any profile file by path; refused in one
    line naming the file and the key when a constant is missing or out of range."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = HARDWARE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            path = user_profiles() / f"{name_or_path}.json"
        if not path.is_file():
            hint = (" (run edu3d calibrate to measure this machine, about a minute)"
                    if str(name_or_path) == USER_PROFILE else "")
            raise ProfileError(f"unknown hardware profile {str(name_or_path)!r}{hint}; "
                               f"choose one of {', '.join(profiles())}, {USER_PROFILE} (edu3d "
                               "calibrate) or give a .json path")
    try:
        return _load(str(path), path.stat().st_mtime_ns)
    except OSError as err:
        raise ProfileError(f"{path}: cannot read a JSON profile ({err})") from None


@lru_cache(maxsize=64)
def _load(path: str, mtime: int) -> Profile:  # one object per file version: costs cache by it
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ProfileError(f"{path}: cannot read a JSON profile ({err})") from None
    return profile_from_dict(data, path)


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
    cores = None
    if "cores" in data:  # a CPU profile (edu3d calibrate)
        cores = in_range(constant(data, "cores", where, sources), 1, 4096, "cores", where)
        if cores != int(cores):
            raise ProfileError(f"{where}: cores = {cores:g} is not a whole number")
        cores = int(cores)
    step_overhead, hook_overhead, sync_overhead, collective_overhead, checkpoint_overhead = (
        in_range(constant(data, key, where, sources), 0.0, 1e-2, key, where) if key in data
        else 0.0 for key in ("step_overhead", "hook_overhead", "sync_overhead",
                             "collective_overhead", "checkpoint_overhead"))
    corun = (in_range(constant(data, "corun", where, sources), 1.0, 10.0, "corun", where)
             if "corun" in data else 1.0)
    collectives = {}
    if not isinstance(data.get("collectives", {}), dict):
        raise ProfileError(f"{where}: collectives must be an object of {', '.join(COLLECTIVES)}")
    for kind in COLLECTIVES:
        if kind in data.get("collectives", {}):
            collectives[kind] = tuple(
                in_range(constant(data, f"collectives.{kind}.{k}", where, sources), low, high,
                         f"collectives.{kind}.{k}", where)
                for k, low, high in (("alpha", 1e-8, 1e-1), ("bandwidth", 1e6, 1e13)))
    for key in ("name", "description"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ProfileError(f"{where}: missing {key!r} (a non-empty string)")
    return Profile(
        name=data["name"], description=data["description"],
        peak_flops={p: values[f"peak_flops.{p}"] for p in PRECISIONS},
        mem_bandwidth=values["mem_bandwidth"], memory=values["memory"],
        matmul_efficiency=values["matmul_efficiency"], mem_efficiency=values["mem_efficiency"],
        matmul_half_flops=values["matmul_half_flops"],
        attention_efficiency=values["attention_efficiency"], sustained=values["sustained"],
        kernel_overhead=values["kernel_overhead"], runtime_memory=values["runtime_memory"],
        allocator_factor=values["allocator_factor"], gpus_per_node=int(values["gpus_per_node"]),
        intra_alpha=values["link.intra.alpha"], intra_bandwidth=values["link.intra.bandwidth"],
        intra_gather_bandwidth=values["link.intra.gather_bandwidth"],
        inter_alpha=values["link.inter.alpha"], inter_bandwidth=values["link.inter.bandwidth"],
        inter_gather_bandwidth=values["link.inter.gather_bandwidth"],
        inter_falloff=values["link.inter.falloff"], sources=sources, cores=cores,
        step_overhead=step_overhead, hook_overhead=hook_overhead, sync_overhead=sync_overhead,
        corun=corun, collective_overhead=collective_overhead,
        checkpoint_overhead=checkpoint_overhead, collectives=collectives)


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
