"""``edu3d course``: open the course (chapters and exercises) in JupyterLab.

After reading this file you should understand what the command runs: JupyterLab on the
checkout's folder, opening on ``notebooks/``, listening on this machine only unless told
otherwise, with ``--allow-root`` added where JupyterLab would refuse root. Options edu3d
does not know are passed to JupyterLab (``edu3d course --ServerApp.token=SECRET``).

JupyterLab opens without its news pop-up ("Would you like to get notified about official
Jupyter news?", which asks for a network the course never needs): the command adds
``lab_config/`` to ``JUPYTER_CONFIG_PATH``, whose ``labconfig/page_config.json`` disables the
``@jupyterlab/apputils-extension:announcements`` plugin (news and update checks) for this
server only; the learner's own settings are left as they are.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from edu3d.commands.argtypes import between

HELP = "open the course in JupyterLab"
COURSE_ROOT = Path(__file__).resolve().parents[2]  # holds notebooks/ and exercises/
LAB_CONFIG = Path(__file__).resolve().parent / "lab_config"  # labconfig/page_config.json
NEWS_PLUGIN = "@jupyterlab/apputils-extension:announcements"


def add_subcommand(sub) -> None:
    """Register ``course`` on ``edu3d``'s subcommands."""
    p = sub.add_parser("course", help=HELP,
                       description="Serve the course folder (chapters in notebooks/, exercises "
                                   "in exercises/) with JupyterLab, opening on the chapters. "
                                   "Options edu3d does not know are passed to JupyterLab "
                                   "(e.g. --ServerApp.token=SECRET).")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser")
    p.add_argument("--port", type=between(1, 65535), default=None,
                   help="port to serve on (default: JupyterLab's, 8888 or the next free one)")
    p.add_argument("--ip", default="127.0.0.1",
                   help="address to listen on (default: %(default)s, this machine only; "
                        "0.0.0.0 exposes the server, and the code it runs, to the network)")
    p.set_defaults(func=main_from_args, jupyter_args=[])


def course_command(args, root: Path = COURSE_ROOT, as_root: bool | None = None) -> list[str]:
    """The JupyterLab command line ``edu3d course`` runs (it starts nothing itself)."""
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}",
           "--LabApp.default_url=/lab/tree/notebooks", f"--ServerApp.ip={args.ip}"]
    if args.no_browser:
        cmd.append("--no-browser")
    if args.port:
        cmd.append(f"--port={args.port}")
    if as_root is None:
        as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    if as_root:
        cmd.append("--allow-root")  # JupyterLab refuses root without it
    return cmd + list(args.jupyter_args)


def course_env(environ: dict | None = None) -> dict[str, str]:
    """The environment JupyterLab runs in: the caller's, with :data:`LAB_CONFIG` first on
    ``JUPYTER_CONFIG_PATH`` (no news pop-up, no update check)."""
    env = dict(os.environ if environ is None else environ)
    paths = [p for p in env.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep) if p]
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join([str(LAB_CONFIG)] + [
        p for p in paths if p != str(LAB_CONFIG)])
    return env


def main_from_args(args) -> int:
    """Replace this process with JupyterLab (exit code 1 without a notebooks/ folder)."""
    if not (COURSE_ROOT / "notebooks").is_dir():
        print(f"edu3d course: no notebooks/ folder in {COURSE_ROOT}; install edu3d from a "
              "checkout with `pip install -e .`", file=sys.stderr)
        return 1
    cmd = course_command(args)
    if "--allow-root" in cmd and "--allow-root" not in args.jupyter_args:
        print("edu3d course: running as root, so JupyterLab gets --allow-root", file=sys.stderr)
    print("opening", " ".join(cmd), file=sys.stderr)
    os.execve(sys.executable, cmd, course_env())
