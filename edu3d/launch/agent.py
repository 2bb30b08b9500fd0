"""torchrun's agent as edu3d runs it: ``python -m edu3d.launch.agent`` (torchrun's own options).

After reading this file you should understand the two things edu3d adds to torchrun's agent
(``torch.distributed.run``), the process that starts the ranks and is their parent:

* **its stores listen on loopback only** (:func:`bind_stores_to_loopback`): the rendezvous
  store and the store the ranks meet in would otherwise answer anyone who can reach the
  machine, without authentication;
* **how each rank ended is written down** the moment it ends (``exits/rank{R}.json``: exit
  code or signal, and the time), with the time the agent began stopping the others
  (``exits/teardown``). Only a process's parent learns how it died, and a rank that died
  without a Python error (``os._exit``, a segfault, ``kill -9``) is the cause of its
  partners' lost connections: the launcher needs these records to name it
  (:func:`edu3d.launch.procs.first_failure`).
* **with several nodes, each node learns the others' failures** (:class:`SharedFailures`):
  every agent publishes the causes its own run folder holds (a rank's Python error, a death)
  in the rendezvous store all agents share, and copies the other nodes' into its run
  folder. The launcher on a node whose ranks only lost their connections then names the rank
  that died on another node, as it would on one node;
* **torchrun's log folder is inside the run folder** (``torchelastic/``): torchrun would
  otherwise make a ``torchelastic_*`` folder in ``$TMPDIR`` for every run and never remove it.

An agent that serves a warm pool (``EDU3D_POOL_ID``, :mod:`edu3d.launch.warm.pool`) also writes
both records into the current job's run folder, and leaves (removing the pool's folder) when
the launcher, the notebook's kernel, disappears.

This module keeps its torch imports inside functions: the launcher imports nothing of torch
(``edu3d run`` adds almost nothing to torchrun), and the agent imports it only when it runs.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

from edu3d.launch import procs, runs
from edu3d.launch import run_files as files
from edu3d.launch.run_files import write_atomic

__all__ = ["bind_stores_to_loopback", "SharedFailures", "main"]


def bind_stores_to_loopback() -> None:
    """Make every TCPStore *server* this process hosts listen on 127.0.0.1 only.

    torchrun's agent hosts two stores: the c10d rendezvous store and the store the ranks
    meet in (``MASTER_ADDR:MASTER_PORT``). Whatever host name they are given, the C++ server
    binds the wildcard address (``0.0.0.0``/``[::]``) and answers anyone who can reach the
    machine, without authentication. ``TCPStore`` accepts an already bound socket
    (``master_listen_fd``): we bind it to loopback ourselves and hand it over. (Also used
    where accelerate's launcher hosts the stores, :mod:`edu3d.production.accelerate_train`.)
    """
    import torch.distributed as dist

    class LoopbackTCPStore(dist.TCPStore):
        def __init__(self, host_name, port, world_size=None, is_master=False,
                     timeout=timedelta(seconds=300), wait_for_workers=True,
                     multi_tenant=False, master_listen_fd=None, use_libuv=True):
            if is_master and master_listen_fd is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError as err:  # another node on this machine hosts it: torchrun
                    sock.close()  # tries again as a client on a RuntimeError (not OSError)
                    raise RuntimeError(f"cannot host a store on 127.0.0.1:{port}: {err}") from None
                sock.listen(4096)
                port, master_listen_fd = sock.getsockname()[1], sock.detach()
            super().__init__(host_name, port, world_size, is_master, timeout,
                             wait_for_workers, multi_tenant, master_listen_fd, use_libuv)

    dist.TCPStore = LoopbackTCPStore  # read at call time by torchrun's rendezvous modules
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    c10d_rendezvous_backend.TCPStore = LoopbackTCPStore


_POPENS: dict[int, "subprocess.Popen"] = {}  # in the agent: pid -> torchrun's Popen of a rank
_BY_RANK: dict[int, "subprocess.Popen"] = {}  # rank -> the newest such Popen


def _keep_rank_popens() -> None:
    """Remember torchrun's ``Popen`` of every rank it starts (see :func:`_exit_of`)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as sh)

    popen = sh.SubprocessHandler._popen

    def keeping(self, args, env):
        proc = popen(self, args, env)
        _POPENS[proc.pid] = proc
        if str(env.get("RANK", "")).isdigit():
            _BY_RANK[int(env["RANK"])] = proc
        return proc

    sh.SubprocessHandler._popen = keeping


def _exit_of(pid: int, wait_s: float = 5.0) -> dict | None:
    """How child ``pid`` ended, ``{"code": C}`` or ``{"signal": S}``, once it has (None if it
    is not this process's child).

    ``waitid(..., WNOWAIT)`` sees the death without reaping the child, so torchrun still
    collects it as usual. But torchrun's monitor polls its children (``Popen.poll``, which
    reaps), and on a loaded machine it can reap a dead rank before this thread, woken by the
    death, gets to look: the kernel then answers ``ECHILD``. That rank's status is then in
    torchrun's ``Popen`` (negative return code: the signal). Without this, a rank that died
    first could go unrecorded and a partner's lost connection be named instead (seen once
    with 8 ranks while another test worker loaded the machine)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        proc = _POPENS.get(pid)
        deadline = time.monotonic() + wait_s
        while proc is not None and proc.returncode is None and time.monotonic() < deadline:
            time.sleep(0.01)  # torchrun's poll() reaped it and is about to set returncode
        if proc is None or proc.returncode is None:
            return None
        code = proc.returncode
        return {"code": code} if code >= 0 else {"signal": -code}
    return {"code": info.si_status} if info.si_code == os.CLD_EXITED else {"signal": info.si_status}


def _record_exits(run_dir: Path, also: Callable[[], Path | None] = lambda: None,
                  then: Callable[[], None] = lambda: None) -> Callable[[float], None]:
    """Write ``exits/rank{R}.json`` the moment a rank's process ends: exit code or signal and
    the time (:func:`_exit_of`), from a thread per rank. The agent is the ranks' parent, the
    only process the kernel tells how a rank ended. ``also()``: a second run folder to write
    it to (a warm pool's current job, :mod:`edu3d.launch.warm.pool`); ``then()`` is called
    once it is written (the other nodes are told at once). Returns
    ``finish(timeout_s)``, which the agent calls before it exits: its threads are daemons,
    and a death not yet written when the agent ends would be lost."""
    seen: set = set()
    threads: list = []

    def wait_for(rank: int, pid: int) -> None:
        stub = _BY_RANK.get(rank)
        if pid not in _POPENS and stub is not None:  # a pool rank forked by the zygote: its
            pid_of_child = stub.pid  # stub, torchrun's child, ends as it did (warm/zygote.py)
        else:
            pid_of_child = pid
        how = _exit_of(pid_of_child)
        if how is None:
            return
        text = json.dumps({"rank": rank, "pid": pid, "time_ns": time.time_ns(), **how})
        for folder in dict.fromkeys(d for d in (run_dir, also()) if d is not None):
            write_atomic(files.path(folder, "exits", rank), text)
        then()

    def scan() -> None:
        last_new = time.monotonic()
        while True:
            for rank, pid in files.pid_files(run_dir).items():
                if (rank, pid) not in seen:
                    seen.add((rank, pid))
                    last_new = time.monotonic()
                    t = threading.Thread(target=wait_for, args=(rank, pid), daemon=True)
                    t.start()
                    threads.append(t)
            # ranks write their pid files as they start; once none has come for a while
            # (a long run, an idle warm pool) look rarely: each death is seen by its waitid
            time.sleep(0.02 if time.monotonic() - last_new < 5.0 else 0.5)

    def finish(timeout_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        for t in list(threads):
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    threading.Thread(target=scan, name="edu3d-exits", daemon=True).start()
    return finish


FAILURES = "edu3d/failures"  # in the store the nodes share: how many failures were published
MESSAGE = {"node": int, "rank": int, "kind": str, "text": str}  # one published failure


class SharedFailures:
    """Tell the other nodes about the failures caused on this node, and write theirs into
    ``run_dir`` as their node wrote them (``errors/rank{R}.json`` or ``exits/rank{R}.json``),
    from a thread that looks every ``every_s``. ``store``: a store every node's agent reaches
    (the one the ranks meet in); ``nodes``: how many there are. Only causes travel
    (:func:`edu3d.launch.runs.failures`): a rank that lost its connection, or one its agent
    stopped, is a consequence on any node. :meth:`publish` publishes at once (the agent
    calls it when it wrote a death down: the launcher soon kills this agent, and the others
    must learn of it before); :meth:`close` stops the thread before the agent exits (a
    thread left inside a store call when the process ends aborts it: "terminate called
    without an active exception").

    Each node counts the failures it received; once all ``nodes - 1`` others have one of
    this node's, ``shared/rank{R}`` says so: the launcher waits for it before it kills this
    agent over a hang it named (:func:`edu3d.launch.procs.tell_the_nodes`). The folder
    ``shared/`` itself says that failures are shared at all."""

    def __init__(self, run_dir: Path, store, node: int, every_s: float = 0.05, nodes: int = 2):
        self.run_dir, self.store, self.node, self.nodes = run_dir, store, node, nodes
        self.lock, self.known, self.seen = threading.Lock(), set(), 0  # ranks sent or received
        self.sent: dict[int, int] = {}  # rank -> its message's number, until all have it
        (run_dir / "shared").mkdir(parents=True, exist_ok=True)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, args=(every_s,), name="edu3d-nodes",
                                       daemon=True)
        self.thread.start()

    def publish(self) -> None:
        with self.lock:
            for cause in runs.failures(self.run_dir)[0]:
                rank = cause["rank"]
                erred = files.path(self.run_dir, "errors", rank).exists()
                kind = "errors" if erred else "exits"
                data = files.read_small(files.path(self.run_dir, kind, rank))
                if data is None:
                    continue
                text = data.decode(errors="replace")
                if rank not in self.known:
                    self.known.add(rank)
                    n = self.store.add(FAILURES, 1)
                    self.store.set(f"{FAILURES}/{n}", json.dumps(
                        {"node": self.node, "rank": rank, "kind": kind, "text": text}))
                    self.sent[rank] = n
            for rank, n in list(self.sent.items()):
                if self.store.add(f"{FAILURES}/{n}/got", 0) >= self.nodes - 1:
                    write_atomic(files.path(self.run_dir, "shared", rank), "")
                    del self.sent[rank]

    def receive(self) -> None:
        with self.lock:
            while self.seen < self.store.add(FAILURES, 0):
                key = f"{FAILURES}/{self.seen + 1}"
                if not self.store.check([key]):
                    return  # counted but not yet written: next time
                self.seen += 1
                msg = files.parse(self.store.get(key), MESSAGE, tuple(MESSAGE))
                if msg is None or msg["node"] == self.node or msg["kind"] not in ("errors", "exits"):
                    continue  # its own, or not a message of an agent
                self.store.add(f"{key}/got", 1)
                path = files.path(self.run_dir, msg["kind"], msg["rank"])
                if msg["rank"] >= 0 and msg["rank"] not in self.known and not path.exists():
                    self.known.add(msg["rank"])
                    write_atomic(path, msg["text"])

    def _watch(self, every_s: float) -> None:
        while not self.stopped.is_set():
            try:
                self.publish()
                self.receive()
            except Exception:  # the store's host is gone: the run is over on every node
                return
            self.stopped.wait(every_s)

    def close(self, timeout_s: float = 5.0) -> None:
        self.stopped.set()
        self.thread.join(timeout=timeout_s)


def _share_failures_after_rendezvous(run_dir: Path, started: list) -> None:
    """Once torchrun's rendezvous found several nodes, share their failures
    (:class:`SharedFailures`) through a connection of our own to the store the ranks meet
    in, scoped to this rendezvous."""
    import torch.distributed as dist
    from torch.distributed.elastic.agent.server import api as server

    rendezvous = server.SimpleElasticAgent._rendezvous

    def sharing(self, worker_group) -> None:
        rendezvous(self, worker_group)
        if worker_group.group_world_size > 1 and not started:
            client = dist.TCPStore(worker_group.master_addr, worker_group.master_port,
                                   is_master=False, timeout=timedelta(seconds=5))
            scope = f"edu3d/{worker_group.spec.rdzv_handler.get_run_id()}/"
            started.append(SharedFailures(run_dir, dist.PrefixStore(scope, client),
                                          worker_group.group_rank,
                                          nodes=worker_group.group_world_size))

    server.SimpleElasticAgent._rendezvous = sharing


def _pool_job_dir(pool_dir: Path) -> Path | None:
    """The run folder of the job a warm pool is running now (None between jobs)."""
    try:
        text = (pool_dir / files.CURRENT).read_text().strip()
    except OSError:
        return None
    return Path(text) if text else None


def _remove_pool_folder(pool_dir: Path, finish_exits: Callable[[float], None]) -> None:
    """Remove a warm pool's folder once its launcher is gone. The ranks are stopped first and
    their deaths written (each death makes this agent write records into the folder), then
    the folder is removed until it stays gone: torchrun's own teardown, reacting to the same
    deaths, may still write one last record."""
    runs.signal_ranks(pool_dir)
    finish_exits(2.0)
    deadline, gone_since = time.monotonic() + 3.0, None
    while time.monotonic() < deadline:
        if pool_dir.exists():
            shutil.rmtree(pool_dir, ignore_errors=True)
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since > 0.3:
            return
        time.sleep(0.05)


def main(argv: Sequence[str]) -> None:
    """torchrun's agent plus: stores on loopback (single node, or nodes on loopback), a
    record of how each rank ended, with the time the agent began stopping the others
    (``exits/teardown``), shared with the other nodes, and its log folder in the run folder.
    An agent serving a warm pool (``EDU3D_POOL_ID``) also writes both to the current job's
    run folder, and leaves when the launcher (the notebook's kernel) disappears."""
    if os.environ.get("EDU3D_LOOPBACK") == "1":
        bind_stores_to_loopback()
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing import api

    run_dir = Path(os.environ["EDU3D_RUN_DIR"])
    pooled = bool(os.environ.get("EDU3D_POOL_ID"))
    job = (lambda: _pool_job_dir(run_dir)) if pooled else (lambda: None)
    _keep_rank_popens()
    shared: list = []  # SharedFailures, once a rendezvous found several nodes
    _share_failures_after_rendezvous(run_dir, shared)

    def tell_the_nodes() -> None:
        try:
            if shared:
                shared[0].publish()
        except Exception:  # the store's host is gone: nobody is left to tell
            pass

    finish_exits = _record_exits(run_dir, job, tell_the_nodes)
    close = api.PContext.close

    def close_noting_teardown(self, *args, **kwargs):
        stamp = json.dumps({"time_ns": time.time_ns()})
        for folder in dict.fromkeys(d for d in (run_dir, job()) if d is not None):
            if not (folder / files.TEARDOWN).exists():
                write_atomic(folder / files.TEARDOWN, stamp)
        return close(self, *args, **kwargs)

    api.PContext.close = close_noting_teardown
    launcher = int(os.environ.get("EDU3D_LAUNCHER_PID", "0"))

    def orphaned() -> bool:  # a SIGKILLed kernel stays a zombie until its parent reaps it
        return pooled and bool(launcher) and not procs.running(launcher)

    def leave() -> None:  # nobody else will remove an orphaned pool's folder
        if run_dir.name.startswith("edu3d-pool-"):
            _remove_pool_folder(run_dir, finish_exits)

    if pooled:
        def watch() -> None:  # the ranks' own watchdogs end them once the agent is gone
            while True:
                time.sleep(0.2)
                if orphaned():
                    leave()
                    os._exit(3)

        threading.Thread(target=watch, name="edu3d-agent-watchdog", daemon=True).start()
    if not any(a.startswith(("--log-dir", "--log_dir")) for a in argv):
        argv = [f"--log-dir={run_dir / 'torchelastic'}", *argv]  # not a folder in $TMPDIR
    try:
        run.main(list(argv))
    finally:  # every rank has ended: let the last deaths be written before the agent goes
        finish_exits(2.0)
        while shared:  # its store connection is closed here, not at the interpreter's exit
            shared.pop().close()
        if orphaned():  # torchrun saw its ranks die before the watchdog saw the launcher go
            leave()




if __name__ == "__main__":
    main(sys.argv[1:])
