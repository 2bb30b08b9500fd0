"""Failures on purpose: ``edu3d train --inject-fault rank=R,step=S[,kind=exit|kill|hang|slow]``.

After reading this file you should understand the three ways a rank stops that a long run has
to survive, the one way it lags, and how the course makes each happen on cue:

``exit``  the rank raises a Python error at the start of step S (a bug, an out-of-memory):
          the launcher reports it with that rank's traceback;
``kill``  the process is killed by SIGKILL (the kernel's OOM killer, a lost node): no Python
          error at all, only an exit status the launcher names;
``hang``  the rank stops making progress and stays alive (a deadlock, a stuck device): the
          others wait for it in their next collective, and only the launcher's heartbeat
          watch can tell it apart from a slow step;
``slow``  the rank sleeps ``seconds`` (default :data:`SLOW_SECONDS`) before every step from S
          on (S defaults to 1): a straggler (a throttled GPU, a busy neighbour on its node).
          Every other rank waits for it in its next collective, so every rank's step takes
          as long; what gives the straggler away is that it is the one that does *not* wait
          (``edu3d train --monitor`` highlights it, :mod:`edu3d.launch.live`).

The three failures fire in the first attempt only: after ``--max-restarts`` brings the run
back from its last checkpoint, step S runs normally, as it would after a real, one-off
failure. A slow rank is no failure (nothing restarts because of it): it stays slow in every
attempt, as a slow machine would.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from edu3d.config.sections import Fault

SLOW_SECONDS = 0.2  # kind=slow's default sleep per step


class InjectedFault(RuntimeError):
    """The error ``kind=exit`` raises on its rank."""


def maybe_inject(spec: Fault | dict | None, rank: int, step: int, attempt: int = 0) -> None:
    """Fail (or lag) as ``spec`` says if this is its rank and step: a failure at step S of
    the first attempt, a slow rank at every step from S on."""
    if isinstance(spec, dict):  # as the flag's little language parses it
        spec = Fault(**spec)
    if spec is None or spec.rank != rank:
        return
    kind = spec.kind
    if kind == "slow":
        if step >= spec.step:
            time.sleep(SLOW_SECONDS if spec.seconds is None else spec.seconds)
        return
    if attempt or spec.step != step:
        return
    print(f"edu3d: injecting a fault on rank {rank} at step {step}: {kind}", file=sys.stderr,
          flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:  # alive, silent, in no collective: what only a heartbeat watch detects
            time.sleep(1.0)
    raise InjectedFault(f"injected fault (--inject-fault rank={rank},step={step},kind=exit)")
