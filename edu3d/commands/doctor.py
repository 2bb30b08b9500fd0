"""``edu3d doctor``: is this installation ready for the course?

After reading this file you should understand what a working setup needs, checked in the
order a learner would fix it: Python and torch, the distributed backends torch was built
with (gloo on every CPU; NCCL on GPUs), the GPUs and cores, the notebook libraries, and
finally a real 2-rank gloo run (:func:`smoke`: an all-reduce and a ring of send/recv).

torch comes in through imports inside functions: the doctor must run, and say so, where
torch is missing or broken, which is exactly when it is needed.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import time

from edu3d import __version__
from edu3d.commands.argtypes import seconds
from edu3d.launch import api
from edu3d.launch.api import LaunchError

HELP = "check the installation and a 2-rank gloo run"


def add_subcommand(sub) -> None:
    """Register ``doctor`` on ``edu3d``'s subcommands."""
    d = sub.add_parser("doctor", help=HELP)
    d.add_argument("--timeout", type=seconds("120"), default=120.0,
                   help="seconds allowed for the smoke run (default: %(default)s)")
    d.set_defaults(func=main_from_args)


def smoke(mesh) -> dict:
    """What ``edu3d doctor`` runs on 2 ranks: an all-reduce and a ring of send/recv."""
    import torch
    import torch.distributed as dist

    n, r = mesh.layout.world_size, mesh.rank
    t = torch.full((1024,), float(r + 1))
    dist.all_reduce(t)
    ok_reduce = bool(torch.all(t == n * (n + 1) / 2))
    got = torch.empty(1)
    reqs = [dist.isend(torch.tensor([float(r)]), (r + 1) % n),
            dist.irecv(got, (r - 1) % n)]
    for q in reqs:
        q.wait()
    return {"backend": dist.get_backend(), "all_reduce": ok_reduce,
            "send_recv": float(got.item()) == float((r - 1) % n)}


def main_from_args(args) -> int:
    """Print the report; exit code 0 when the smoke run works, 1 otherwise."""
    print(f"edu3d {__version__}   python {platform.python_version()}   "
          f"{platform.system()} {platform.machine()}")
    try:
        import torch
        import torch.distributed as dist
    except ImportError as err:
        print(f"torch: NOT importable ({err}); pip install 'torch>=2.4'")
        return 1
    print(f"torch {torch.__version__}")
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()),
                                      ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if ok]
    print(f"distributed backends compiled in: {', '.join(backends) or 'none'}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
    print(f"CUDA GPUs: {gpus}{' (' + names + ')' if gpus else ''}")
    print(f"CPU cores: {os.cpu_count()}   OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset (edu3d sets 1 per rank)')}")
    for mod in ("jupyterlab", "ipywidgets", "plotly", "matplotlib"):
        found = importlib.util.find_spec(mod) is not None
        print(f"{mod}: {'found' if found else f'NOT found (pip install {mod})'}")

    t0 = time.perf_counter()
    try:
        res = api.launch(smoke, 2, env={"EDU3D_BACKEND": "gloo"}, timeout=args.timeout, echo=False,
                     name="doctor")
    except LaunchError as err:
        print(f"gloo smoke run on 2 ranks: FAILED\n{err}")
        return 1
    ok = all(r["all_reduce"] and r["send_recv"] for r in res.results)
    print(f"gloo smoke run on 2 ranks: {'OK' if ok else 'WRONG RESULTS'} "
          f"(all_reduce and send/recv, {time.perf_counter() - t0:.1f} s)")
    if gpus >= 2:
        print("NCCL: run `edu3d run -n 2` on a script calling edu3d.distributed.runtime.init() to use it")
    return 0 if ok else 1
