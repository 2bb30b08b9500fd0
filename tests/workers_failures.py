"""What the failure tests run: a worker that is slow and then hangs, one that loops until it
is stopped from outside, and a training process that kills itself at a chosen point of
writing a checkpoint.

``python -m tests.workers_failures POINT DIR STEP -- <edu3d train options>`` trains serially
and sends itself SIGKILL at ``POINT`` of the save of step ``STEP`` (see :data:`POINTS`), as a
power cut or the OOM killer would.
"""

import os
import signal
import sys
import time

import torch

from edu3d.distributed import comm, trace

# where in a save the process dies: the checkpoint's own write_atomic, seen from outside
POINTS = ("shard-half-written", "shard-before-rename", "receipt-before-manifest",
          "manifest-before-rename")


def slow_then_hang(mesh, victim: int, slow_step: int, busy_s: float, hang_step: int,
                   steps: int = 8):
    """Every rank all-reduces once per step. ``victim`` computes for ``busy_s`` s at
    ``slow_step`` without a single note (a long step: it uses the CPU, it is no hang), and
    stops for good at ``hang_step`` (alive, silent, outside any collective, as
    ``--inject-fault kind=hang``)."""
    t, a = torch.ones(8), torch.randn(64, 64)
    for s in range(1, steps + 1):
        with trace.current().context(step=s):
            if mesh.rank == victim and s == slow_step:
                end = time.monotonic() + busy_s
                while time.monotonic() < end:
                    a = torch.tanh(a @ a)
            if mesh.rank == victim and s == hang_step:
                print(f"hanging at {time.time():.3f}", flush=True)
                while True:
                    time.sleep(1.0)
            comm.all_reduce(t)
    return t[0].item()


def all_reduce_for_ever(mesh, pause_s: float = 0.005):
    """Every rank all-reduces once per step, for ever: until the launcher ends the run (a
    rank stopped from outside, ``kill -STOP``, is then the only reason it stops)."""
    t, s = torch.ones(4), 0
    print(f"looping as pid {os.getpid()}", flush=True)
    while True:
        s += 1
        with trace.current().context(step=s):
            comm.all_reduce(t)
        time.sleep(pause_s)


def steps_with_status(mesh, steps: int, pause_s: float):
    """Every rank all-reduces once per step and rewrites its live status record after it,
    as ``edu3d train`` does while watched (:class:`edu3d.train.publish.Publisher`)."""
    from edu3d.launch import live

    status = live.StatusFile(live.status_file(os.environ["EDU3D_RUN_DIR"], mesh.rank))
    t = torch.ones(4)
    for s in range(1, steps + 1):
        with trace.current().context(step=s):
            comm.all_reduce(t)
        status.write({"rank": mesh.rank, "step": s, "steps": steps, "step_ms": 1e3 * pause_s,
                      "t": time.time(), "done": s == steps})
        time.sleep(pause_s)
    status.close()
    return mesh.rank


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_during_save(point: str, step: int) -> None:
    """Make the save of ``step`` SIGKILL this process at ``point``."""
    from edu3d.ckpt import format as checkpoint, checkpointer

    if point not in POINTS:
        raise SystemExit(f"point must be one of {POINTS}")
    write_atomic = checkpoint.write_atomic

    def hooked(path, data):
        if path.parent.name != checkpoint.step_dir("", step).name:
            return write_atomic(path, data)
        tmp = path.with_name(path.name + ".tmp")
        if point == "shard-half-written" and path.suffix == ".pt":
            with open(tmp, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            _die()
        if point in ("shard-before-rename", "manifest-before-rename") and \
                path.suffix == (".pt" if point.startswith("shard") else ".json") and \
                (point.startswith("shard") or path.name == checkpoint.MANIFEST):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            _die()  # the whole file is there, under its temporary name
        if point == "receipt-before-manifest" and path.name == checkpoint.MANIFEST:
            _die()  # every shard and receipt is durable; the manifest never comes
        return write_atomic(path, data)

    checkpointer.write_atomic = hooked


if __name__ == "__main__":
    point, step = sys.argv[1], int(sys.argv[2])
    kill_during_save(point, step)
    from edu3d.commands.train import main

    rest = sys.argv[3:]
    sys.exit(main(rest[1:] if rest[:1] == ["--"] else rest))
