"""``edu3d grade --isolate``: the graded kernel in Linux namespaces, without privileges.

After reading this file you should understand what the isolation adds to a grade, what the
machine must have for it, and what it leaves open:

* the kernel starts under ``unshare`` (util-linux) in namespaces of its own. PID: it sees only
  its own processes (not the grader's, so not the file the grader's report goes to) and, when
  it ends, the OS kills every process left inside: nothing outlives it. Network: only a
  loopback of its own (the ranks' gloo and torchrun's stores run there; the kernel talks to
  the grader over Unix sockets in its folder): nothing on this machine's ports, no internet.
  IPC: no System V shared memory or queues of anyone else. Mount: ``/run`` and ``/dev/shm``
  are empty ones (no session or system bus to have systemd start a process outside, no
  docker socket), each Unix socket under ``/tmp`` and ``/var/tmp`` refuses it (ssh-agent,
  tmux, X: those there when the kernel starts), and every file system is read-only but the
  grade's temporary folder (the kernel's home, working folder, ``TMPDIR`` and runs): the
  submission cannot change your files, the course checkout or edu3d itself;
* in a user namespace it keeps your user id (root's too) but then loses every capability for
  good (``setpriv``: an empty bounding set, ``noroot`` secure bits, ``no_new_privs``), so the
  mounts cannot be undone and no set-uid program gives privileges back.

What it does not isolate: what your user can read (your files, so the report may carry what
a submission read there into a hint; a Unix socket kept elsewhere in your files can still be
connected to), and the CPU, memory and time (only ``--timeout`` bounds a cell). For a
separate user, run ``edu3d grade`` itself as one (``sudo -u grader edu3d grade --isolate
...``, a user who can read the course and nothing of yours). Grading untrusted code on a
machine that matters still calls for a throwaway account, container or VM; this is what one
command can do on the machine it finds. It needs Linux, ``unshare``, ``setpriv`` and user
namespaces (:func:`unavailable` says what is missing).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

# run by sh inside the new namespaces: $1 the grade's folder, $2 a Python, then setpriv's
# arguments. The loopback of a new network namespace starts down: up it goes (SIOCSIFFLAGS).
# /run becomes an empty one and each Unix socket under /tmp and /var/tmp (but the grade's)
# gets /dev/null mounted over it: the sockets of this machine's services and of your sessions
# (ssh-agent, tmux, X) refuse the kernel
SETUP = r"""set -e
w=$1; py=$2; shift 2
"$py" -c 'import fcntl, socket, struct
fcntl.ioctl(socket.socket(), 0x8914, struct.pack("16sH", b"lo", 0x1 | 0x40))'
mount -t tmpfs -o mode=755 tmpfs /run
find /tmp /var/tmp -xdev -path "$w" -prune -o -type s -print 2>/dev/null |
    while IFS= read -r sock; do
        mount --bind /dev/null "$sock" 2>/dev/null ||
            echo "edu3d grade --isolate: $sock stays reachable" >&2
    done
mount --bind "$w" "$w"
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
for m in $(awk '{print $5}' /proc/self/mountinfo | sort -u); do
    case $m in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*|"$w") ;;
    *) mount -o remount,bind,ro "$m" 2>/dev/null ||
           echo "edu3d grade --isolate: $m stays writable (it cannot be remounted)" >&2 ;;
    esac
done
exec setpriv "$@"
"""
# every capability gone, and none to come back on exec (uid 0 in the namespace is no root)
DROP = ["--no-new-privs", "--inh-caps=-all", "--bounding-set=-all",
        "--securebits=+noroot,+noroot_locked,+no_setuid_fixup,+no_setuid_fixup_locked"]
# your user id inside as out, its own processes, IPC, network and mounts; the kernel
# ends them all
NAMESPACES = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child",
              "--ipc", "--net", "--mount", "--propagation", "private", "--mount-proc"]


def prefix(folder: Path) -> list[str]:
    """What goes before the kernel's command line: the namespaces, the loopback up, the
    read-only mounts around ``folder``, the privileges dropped."""
    return [*NAMESPACES, "--", "sh", "-c", SETUP, "sh", str(folder), sys.executable, *DROP,
            "--"]


def unavailable() -> str | None:
    """Why ``--isolate`` cannot run here, in one line; None when it can."""
    missing = [tool for tool in ("unshare", "setpriv", "mount", "awk") if not shutil.which(tool)]
    if missing:
        return f"--isolate needs {' and '.join(missing)} (util-linux) on the PATH"
    try:
        probe = subprocess.run([*NAMESPACES, "--", "true"], capture_output=True, text=True,
                               timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"--isolate could not start unshare ({err})"
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["no reason given"])[-1]
        return (f"--isolate needs Linux namespaces, and unshare was refused here ({why}); "
                "it needs user namespaces (sysctl user.max_user_namespaces > 0, and "
                "kernel.unprivileged_userns_clone=1 where that exists)")
    return None
