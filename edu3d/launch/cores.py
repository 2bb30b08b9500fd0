"""How many ranks this machine can run: at most a few per CPU core, unless you insist.

After reading this file you should understand why ``edu3d train --dp 24`` on a laptop of two
cores is refused before any process starts. A rank on the CPU is a process that computes:
with more ranks than cores they take turns, every collective waits for the rank whose turn
has not come, and the run is slower than with fewer ranks, by far (and each rank holds its
own copy of torch in memory). Up to :data:`RANKS_PER_CORE` ranks per core the course's runs
still make progress (ranks spend much of a step waiting for each other anyway); beyond it,
:func:`check_ranks` refuses, and ``--oversubscribe`` (``allowed=True``) says you mean it
(to see what oversubscription does, say). Ranks that each have a GPU of their own are not
held to it: the GPU computes. :func:`oversubscribed` is the one-line warning a run that was
allowed to oversubscribe still prints.

Nothing here imports torch.
"""

from __future__ import annotations

import os

RANKS_PER_CORE = 4  # beyond this, ranks mostly wait for a core


def cores() -> int:
    """The CPU cores this process may run on (its affinity, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def oversubscribed(ranks: int, cores_: int | None = None, on_gpus: bool = False) -> str | None:
    """A one-line warning when ``ranks`` outnumber the CPU cores more than
    :data:`RANKS_PER_CORE` to 1 (and do not each have a GPU), else None."""
    n = cores() if cores_ is None else cores_
    if n and ranks > RANKS_PER_CORE * n and not on_gpus:
        return (f"warning: {ranks} ranks on {n} CPU core(s): every rank waits for a turn "
                f"on a core, so steps will be very slow; use at most {RANKS_PER_CORE * n} "
                "ranks here")
    return None


def check_ranks(ranks: int, allowed: bool = False, on_gpus: bool = False,
                cores_: int | None = None) -> None:
    """Refuse (``ValueError``, one line, before any process starts) more ranks than this
    machine's cores hold (:func:`oversubscribed`), unless ``allowed`` (``--oversubscribe``)."""
    n = cores() if cores_ is None else cores_
    if not allowed and oversubscribed(ranks, n, on_gpus):
        raise ValueError(f"{ranks} ranks on {n} CPU core(s): at most {RANKS_PER_CORE * n} "
                         f"here ({RANKS_PER_CORE} per core; beyond, every rank waits for a "
                         "turn on a core); choose a smaller layout, or add --oversubscribe")
