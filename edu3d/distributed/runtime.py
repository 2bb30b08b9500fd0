"""Starting and stopping a rank: backend, device, threads, timeouts, seeds, tracing.

After reading this file you should understand what every rank does before it can talk:

1. read who it is from the environment ``torchrun`` sets (``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``);
2. choose a backend: NCCL when every rank on the node has a GPU of its own, else gloo
   (NCCL refuses two ranks on one GPU); ``EDU3D_BACKEND`` or ``backend=`` override it;
3. limit itself to one CPU thread (an unset ``OMP_NUM_THREADS`` makes a 4-rank CPU step
   4-10x slower, because every rank starts one thread per core);
4. join the process group with a *short* timeout (60 s instead of gloo's 30 minutes), so a
   rank waiting for a partner that will never come fails with an error instead of hanging;
5. build the :class:`~edu3d.distributed.mesh.Mesh` of process groups and, inside a launched run, start
   the trace recorder on a clock aligned by a barrier.

``init`` also works outside torchrun: the process becomes a world of one, so the same code
runs serially in a notebook.

A process that never calls :func:`shutdown` (a user's own script under torchrun, a notebook's
world of one) leaves its process group at exit anyway, while the interpreter is still whole
(:func:`leave_at_exit`, an ``atexit`` hook): gloo's worker threads live as long as their group,
and one that drops the last reference to a tensor Python had let go of needs the interpreter;
during its teardown that aborts the process ("terminate called without an active exception").
Ranks edu3d's launcher starts end with ``os._exit`` after their results are written, so they
never reach that teardown.

torch comes in through imports inside functions: the launcher imports this module (the
environment and the teardown it shares with ranks) and must start without torch.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import random
import socket
from datetime import timedelta

from edu3d.distributed import trace
from edu3d.config.layout import Layout
from edu3d.distributed.mesh import Mesh

DEFAULT_TIMEOUT_S = 60.0
_LIVE: dict = {}  # the mesh of the last init in this process, for leave_at_exit


def timeout_seconds(timeout_s: float | None = None) -> float:
    """The collective timeout: argument, else ``EDU3D_TIMEOUT``, else 60 s."""
    if timeout_s is not None:
        return float(timeout_s)
    return float(os.environ.get("EDU3D_TIMEOUT", DEFAULT_TIMEOUT_S))


def choose_backend(prefer: str | None = None) -> str:
    """``"nccl"`` if every local rank can have its own GPU, else ``"gloo"``.

    ``prefer`` (or the ``EDU3D_BACKEND`` variable) forces a backend; ``"auto"`` chooses.
    """
    prefer = (prefer or os.environ.get("EDU3D_BACKEND") or "auto").lower()
    if prefer not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend {prefer!r} is not one of auto, gloo, nccl")
    if prefer != "auto":
        return prefer
    import torch

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return "nccl"
    return "gloo"


def set_threads(n: int = 1) -> None:
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def seed_everything(seed: int) -> None:
    """Seed torch's global generators (edu3d's model and data use their own generators)."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def loopback_ifname() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), for gloo."""
    names = [n for _, n in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), names[0] if names else "lo")


def device():
    """This rank's device: its own GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init(layout: Layout | None = None, *, backend: str | None = None,
         timeout_s: float | None = None, seed: int | None = 0, trace_dir: str | None = None) -> Mesh:
    """Join the process group and return this rank's :class:`Mesh`.

    ``layout`` defaults to pure data parallelism over all ranks. ``trace_dir`` (default: the
    run folder ``EDU3D_RUN_DIR`` set by :mod:`edu3d.launch.api`) receives ``trace-rank{R}.jsonl``.
    """
    import torch
    import torch.distributed as dist

    # not launched by torchrun (or a world of one made by an earlier init): a world of one
    alone = "RANK" not in os.environ or ("MASTER_ADDR" not in os.environ
                                         and os.environ.get("WORLD_SIZE") == "1")
    if alone:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())
    set_threads(1)
    if seed is not None:
        seed_everything(seed)
    if not dist.is_initialized():
        be = choose_backend(backend)
        if be == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # a world of one meets in an in-memory store: no TCP server, nothing on the network
        store = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if alone else {}
        dist.init_process_group(be, timeout=timedelta(seconds=timeout_seconds(timeout_s)),
                                **store)
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = layout or Layout(dp=world)
    mesh = Mesh.build(layout, rank)
    if "hooked" not in _LIVE:
        atexit.register(leave_at_exit)
    _LIVE.update(hooked=True, mesh=mesh)

    trace_dir = trace_dir or os.environ.get("EDU3D_RUN_DIR")
    if trace_dir:
        rec = trace.Recorder(rank, trace.rank_file(trace_dir, rank),
                             cuda=dist.get_backend() == "nccl",
                             flight=trace.Flight(trace.flight_file(trace_dir, rank)))
        rec.align(dist.barrier)
        trace.current().close()  # an earlier init's recorder: its flight record stops beating
        trace.set_current(rec)
    return mesh


def shutdown(mesh: Mesh | None = None) -> None:
    """Flush this rank's trace, release ``mesh``'s groups and leave the process group
    (safe to call twice)."""
    import torch.distributed as dist

    if mesh is not None:
        mesh.release()
    trace.current().close()
    trace.set_current(trace.NullRecorder())
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_at_exit() -> None:
    """``atexit``: :func:`shutdown` if the process group is still up, then collect the garbage
    that holds groups (a wrapper's hooks form cycles), so that their gloo threads end now,
    not during the interpreter's teardown."""
    import torch.distributed as dist

    if dist.is_initialized():
        shutdown(_LIVE.get("mesh"))
    _LIVE.pop("mesh", None)
    gc.collect()


@contextlib.contextmanager
def distributed(layout: Layout | None = None, **kwargs):
    """``with distributed(Layout(dp=2, tp=2)) as mesh: ...`` — init, then always shut down."""
    mesh = init(layout, **kwargs)
    try:
        yield mesh
    finally:
        shutdown(mesh)


def all_ok(ok: bool, group=None) -> bool:
    """Agree across ranks whether everyone succeeded (an exception on one rank must not leave
    the others waiting in a collective)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag, group=group)
    return int(flag.item()) == 0
