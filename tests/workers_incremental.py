"""Rank functions for tests/test_ckpt_incremental.py."""

from __future__ import annotations

import os

from edu3d.ckpt import blobs, checkpointer
from edu3d.train import loop


def die_while_writing_blobs(step: int) -> None:
    """Make this process die (``os._exit``: no cleanup, as a SIGKILL) half way through
    writing the first blob of the save of ``step``."""
    write, write_rank = blobs.write_blob_data, checkpointer.Checkpointer.write_rank
    saving = {"step": 0}

    def half(f, data):
        if saving["step"] == step:
            f.write(data[: len(data) // 2])
            f.flush()
            os._exit(9)
        write(f, data)

    def tracked(self, job):
        saving["step"] = job["step"]
        return write_rank(self, job)

    blobs.write_blob_data = half
    checkpointer.Checkpointer.write_rank = tracked


def killed_while_writing_blobs(mesh, options: dict, step: int, rank: int) -> list[dict]:
    """``edu3d train``'s rank, except that rank ``rank`` dies half way through a blob of
    the save of ``step``."""
    if mesh.rank == rank:
        die_while_writing_blobs(step)
    return loop.worker(mesh, options)
