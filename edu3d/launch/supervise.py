"""Watching a run: the one loop that waits for ranks, cold or warm, and decides how they ended.

After reading this file you should understand what the launcher does while your ranks run, a
few times a second, until they finish or one of them fails:

* **drain** the agent's stdout and stderr (:class:`edu3d.launch.procs.Pipes`): each line is
  split into its rank and text (``[rank 3] ...``), kept for ``RunResult.output`` and
  echoed with its prefix; torchrun's own lines (no prefix) are kept, never echoed;
* **notice the first failure** (:func:`edu3d.launch.procs.first_failure`: the rank whose
  error or death came first, not a partner that lost its connection to it);
* **watch the heartbeat** (:class:`edu3d.launch.heartbeat.Watch`): a rank that stopped making
  progress while the others wait for it is named (:class:`~edu3d.launch.procs.RankHung`)
  with its stack;
* **bound the time** (``timeout``: :class:`~edu3d.launch.procs.LaunchTimeout`, with what every
  rank was doing);
* **report progress** (``on_poll(elapsed_s, ranks_done)``, four times a second);
* **end it**: on any failure, timeout, hang, interrupt or error, ``kill()`` ends every process,
  then one :class:`~edu3d.launch.procs.RankError` names the first failing rank with its
  traceback.

Two kinds of run go through :func:`watch`. Where they differ, a cold run
(:mod:`edu3d.launch.api`) is said first, a job on a warm pool (``job=``,
:mod:`edu3d.launch.warm.pool`) second:

* **the agent**: started for this run alone / shared by every job of the pool;
* **output from before the run**: none / torchrun's start-up chatter and whatever came
  between jobs, kept as torchrun's lines and not echoed (:func:`chatter`, read before the
  job is handed to the ranks);
* **the end of the output**: both pipes close / each rank writes a marker line on each stream
  (``job.keep`` drops it, and the lines of ranks that sit the job out);
* **the run is over when**: the agent exited and both pipes closed / every rank is done and
  every marker arrived (``job.finished``);
* **the agent ending**: is the end, and its exit code says whether the run failed / means
  the job failed, and its last records get 5 s to arrive;
* **``kill()``**: :func:`edu3d.launch.procs.kill_run` on the agent and the run's ranks /
  kills the whole pool (the next launch starts a fresh one);
* **after the loop**: nothing / ``job.leave()``: the pool's agent stops writing into this
  run's folder;
* **how long a read of the pipes waits** (``block_s``): 0.05 s / 0.03 s (a warm job lasts
  about a second: its latency shows).

A job object (``job``) has ``before`` (the lines the pool said before the job, from
:func:`chatter`) and ``closed`` (pipes that closed meanwhile), ``keep(rank, stream, text)``
(the text to keep, or None to drop the line), ``finished(ranks_done)``, ``leave()``, and
``server_death(output)``: None while the pool's fork server lives, else the error's text (a
rank's death is then a consequence, never the cause).

Like the rest of the launcher, this module never imports torch.
"""

from __future__ import annotations

import queue
import subprocess
import time
from pathlib import Path
from typing import Callable

from edu3d.launch import heartbeat as hb
from edu3d.launch import procs, run_files
from edu3d.launch.procs import RunResult

__all__ = ["watch", "chatter", "ranks_done"]


def ranks_done(run_dir: Path) -> int:
    """How many ranks wrote their ``done/rank{R}`` marker."""
    return len(run_files.ranks(run_dir, "done"))


def chatter(pipes: procs.Pipes) -> tuple[list, int]:
    """What an agent said that nobody read yet, as torchrun's own lines (rank None, the text
    as it came), and how many of its pipes closed meanwhile."""
    lines, closed = [], 0
    while True:
        try:
            tag, text = pipes.lines.get_nowait()
        except queue.Empty:
            return lines, closed
        if text is None:
            closed += 1
        else:
            lines.append((None, tag, text))


def watch(proc: subprocess.Popen, pipes: procs.Pipes, run_dir: Path, nprocs: int,
          kill: Callable[[], None], *, timeout: float | None = None, echo=True,
          on_poll: Callable[[float, int], None] | None = None, heartbeat: float = 0.0,
          job=None, block_s: float = 0.05, deadlock_s: float | None = None) -> RunResult:
    """Wait for the ``nprocs`` ranks of the run in ``run_dir`` whose agent is ``proc`` (its
    output read by ``pipes``), as the module's docstring says; ``job``: a job on a warm pool;
    ``deadlock_s``: :class:`edu3d.launch.heartbeat.Watch`'s (several nodes wait longer).
    The result, or ``RankError``, ``RankHung`` or ``LaunchTimeout`` after ``kill()``; an
    interrupt or any other error also calls ``kill()`` first."""
    emit = procs.print_line if echo is True else (echo or (lambda *a: None))
    output, closed = (list(job.before), job.closed) if job is not None else ([], 0)

    def drain(wait_s: float) -> int:
        shut = 0
        try:
            item = pipes.lines.get(timeout=wait_s)
            while True:
                tag, text = item
                if text is None:
                    shut += 1
                else:
                    m = run_files.PREFIX_RE.match(text)
                    rank, body = (int(m.group(1)), m.group(2)) if m else (None, text)
                    if job is not None and rank is not None:
                        body = job.keep(rank, tag, body)
                    if body is not None:
                        output.append((rank, tag, body))
                        if rank is not None:  # torchrun's own chatter stays in result.output
                            emit(rank, tag, body)
                item = pipes.lines.get_nowait()
        except queue.Empty:
            pass
        return shut

    start = time.monotonic()
    failure, finished, last_poll, last_beat = None, False, 0.0, 0.0
    beats = hb.Watch(run_dir, nprocs, heartbeat, deadlock_s) if heartbeat else None
    try:
        while True:
            closed += drain(block_s)
            now = time.monotonic() - start
            failure = procs.first_failure(run_dir)
            if failure is not None:
                break
            if job is None:
                if closed >= 2 and proc.poll() is not None:
                    break  # over; its exit code says how
            elif closed >= 2 or proc.poll() is not None or job.server_death([]):
                break  # the pool's agent or fork server ended in the middle of a job
            done = ranks_done(run_dir)
            if job is not None and job.finished(done):
                finished = True
                break
            if beats is not None and now - last_beat >= 0.25:
                last_beat = now
                hung = beats.check()
                if hung is not None:
                    raise procs.hung_error(run_dir, hung, kill)
            if timeout is not None and now > timeout:
                raise procs.timeout_error(run_dir, nprocs, timeout, kill)
            if on_poll is not None and now - last_poll > 0.25:
                last_poll = now
                on_poll(now, done)
    except BaseException:
        kill()
        raise
    finally:
        if job is not None:
            job.leave()

    if failure is None and (finished if job is not None else proc.returncode == 0):
        return RunResult(run_dir, nprocs, time.monotonic() - start,
                         procs.read_results(run_dir, nprocs), output)
    death = job.server_death(output) if job is not None else None
    if failure is None and job is not None and death is None:  # the agent ended: let its
        try:  # exit records and its report arrive
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    kill()
    if death is not None:  # no rank is to blame: their partner process is gone
        raise procs.LaunchError(death)
    pipes.join()
    drain(0.0)
    raise procs.rank_error(run_dir, nprocs, failure, output)
