"""Launching ranks: torchrun as a subprocess, watched from Python.

After reading this file you should understand how one call turns into N cooperating processes
and how edu3d keeps that safe:

* ``launch(target, n)`` runs torchrun's agent (``python -m edu3d.launch.agent``, which is
  ``torch.distributed.run`` with its stores bound to loopback) in a new process session with
  rendezvous on ``127.0.0.1`` and a free port (never a fixed 29500), ``OMP_NUM_THREADS=1``,
  and :mod:`edu3d.launch.worker` wrapped around your code on every rank;
* ``target`` is a script path, a module (``module=True``), or a function of an importable
  module (called on every rank as ``function(mesh, *args, **kwargs)``; a function defined in a
  notebook cell cannot travel to another process, use ``%%torchrun`` for that);
* output is streamed live with a rank prefix; return values, errors and traces are collected
  from the run folder (the loop that watches a run, cold or warm:
  :mod:`edu3d.launch.supervise`);
* the first failing rank ends the run: every process is killed and one :class:`RankError`
  names that rank and carries its traceback, or says how it died (exit code, signal) when it
  left no Python error; a partner's "Connection closed by peer" is a consequence, never the
  cause. A timeout or an interrupt also kills every process; nothing is left running, and a
  hang is reported with what every rank was doing (its flight record);
* a rank that stops making progress while the others wait for it is named within the
  ``heartbeat`` (default: half the collective timeout, :mod:`edu3d.launch.heartbeat`), with its
  Python stack, and handled like a death: :class:`RankHung`;
* several nodes (``torchrun_args=node_args(nnodes=2, rdzv_endpoint=...)``, one launch per
  node, ``nprocs`` ranks each) meet where the user says, and on loopback unless the user
  names another address (:func:`node_args`, :func:`loopback_only`).

The launcher itself never imports torch, so ``edu3d run`` adds almost nothing to torchrun.
In a notebook's kernel the ranks are kept warm between launches (:mod:`edu3d.launch.warm.pool`):
the same run folder, output, results and errors, without importing torch again;
``pool=False`` (or ``EDU3D_POOL=0``) starts fresh processes every time.

It keeps one of its imports inside functions, the notebook's status line
(:mod:`edu3d.launch.status`, which imports IPython), shown only in a kernel: the launcher's
start-up stays free of IPython's import, which takes longer than the rest of the launcher's.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import uuid
from pathlib import Path
from typing import Callable, Sequence

from edu3d.distributed.runtime import loopback_ifname
from edu3d.launch import heartbeat as hb
from edu3d.launch import cores, procs, runs, supervise
# the errors and the result a run ends with, and the process helpers, live in edu3d.launch.procs
# (shared with the warm pool); they are part of this module's API too
from edu3d.launch.procs import (LaunchError, LaunchTimeout, RankError, RankHung, RunResult,
                                child_environment, kill_run, torchrun_command)
from edu3d.launch.runs import RunsError, new_run_dir
from edu3d.launch.run_files import ARGS_FILE, COMMAND_FILE, write_atomic
from edu3d.launch.warm import pool as pools

__all__ = ["launch", "LaunchError", "LaunchTimeout", "RankError", "RankHung", "RunResult",
           "RunsError", "child_environment", "kill_run", "new_run_dir", "torchrun_command",
           "NODE_OPTIONS", "node_args", "loopback_only", "check_launch"]

# torchrun's multi-node options, as keyword names (edu3d run and edu3d train take them all)
NODE_OPTIONS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_backend", "rdzv_id", "rdzv_conf",
                "master_addr", "master_port", "local_addr")
_HOSTS = ("rdzv_endpoint", "master_addr", "local_addr")  # the options that name an address


def node_args(world_size: int | None = None, **given) -> list[str]:
    """torchrun's multi-node options from their values (``None``: not given), e.g.
    ``node_args(nnodes=2, rdzv_endpoint="127.0.0.1:29400")`` is ``["--nnodes=2",
    "--rdzv-endpoint=127.0.0.1:29400"]``; ``[]`` for one node with nothing else said.
    Raises ``ValueError`` (one line) for a node rank outside the nodes, a port outside
    1..65535 (``--master-port``, or an endpoint's ``HOST:PORT``), or a ``world_size`` the
    nodes cannot share evenly."""
    unknown = sorted(set(given) - set(NODE_OPTIONS))
    if unknown:
        raise TypeError(f"unknown node option(s) {', '.join(unknown)}; they are "
                        f"{', '.join(NODE_OPTIONS)}")
    nnodes, rank, port = given.get("nnodes") or 1, given.get("node_rank"), given.get("master_port")
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"--nnodes {nnodes!r}: must be a positive integer (edu3d's worlds "
                         "have a fixed size)")
    if rank is not None and not 0 <= rank < nnodes:
        raise ValueError(f"--node-rank {rank}: with --nnodes {nnodes} the nodes are numbered "
                         f"0..{nnodes - 1}")
    if port is not None and not 1 <= int(port) <= 65535:
        raise ValueError(f"--master-port {port}: must be a port number 1..65535")
    if given.get("rdzv_endpoint") is not None:
        try:
            endpoint(given["rdzv_endpoint"])
        except ValueError as err:
            raise ValueError(f"--rdzv-endpoint {err}") from None
    if world_size is not None and world_size % nnodes:
        raise ValueError(f"{world_size} ranks cannot be shared evenly by --nnodes {nnodes}: "
                         f"choose a number of nodes that divides {world_size}")
    if nnodes == 1 and all(given.get(k) is None for k in NODE_OPTIONS if k != "nnodes"):
        return []
    return [f"--{k.replace('_', '-')}={given[k]}" for k in NODE_OPTIONS if given.get(k) is not None]


def endpoint(text: str) -> str:
    """``text`` if it is ``HOST`` or ``HOST:PORT`` with a port 1..65535, else ``ValueError``
    (refused before launch: torchrun would take it, then fail with no rank to blame)."""
    host, colon, port = str(text).rpartition(":")
    if colon and not (host.strip("[]") and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{text}: must be HOST or HOST:PORT with a port number 1..65535 "
                         "(e.g. 127.0.0.1:29400)")
    return text


def check_launch(ranks: int, heartbeat: float | None = None, oversubscribe: bool = False,
                 on_gpus: bool = False) -> None:
    """What a command checks before it starts ``ranks`` on this node (``ValueError``, one
    line, before any process): that the cores hold them (:func:`edu3d.launch.cores.check_ranks`,
    ``oversubscribe`` to insist; ``on_gpus``: each has a GPU) and that the ``heartbeat`` is
    shorter than the collective timeout (:func:`edu3d.launch.heartbeat.check_seconds`)."""
    cores.check_ranks(ranks, oversubscribe, on_gpus)
    hb.check_seconds(heartbeat)


def _is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    return host == "localhost" or host == "::1" or host.startswith("127.")


def loopback_only(torchrun_args: Sequence[str]) -> bool:
    """True when every address ``torchrun_args`` names (the rendezvous endpoint's host, the
    master's, the local one) is a loopback address, or none is named: torchrun's own default
    (``--master-addr 127.0.0.1``) is loopback too. Then every store and every gloo socket of
    the run listen on loopback alone, as a single node's do; an address the user names outside
    loopback (a real second machine) is the user's request to listen there."""
    for arg in torchrun_args:
        name, _, value = arg.partition("=")
        if name.lstrip("-").replace("-", "_") in _HOSTS and value:
            host = value.rsplit(":", 1)[0] if name.endswith("endpoint") and ":" in value else value
            if not _is_loopback(host):
                return False
    return True


def _worker_args(target, module: bool, args, kwargs, layout, init: bool, run_dir: Path):
    """Turn a target into edu3d.launch.worker arguments (and the pickled call arguments, if any);
    bad input fails here, before any process or folder is made."""
    if callable(target):
        mod, name = target.__module__, target.__qualname__
        spec = getattr(sys.modules.get(mod), "__spec__", None)
        if mod == "__main__" and spec is not None:  # run with `python -m package.module`
            mod = spec.name
        if mod == "__main__" or "<locals>" in name:
            raise LaunchError(
                f"{name} is defined in a notebook cell or a script's __main__, and another "
                "process cannot import it (spawn cannot pickle such functions). Move it into "
                "an importable module, or put the code in a %%torchrun cell.")
        target = f"{mod}:{name}"
    if not isinstance(target, (str, os.PathLike)):
        raise LaunchError(f"target must be a script path, a module name or a function, "
                          f"not {type(target).__name__}")
    target = os.fspath(target)
    if module:
        return ["--module", target, "--", *map(str, args)], None
    if ":" in target and not os.path.exists(target):
        out = ["--call", target]
        if layout is not None:
            out += ["--layout", json.dumps(layout.__dict__)]
        payload = pickle.dumps((tuple(args), dict(kwargs or {}))) if args or kwargs else None
        if payload:
            out += ["--args-file", str(run_dir / ARGS_FILE)]
        return out + ([] if init else ["--no-init"]), payload
    if not os.path.isfile(target):
        raise LaunchError(f"script {target!r} does not exist (for a module use module=True / "
                          f"'edu3d run -m', for a function 'package.module:function')")
    return ["--script", os.path.abspath(target), "--", *map(str, args)], None


def _import_root(target) -> list[str]:
    """The sys.path entry that makes a function's module importable (``tests.test_x`` needs
    the folder above ``tests``)."""
    mod = sys.modules.get(getattr(target, "__module__", "") or "")
    file = getattr(mod, "__file__", None)
    if not callable(target) or not file:
        return []
    root = Path(file).resolve().parent
    for _ in range(target.__module__.count(".")):
        root = root.parent
    return [str(root)]


def launch(target, nprocs: int = 2, *, args: Sequence = (), kwargs: dict | None = None,
           module: bool = False, layout=None, init: bool = True, timeout: float | None = None,
           run_dir: str | os.PathLike | None = None, env: dict | None = None,
           echo: bool | Callable[[int | None, str, str], None] = True,
           on_poll: Callable[[float, int], None] | None = None, progress: bool | None = None,
           torchrun_args: Sequence[str] = (), name: str | None = None,
           heartbeat: float | None = None, pool: bool | None = None) -> RunResult:
    """Run ``target`` on ``nprocs`` ranks and wait for it.

    ``echo``: ``True`` prints each line with its rank prefix, ``False`` prints nothing, a
    callable receives ``(rank, stream, line)`` (rank ``None`` for torchrun's own lines).
    ``on_poll(elapsed_s, ranks_done)`` is called a few times a second (progress displays).
    ``progress`` shows a live status line under the cell (default: in a Jupyter kernel,
    unless ``EDU3D_PROGRESS=0``). ``timeout`` (seconds) bounds the whole run. ``heartbeat``
    (seconds, default half the collective timeout ``EDU3D_TIMEOUT``; 0 turns it off): a rank
    without progress that long while the others wait for it ends the run with
    :class:`RankHung`. Raises :class:`RankError`, :class:`LaunchTimeout` or
    :class:`LaunchError`; ``KeyboardInterrupt`` kills the run.

    ``pool``: run on a warm pool of ranks that already imported torch (:mod:`edu3d.launch.warm.pool`;
    default: inside a Jupyter kernel, unless ``EDU3D_POOL=0``); ``False`` always starts
    torchrun afresh. Runs with ``torchrun_args`` never use the pool.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise LaunchError(f"nprocs must be a positive integer, not {nprocs!r}")
    nnodes = next((int(a.split("=", 1)[1]) for a in torchrun_args
                   if a.startswith("--nnodes=") and a.split("=", 1)[1].isdigit()), 1)
    if layout is not None:
        layout.validate(world_size=nprocs * nnodes)
    if timeout is not None and timeout <= 0:
        raise LaunchError(f"timeout must be positive seconds, not {timeout!r}")
    try:
        heartbeat = hb.check_seconds(heartbeat, {**os.environ, **(env or {})})
        deadlock_s = hb.deadlock_seconds(heartbeat, nnodes, {**os.environ, **(env or {})})
    except ValueError as err:
        raise LaunchError(str(err)) from None
    label = name or (getattr(target, "__name__", None) or Path(os.fspath(target)).stem)
    run_dir = Path(run_dir).resolve() if run_dir else new_run_dir(label, create=False)
    worker_argv, payload = _worker_args(target, module, args, kwargs, layout, init, run_dir)
    # nodes on this machine: stores, gloo and the address each node advertises on loopback
    multinode_loopback = not procs.single_node(torchrun_args) and loopback_only(torchrun_args)
    advertise = ["--local-addr=127.0.0.1"] if multinode_loopback and not any(
        a.startswith(("--local-addr", "--local_addr")) for a in torchrun_args) else []
    cmd = torchrun_command(nprocs, worker_argv, [*torchrun_args, *advertise])
    try:
        runs.prepare(run_dir)  # also clears what an earlier run left in a reused folder
    except RunsError as err:
        raise LaunchError(str(err)) from None
    if echo is True and not procs.in_kernel():
        print(f"edu3d: run folder {run_dir}", file=sys.stderr, flush=True)
    if payload:
        write_atomic(run_dir / ARGS_FILE, payload)

    child_env = child_environment(env, torchrun_args, _import_root(target))
    if multinode_loopback:
        child_env.setdefault("GLOO_SOCKET_IFNAME", loopback_ifname())
        child_env["EDU3D_LOOPBACK"] = "1"
    rid = uuid.uuid4().hex  # in every process's environment: how kill_run knows its own
    child_env.update(EDU3D_RUN_DIR=str(run_dir), EDU3D_RUN_ID=rid)
    warm = None
    if not torchrun_args:
        warm = pools.acquire(nprocs, child_env, pool, env)
    if warm is None:
        write_atomic(run_dir / COMMAND_FILE, json.dumps({"argv": cmd, "nprocs": nprocs,
                                                            "run_id": rid}))

    if progress is None:
        progress = procs.in_kernel() and os.environ.get("EDU3D_PROGRESS", "1") != "0"
    status = None
    try:
        if progress:
            status = _notebook_status(nprocs, warm is not None and warm.jobs == 0)
    except BaseException:
        if warm is not None:
            warm.busy = False  # acquired, never used: free for the next launch
        raise
    def with_status(elapsed: float, done: int) -> None:
        status.running(elapsed, done)
        if on_poll is not None:
            on_poll(elapsed, done)

    poll = with_status if status is not None else on_poll
    try:
        if warm is not None:
            result = pools.run_job(warm, worker_argv, child_env, run_dir, timeout, echo, poll,
                                   heartbeat, nprocs)
        else:
            proc, pipes = procs.start(cmd, child_env)
            result = supervise.watch(proc, pipes, run_dir, nprocs, lambda: kill_run(proc, run_dir),
                                     timeout=timeout, echo=echo, on_poll=poll,
                                     heartbeat=heartbeat, deadlock_s=deadlock_s)
    except KeyboardInterrupt:
        if status is not None:
            status.failed(f"interrupted: all {nprocs} ranks were killed")
        raise
    except LaunchError as err:
        if status is not None:
            status.failed(f"failed: {str(err).splitlines()[0]}")
        raise
    if status is not None:
        status.finished(result.elapsed_s, run_dir)
    return result


def _notebook_status(nprocs: int, new_pool: bool = False):
    from edu3d.launch.status import NotebookStatus

    return NotebookStatus(nprocs, new_pool)
