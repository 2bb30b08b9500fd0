"""``edu3d grade --isolate``: the graded kernel in Linux namespaces, without privileges.

After reading this file you should understand what the isolation adds to a grade, what the
machine must have for it, and what it leaves open:

* the kernel starts under ``unshare`` (util-linux) in namespaces of its own. PID: it sees only
  its own processes (not the grader's, so not the file the grader's report goes to) and, when
  it ends, the OS kills every process left inside: nothing outlives it. IPC: no System V
  shared memory or queues of anyone else. Mount: every file system is remounted read-only
  but the grade's temporary folder (the kernel's home, working folder, ``TMPDIR`` and runs),
  so the submission cannot change your files, the course checkout or edu3d itself;
  ``/dev/shm`` is a fresh one and ``/run`` an empty one (no session or system bus to have
  systemd start a process outside, no docker socket);
* in a user namespace it keeps your user id (root's too) but then loses every capability for
  good (``setpriv``: an empty bounding set, ``noroot`` secure bits, ``no_new_privs``), so the
  read-only mounts cannot be undone and no set-uid program gives privileges back.

What it does not isolate: the network (gloo and the kernel's own channels run on loopback, so
the submission can reach every service on this machine, and beyond; abstract Unix sockets
too), the CPU, memory and time (only ``--timeout`` bounds a cell), and what your user can
read. For a separate user, run ``edu3d grade`` itself as one (``sudo -u grader edu3d grade
--isolate ...``, a user who can read the course and nothing of yours). Grading untrusted code on a
machine that matters still calls for a throwaway account, container or VM; this is what one
command can do on the machine it finds. It needs Linux, ``unshare``, ``setpriv`` and user
namespaces (:func:`unavailable` says what is missing).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

# run by sh inside the new namespaces: $1 the grade's folder, then setpriv's arguments
SETUP = r"""set -e
w=$1; shift
mount --bind "$w" "$w"
for m in $(awk '{print $5}' /proc/self/mountinfo | sort -u); do
    case $m in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*|"$w") ;;
    *) mount -o remount,bind,ro "$m" 2>/dev/null ||
           echo "edu3d grade --isolate: $m stays writable (it cannot be remounted)" >&2 ;;
    esac
done
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=755 tmpfs /run
exec setpriv "$@"
"""
# every capability gone, and none to come back on exec (uid 0 in the namespace is no root)
DROP = ["--no-new-privs", "--inh-caps=-all", "--bounding-set=-all",
        "--securebits=+noroot,+noroot_locked,+no_setuid_fixup,+no_setuid_fixup_locked"]
# your user id inside as out, its own processes, IPC and mounts; the kernel ends them all
NAMESPACES = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child",
              "--ipc", "--mount", "--propagation", "private", "--mount-proc"]


def prefix(folder: Path) -> list[str]:
    """What goes before the kernel's command line: the namespaces, the read-only mounts
    around ``folder``, the privileges dropped."""
    return [*NAMESPACES, "--", "sh", "-c", SETUP, "sh", str(folder), *DROP, "--"]


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
