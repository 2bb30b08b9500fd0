"""Failures on purpose: ``edu3d train --inject-fault rank=R,step=S[,kind=exit|kill|hang]``.

After reading this file you should understand the three ways a rank stops that a long run has
to survive, and how the course makes each happen on cue:

``exit``  the rank raises a Python error at the start of step S (a bug, an out-of-memory):
          the launcher reports it with that rank's traceback;
``kill``  the process is killed by SIGKILL (the kernel's OOM killer, a lost node): no Python
          error at all, only an exit status the launcher names;
``hang``  the rank stops making progress and stays alive (a deadlock, a stuck device): the
          others wait for it in their next collective, and only the launcher's heartbeat
          watch can tell it apart from a slow step.

The fault fires in the first attempt only: after ``--max-restarts`` brings the run back from
its last checkpoint, step S runs normally, as it would after a real, one-off failure.
"""

from __future__ import annotations

import os
import signal
import sys
import time


class InjectedFault(RuntimeError):
    """The error ``kind=exit`` raises on its rank."""


def maybe_inject(spec: dict | None, rank: int, step: int, attempt: int = 0) -> None:
    """Fail as ``spec`` says if this is its rank and step, in the first attempt."""
    if spec is None or attempt or spec["rank"] != rank or spec["step"] != step:
        return
    kind = spec.get("kind", "exit")
    print(f"edu3d: injecting a fault on rank {rank} at step {step}: {kind}", file=sys.stderr,
          flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:  # alive, silent, in no collective: what only a heartbeat watch detects
            time.sleep(1.0)
    raise InjectedFault(f"injected fault (--inject-fault rank={rank},step={step},kind=exit)")
