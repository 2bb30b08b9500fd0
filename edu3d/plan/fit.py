"""Will it fit? The check ``edu3d train`` makes before a single process starts.

After reading this file you should understand that the refusal of a run too big for this
machine and ``edu3d plan`` are the same arithmetic: the bytes the fullest rank needs at the
step's peak come from the planner's estimator (:func:`edu3d.plan.estimate.estimate`), plus
what torch and gloo cost a rank before any tensor. The ranks of one machine share its
memory, so the need is that times the ranks; a run that cannot fit is refused with those
numbers instead of allocating until the allocator (or the kernel's OOM killer) fails.

The check is for host memory: it is skipped where the available memory is unknown (no
``/proc/meminfo``) or where every rank runs on a GPU of its own.
"""

from __future__ import annotations

import os

from edu3d.config.layout import LayoutError
from edu3d.model.shapes import ModelSpec
from edu3d.config.sections import Run
from edu3d.plan.estimate import CATEGORIES, estimate

RUNTIME_BYTES = 200 * 2**20  # what torch and gloo cost one rank before any tensor (measured)


def need_per_rank(spec: ModelSpec, run: Run) -> dict[str, int]:
    """Bytes the fullest rank needs at the step's peak, by category, plus ``runtime``."""
    est = estimate(spec, run)
    need = {c: int(est[f"{c}_bytes"]) for c in CATEGORIES}
    need["runtime"] = RUNTIME_BYTES
    return need


def available_memory() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes; None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def on_gpus(ranks: int) -> bool:
    """Ranks run on GPUs (one each) when enough are visible: then host memory is not theirs."""
    if os.environ.get("EDU3D_BACKEND", "").lower() == "gloo":
        return False
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus")) >= ranks
    except OSError:
        return False


def gb(n: float) -> str:
    """Bytes in gigabytes, as the planner and the fit check print them."""
    return f"{n / 1e9:.1f} GB"


def size_text(nbytes: float, digits: str = ".3g") -> str:
    """A size in the unit that fits it: ``3e6`` -> ``"3 MB"``, ``8e10`` -> ``"80 GB"`` (never
    ``"0.003 GB"``); ``digits`` is the number's format (``edu3d plan`` prints ``".3f"``)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:{digits}} {unit}"
    return f"{nbytes:.0f} bytes"


def check_fit(spec: ModelSpec, run: Run, available: int | None = None) -> dict[str, int]:
    """Refuse (:class:`~edu3d.config.layout.LayoutError`) a run whose ``run.world_size`` ranks need
    more memory than this machine has ``available`` (default: ``MemAvailable``); returns
    :func:`need_per_rank`."""
    need = need_per_rank(spec, run)
    available = available_memory() if available is None else available
    if available is None or on_gpus(run.world_size):
        return need
    ranks, per_rank = run.world_size, sum(need.values())
    if ranks * per_rank > available:
        parts = ", ".join(f"{k} {gb(v)}" for k, v in need.items())
        fix = "a smaller model (--layers, --d-model, --vocab) or a smaller --global-batch"
        if run.layout.dp > 1 and run.parallel.zero < 3:
            fix += ", or --zero 3 to shard the model's state over the dp replicas"
        raise LayoutError(
            f"this run cannot fit: {spec.num_params() / 1e9:.2f} B parameters need about "
            f"{gb(per_rank)} per rank ({parts}) x {ranks} rank(s) = {gb(ranks * per_rank)}, "
            f"but this machine has {gb(available)} available; choose {fix}")
    return need
