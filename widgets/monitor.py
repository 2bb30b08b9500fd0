"""A live table of a run's ranks in JupyterLab, redrawn while the notebook cell trains.

After reading this file you should understand how a notebook shows what ``edu3d train
--monitor`` shows in a terminal (:mod:`edu3d.launch.live`), although the cell that trains
keeps the kernel busy until its ranks finish:

* :class:`LiveMonitor` makes a fresh run folder (``run_dir``, handed to ``launch``) and
  marks it watched before any rank starts, so the ranks publish their status records from
  their first steps;
* inside ``with LiveMonitor(2) as watch:`` a **background thread** reads the records every
  half second and sets an ``ipywidgets.HTML``'s value: ipywidgets sends each change to the
  browser from that thread, so the table moves while the cell is still running;
* the slowest rank's row is highlighted (vermillion): the one with the most time outside
  communication, which the others wait for (:func:`edu3d.launch.live.slowest`);
* when the block ends, the thread stops and the table shows the ranks' final records. A
  notebook without a frontend (nbval, a static export) keeps the widget's text; ``watch``
  itself displays as the final table (``_repr_html_``), and :func:`table_html` draws any
  records.
"""

from __future__ import annotations

import html
import threading
from pathlib import Path

import ipywidgets as widgets
from IPython.display import display

from edu3d.launch import live
from edu3d.launch.runs import new_run_dir
from edu3d.widgets.style import VERMILLION


def table_html(records: list[dict], title: str = "") -> str:
    """The ranks' records as an HTML table, the slowest rank's row highlighted."""
    head = f"<b>{html.escape(title)}</b><br>" if title else ""
    if not records:
        return head + "<i>waiting for the ranks' first status records ...</i>"
    header, body, slow = live.rows(records)
    cells = "".join(f"<th style='padding:0 8px'>{html.escape(h)}</th>" for h in header)
    lines = [f"<tr>{cells}</tr>"]
    for row in body:
        style = (f" style='background:{VERMILLION};color:white;font-weight:bold'"
                 if row[0].startswith("*") else "")
        tds = "".join(f"<td style='padding:0 8px;text-align:right'>{html.escape(c)}</td>"
                      for c in row)
        lines.append(f"<tr{style}>{tds}</tr>")
    legend = "<br>".join(map(html.escape, live.render(records).splitlines()[-2:]))
    return (f"{head}<table style='font-family:monospace;border-collapse:collapse'>"
            f"{''.join(lines)}</table><small>{legend}</small>")


class LiveMonitor:
    """The live table of ``nprocs`` ranks training in :attr:`run_dir` (a fresh run folder
    unless one is given): ``with LiveMonitor(2) as watch: launch(..., run_dir=watch.run_dir)``."""

    def __init__(self, nprocs: int, run_dir: str | Path | None = None,
                 interval: float = live.REFRESH_S, name: str = "live"):
        self.nprocs, self.interval = nprocs, interval
        self.run_dir = Path(run_dir) if run_dir else new_run_dir(name)
        self.widget = widgets.HTML(value=table_html([], self.title()))
        self.records: list[dict] = []
        self.refreshes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        live.touch_watch(self.run_dir)  # before the ranks start: they publish from step 1

    def title(self) -> str:
        return f"{self.nprocs} ranks, run folder {self.run_dir.name}"

    def refresh(self, watching: bool = True) -> list[dict]:
        """Read the records (keeping the watch alive) and redraw the table."""
        if watching:
            live.touch_watch(self.run_dir)
        self.records = live.read(self.run_dir, self.nprocs)
        self.widget.value = table_html(self.records, self.title())
        self.refreshes += 1
        return self.records

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh()

    def start(self, show: bool = True) -> "LiveMonitor":
        """Show the table under the cell and start redrawing it in the background."""
        if show:
            display(self.widget)
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, name="edu3d-live", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        """Stop redrawing; the table then shows the ranks' final records."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.refresh(watching=False)

    def __enter__(self) -> "LiveMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _repr_html_(self) -> str:
        return table_html(self.records, self.title())
