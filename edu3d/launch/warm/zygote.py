"""The fork server behind a warm pool: torch is imported once per pool, not once per rank.

After reading this file you should understand why a pool of eight ranks costs the CPU of about
one ``import torch``, and why torchrun still starts, watches and stops every rank:

* **the cost it removes.** A rank's start is mostly imports: ``torch`` (about 1-2.5 CPU-s on
  a laptop core) and, at the first ``torch.optim`` call, ``torch._dynamo`` (about as much
  again: every optimizer's constructor imports it). On a 2-core laptop a pool of 8 ranks
  importing both at once takes 15-35 s of CPU.
* **how.** :class:`edu3d.launch.warm.pool.Pool` starts the zygote (``python -m
  edu3d.launch.warm.zygote --serve SOCKET``) beside torchrun. It listens on a Unix socket in
  the pool's private folder (mode 0700, and only a peer of the same user is served), then
  imports torch, ``torch._dynamo`` and edu3d's rank modules, and never runs a tensor op (so
  no thread pool exists to be lost in a fork). torchrun starts each rank as always, as
  ``python -m edu3d.launch.warm.zygote FOLDER``: a **stub**
  that imports nothing heavy (``EDU3D_ZYGOTE`` names the socket): it hands the zygote its
  environment, working folder and its stdin/stdout/stderr (``SCM_RIGHTS``), and the zygote
  forks the real rank, which takes over those three descriptors and that environment and
  runs :func:`edu3d.launch.warm.rank.serve` exactly as a rank torchrun started itself would.
* **torchrun still owns the rank.** The stub lives as long as its rank and exits with the
  rank's status (or dies of the same signal), so torchrun's monitoring and its error report
  are unchanged. A SIGTERM, SIGINT or SIGHUP the stub receives (torchrun's shutdown) is passed
  on to the rank. The rank writes its own pid file and leads a session of its own, as every
  edu3d rank does, so stacks, heartbeats and kills reach the real process.
* **nothing is left running.** A rank exits when its stub, the zygote or the launcher
  (``EDU3D_LAUNCHER_PID``) is gone (the watchdog every rank runs); the zygote exits when the
  launcher is gone, killing its ranks first; the stub exits when the zygote is gone.

``EDU3D_POOL_FORK=0`` starts pool ranks the old way (each imports torch itself); cold runs
never use the zygote.

This module keeps its torch imports inside functions (:func:`_preimport`): the stub, which
torchrun starts for every rank, must not import torch, and :mod:`edu3d.launch.warm.pool`, on
the launcher's side, imports this module too.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import time

from edu3d.launch.procs import running
from edu3d.launch.run_files import PREFIX_FMT, ZYGOTE_LOG, ZYGOTE_SOCKET
from edu3d.launch.runs import belongs_to
from edu3d.launch.warm import rank as pool_rank

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
ENDED = "the pool's fork server ended"  # what a stub says when the zygote is gone
MAX_MESSAGE = 1 << 20  # a rank's request: its environment, argv and working folder


def enabled(env: dict) -> bool:
    """Whether pool ranks of a launch with environment ``env`` are forked from a zygote."""
    return env.get("EDU3D_POOL_FORK", "1").strip().lower() not in ("0", "false", "no", "off")


# ================================ the zygote ==================================================
def _preimport() -> None:
    """Everything a pool rank imports before its first job (edu3d's rank modules are
    imported with this module), and what the first job's optimizer pulls in
    (``torch._dynamo``); no tensor is created."""
    import torch
    import torch._dynamo  # noqa: F401 - torch.optim imports it at every optimizer's construction
    import torch.distributed  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.optim  # noqa: F401

    if torch.cuda.is_initialized():  # a forked child could not use CUDA ("bad fork")
        sys.exit("edu3d zygote: CUDA was initialized while importing, so ranks forked from "
                 "here could not use it; start pool ranks unforked with EDU3D_POOL_FORK=0")


def _launcher_alive() -> bool:
    """False once the launcher is gone (a SIGKILLed kernel stays a zombie until its parent
    reaps it: that counts as gone)."""
    launcher = int(os.environ.get("EDU3D_LAUNCHER_PID", "0") or 0)
    return not launcher or running(launcher)


def serve(path: str) -> None:
    """The zygote: bind ``path``, import, then fork a rank for each stub that asks, until the
    launcher is gone (never returns)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)  # first, so a stub can connect while the imports run
    os.chmod(path, 0o600)
    listener.listen(64)
    _preimport()
    children: dict[int, socket.socket] = {}  # rank pid -> its stub's connection
    # a rank's death wakes the loop at once (its stub, then torchrun, learn of it in ms)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    while True:
        ready, _, _ = select.select([listener, wake_r], [], [], 0.2)
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        if listener in ready:
            conn, _ = listener.accept()
            pid = _fork_rank(listener, conn, children, (wake_r, wake_w))
            if pid is not None:
                children[pid] = conn
        _reap(children)
        if not _launcher_alive():
            for pid in children:
                _kill(pid)
            os._exit(0)  # the agent removes the pool's folder


def _same_user(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return uid == os.getuid()


def _fork_rank(listener, conn, children, wake: tuple[int, int]) -> int | None:
    """Read one stub's request and fork its rank; the rank's pid (sent to the stub too), or
    None for a request that is refused (another user, a malformed message)."""
    try:
        if not _same_user(conn):
            raise ValueError("a stub of another user")
        msg, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        request = json.loads(msg)
        if len(fds) != 3:
            raise ValueError(f"expected 3 descriptors, got {len(fds)}")
    except (OSError, ValueError) as e:
        print(f"edu3d zygote: refused a request: {e}", file=sys.stderr, flush=True)
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the rank
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in wake:
                os.close(fd)
            listener.close()
            conn.close()
            for other in children.values():
                other.close()
            _become_rank(request, fds)
        finally:
            os._exit(70)  # serve() never returns; reaching here means it raised
    for fd in fds:
        os.close(fd)
    try:
        conn.send(json.dumps({"pid": pid}).encode())
    except OSError:  # the stub is already gone: so is the rank, by its watchdog
        pass
    return pid


def _become_rank(request: dict, fds: list[int]) -> None:
    """In the forked child: take over the stub's descriptors, environment, argv and working
    folder, lead a session, and serve the pool as rank ``RANK``."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv[:] = request["argv"]
    pool_rank.main(request["argv"][1:], stub_pid=int(request["stub_pid"]))


def _reap(children: dict) -> None:
    """Tell each stub whose rank ended how it ended (the stub exits the same way)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.send(json.dumps({"status": status}).encode())
            except OSError:
                pass
            conn.close()


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ================================ the stub (what torchrun started) =============================
def stub(path: str, argv: list[str], connect_s: float = 120.0) -> None:
    """Have the zygote at ``path`` fork this rank, then live and die with it (never returns).
    ``argv``: this process's ``sys.argv`` (the rank's own)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    deadline = time.monotonic() + connect_s
    while True:
        try:
            conn.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                _die(f"the pool's fork server ({path}) did not start in {connect_s:.0f} s")
            time.sleep(0.02)
    request = {"env": dict(os.environ), "cwd": os.getcwd(), "argv": list(argv),
               "stub_pid": os.getpid()}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    reply = _receive(conn)
    if reply is None or "pid" not in reply:
        _die(f"{ENDED} before it started this rank" + _zygote_log(path))
    pid = reply["pid"]

    def forward(sig, _frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    parent = os.getppid()  # torchrun's agent: if it goes, the rank goes (as a cold rank does)
    while not select.select([conn], [], [], 0.2)[0]:
        if os.getppid() != parent:
            if _ours(pid):
                _kill(pid)
            os._exit(3)
    reply = _receive(conn)
    if reply is None or "status" not in reply:  # the zygote is gone: so goes the rank
        if _ours(pid):
            _kill(pid)
        _die(f"{ENDED} while this rank ran" + _zygote_log(path))
    status = reply["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught anyway
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _ours(pid: int) -> bool:
    """True if ``pid`` still is this pool's rank (pids recycle)."""
    return belongs_to(pid, os.environ.get("EDU3D_RUN_ID"))


def _receive(conn: socket.socket) -> dict | None:
    try:
        data = conn.recv(4096)
    except OSError:
        return None
    return json.loads(data) if data else None


def _zygote_log(path: str) -> str:
    try:
        with open(os.path.join(os.path.dirname(path), ZYGOTE_LOG)) as f:
            tail = f.read()[-2000:].strip()
    except OSError:
        return ""
    return f"; its output:\n{tail}" if tail else ""


def death(returncode: int, pool_dir, job: int) -> str:
    """What the launcher says when the zygote of the pool in ``pool_dir`` ended (``returncode``:
    its ``Popen.returncode``) during job ``job``; no rank is to blame."""
    how = f"exited with code {returncode}" if returncode >= 0 else \
        f"killed by signal {signal.Signals(-returncode).name}"
    return (f"the warm pool's fork server died ({how}) while job {job} ran: every rank of the "
            "pool was stopped, and the next launch starts a fresh pool"
            + _zygote_log(os.path.join(pool_dir, ZYGOTE_SOCKET)))


def _die(message: str) -> None:
    """Say why on stderr, as the rank would (with its prefix: the launcher keeps a rank's
    lines, and shows them with its error), and exit 1."""
    prefix = PREFIX_FMT.format(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else ""
    print("".join(f"{prefix}edu3d: {line}\n" for line in message.splitlines()), end="",
          file=sys.stderr, flush=True)
    os._exit(1)


def main(argv: list[str]) -> None:
    """``python -m edu3d.launch.warm.zygote --serve SOCKET``: the zygote; ``python -m
    edu3d.launch.warm.zygote FOLDER``: a pool rank's stub, as torchrun starts it
    (``EDU3D_ZYGOTE`` names the socket)."""
    if argv[1:2] == ["--serve"]:
        serve(argv[2])
    stub(os.environ["EDU3D_ZYGOTE"], argv)


if __name__ == "__main__":
    main(sys.argv)
