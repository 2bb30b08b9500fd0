"""The status line a launch shows under a notebook cell while its ranks run.

Its own module because both :mod:`edu3d.launch.api` (every launch from a kernel) and
:mod:`edu3d.launch.magic` (the ``%%torchrun`` cell) show it, and neither may import the other.
"""

from __future__ import annotations

import html

from IPython import get_ipython
from IPython.display import HTML, display


class NotebookStatus:
    """One status line under a notebook cell, updated in place while ranks run. Outside
    IPython (``launch(progress=True)`` in a plain script) there is no cell to show it under,
    and it shows nothing."""

    COLOURS = {"run": "#0072B2", "ok": "#009E73", "fail": "#D55E00", "wait": "#555555"}

    def __init__(self, nprocs: int, new_pool: bool = False):
        self.n = nprocs
        text = (f"starting {nprocs} warm ranks (kept for the next runs, see edu3d.launch.warm.pool) ..."
                if new_pool else f"starting {nprocs} ranks ...")
        self.handle = (display(self._html(text, "wait"), display_id=True)
                       if get_ipython() is not None else None)

    def _html(self, text: str, kind: str) -> HTML:
        return HTML(f'<div style="font-family:monospace;color:{self.COLOURS[kind]}">'
                    f"{html.escape(text)}</div>")

    def _show(self, text: str, kind: str) -> None:
        if self.handle is not None:
            self.handle.update(self._html(text, kind))

    def running(self, elapsed: float, done: int) -> None:
        self._show(f"running on {self.n} ranks: {elapsed:.1f} s, {done}/{self.n} finished",
                   "run")

    def finished(self, elapsed: float, run_dir) -> None:
        self._show(f"{self.n} ranks finished in {elapsed:.1f} s (run folder {run_dir.name})",
                   "ok")

    def failed(self, message: str) -> None:
        self._show(message, "fail")
