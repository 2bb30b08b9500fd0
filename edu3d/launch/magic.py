"""``%%torchrun``: run a notebook cell on N ranks.

After ``%load_ext edu3d``::

    %%torchrun -n 4 --timeout 60
    from edu3d.distributed import runtime
    mesh = runtime.init()
    print(f"hello from rank {mesh.rank} of {mesh.layout.world_size}")

The cell is written to ``cell.py`` in a fresh run folder and launched with
:func:`edu3d.launch.api.launch` (a cell's code cannot be sent to other processes any other way:
spawn cannot pickle functions defined in a notebook). Each rank is another Python process, so
the cell must import what it uses; variables of the notebook are not visible in it. After the
first cell the ranks are warm (:mod:`edu3d.launch.warm.pool`: torch already imported, a fresh process group
per cell), so a cell starts in well under a second; ``--cold`` starts fresh processes.

While it runs, a status line shows the elapsed time and how many ranks have finished; output
is printed with a ``[rank R]`` prefix. The finished :class:`~edu3d.launch.api.RunResult` is
stored in the notebook variable ``_torchrun`` (``_torchrun.events()`` is the run's trace). A
failing rank stops the cell with an error naming that rank; interrupting the kernel or the
timeout kills every rank.
"""

from __future__ import annotations

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from edu3d.launch.api import LaunchError, launch, new_run_dir
from edu3d.launch.run_files import CELL_FILE, write_atomic
from edu3d.launch.runs import RunsError


class Interrupted(KeyboardInterrupt):
    """The kernel was interrupted during a run; every rank was killed. Shown as one line
    (IPython renders ``_render_traceback_`` instead of a traceback)."""

    def __init__(self, nprocs: int):
        super().__init__(f"interrupted: all {nprocs} ranks were killed")

    def _render_traceback_(self) -> list[str]:
        return [str(self)]


@magics_class
class TorchrunMagics(Magics):
    @magic_arguments()
    @argument("-n", "--nprocs", type=int, default=2, help="number of ranks (default 2)")
    @argument("--timeout", type=float, default=120.0,
              help="seconds before every rank is killed (default 120)")
    @argument("--cold", action="store_true",
              help="start fresh ranks instead of the kernel's warm pool (edu3d.launch.warm.pool)")
    @cell_magic
    def torchrun(self, line: str, cell: str):
        """Run the cell on ``-n`` ranks through torchrun."""
        args = parse_argstring(self.torchrun, line)
        if args.nprocs < 1:
            raise LaunchError(f"-n {args.nprocs}: the number of ranks must be at least 1")
        try:
            run_dir = new_run_dir("cell")
        except RunsError as err:
            raise LaunchError(str(err)) from None
        script = run_dir / CELL_FILE
        write_atomic(script, cell)
        try:
            self.shell.user_ns["_torchrun"] = launch(script, args.nprocs, timeout=args.timeout,
                                                     run_dir=run_dir, progress=True,
                                                     pool=False if args.cold else None)
        except KeyboardInterrupt:
            raise Interrupted(args.nprocs) from None


def register(ipython) -> None:
    ipython.register_magics(TorchrunMagics)
