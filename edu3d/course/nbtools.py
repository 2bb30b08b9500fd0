"""Keeping the course's notebooks gradeable: ``python -m edu3d.course.nbtools refresh|strip NB...``.

nbval compares a cell's new output with the output stored in the notebook, but only for
cells that were executed when saved (an ``execution_count``) and that carry the cell tag
``nbval-check-output`` (JupyterLab's property inspector shows tags; the learner sees no
test plumbing in the cell itself). So a committed notebook must store exactly:

* for checked cells, the output of a clean run with the reference solutions
  (``EDU3D_SOLUTIONS=1``) and its execution count;
* for every other cell, nothing: charts and logs are for the learner's own run, and outputs
  full of timings would only bloat the repository.

An exercise's check cells are the exception: a stored ``PASS`` under every check would show
the learner green lines before any work (and which lines to print). They store no output;
instead each **declares** the titles of the checks it runs, in order, in its metadata
(``{"edu3d": {"checks": [...]}}``, :func:`declared`): what ``edu3d grade`` counts a cell's
verdicts against, and what the browser test expects the solutions to pass
(:func:`differences`). A cell's outputs are the learner's to change; its declaration comes
from the course's checkout, like the notebook itself.

``refresh`` executes a notebook top to bottom in its own folder and stores it that way (a
checked cell that printed only verdict lines declares their titles and keeps no output);
``strip`` only removes outputs (checked cells keep theirs); ``retag`` moves the legacy
in-source marker into the tag. ``check`` reports notebooks
that break the rule (the test suite runs it on every notebook).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from queue import Empty

import nbformat
from nbclient import NotebookClient

TAG = "nbval-check-output"  # the cell tag nbval --nbval-lax compares
MARK = "# NBVAL_CHECK_OUTPUT"  # nbval's older in-source marker, still honoured


def is_checked(cell) -> bool:
    """Whether nbval compares this cell's output: the ``nbval-check-output`` tag (how the
    course marks its cells) or the legacy ``# NBVAL_CHECK_OUTPUT`` first line."""
    if cell.cell_type != "code":
        return False
    return TAG in cell.get("metadata", {}).get("tags", []) or cell.source.lstrip().startswith(MARK)


def declared(cell) -> list[str] | None:
    """The check titles an exercise's check cell declares (its metadata's
    ``edu3d.checks``), or None for a cell that declares none."""
    checks = cell.get("metadata", {}).get("edu3d", {}).get("checks")
    return None if checks is None else [str(c) for c in checks]


def verdict_lines(cell) -> list[str] | None:
    """A cell's stdout as lines when each is a verdict (``PASS t``/``FAIL t``), else None."""
    lines = _stdout(cell).splitlines()
    return lines if lines and all(ln.startswith(("PASS ", "FAIL ")) for ln in lines) else None


def declare(cell) -> None:
    """Make a checked cell that printed only ``PASS`` lines declare those titles and keep no
    output; refuses a ``FAIL`` (the reference solutions must pass every check)."""
    lines = verdict_lines(cell)
    if not is_checked(cell) or lines is None:
        return
    failed = [ln for ln in lines if ln.startswith("FAIL ")]
    if failed:
        raise ValueError(f"the reference solutions failed a check: {failed[0]!r}; fix it "
                         "before refreshing")
    cell.setdefault("metadata", {}).setdefault("edu3d", {})["checks"] = [ln[5:] for ln in lines]
    cell.outputs, cell.execution_count = [], None


def retag(nb) -> int:
    """Move every legacy ``# NBVAL_CHECK_OUTPUT`` first line into the cell tag, in place
    (outputs and counts untouched: the comment never printed anything). Returns how many."""
    moved = 0
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.lstrip().startswith(MARK):
            body = cell.source.lstrip()[len(MARK):]
            cell.source = body[1:] if body.startswith("\n") else body
            tags = cell.setdefault("metadata", {}).setdefault("tags", [])
            if TAG not in tags:
                tags.append(TAG)
            moved += 1
    return moved


def strip(nb) -> None:
    """Remove outputs and counts from every unchecked code cell and every check cell that
    declares its checks, and the widget state a run saved (the widgets' outputs are gone with their cells), in place."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type == "code" and (not is_checked(cell) or declared(cell) is not None):
            cell.outputs, cell.execution_count = [], None
        cell.get("metadata", {}).pop("execution", None)


def problems(nb) -> list[str]:
    """What makes nbval's comparison of this notebook vacuous or noisy."""
    out = []
    if "widgets" in nb.metadata:  # JupyterLab would show a saved run's widgets, stale
        out.append("saves the widget state of a run (metadata.widgets); strip it "
                   "(`python -m edu3d.course.nbtools strip`)")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.source.lstrip().startswith(MARK):
            out.append(f"cell {i}: shows the test marker {MARK!r} to the learner; "
                       "tag the cell instead (`python -m edu3d.course.nbtools retag`)")
        if is_checked(cell) and declared(cell) is not None:
            if cell.outputs or cell.execution_count is not None:
                out.append(f"cell {i}: a check cell that declares its checks stores an "
                           "output; strip it (`python -m edu3d.course.nbtools strip`)")
            if not declared(cell):
                out.append(f"cell {i}: declares no check; run `python -m edu3d.course.nbtools "
                           "refresh`")
        elif is_checked(cell):
            if not cell.outputs or cell.execution_count is None:
                out.append(f"cell {i}: checked cell stores no output/execution count, so "
                           "nbval would not compare it; run `python -m edu3d.course.nbtools refresh`")
        elif cell.outputs:
            out.append(f"cell {i}: unchecked cell stores outputs; strip them")
    return out


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def _shown(cell) -> list:
    """What nbval compares of a cell's outputs: stdout as one text, each result's or
    display's ``text/plain``, and errors (stderr, a progress line, is not compared)."""
    stdout, shown = "", []
    for o in cell.get("outputs", []):
        kind = o.get("output_type")
        if kind == "stream" and o.get("name") == "stdout":
            stdout += o.get("text", "")
        elif kind in ("execute_result", "display_data"):
            shown.append(("shows", o.get("data", {}).get("text/plain", "")))
        elif kind == "error":
            shown.append(("error", f"{o.get('ename')}: {o.get('evalue')}"))
    return ([("prints", stdout)] if stdout else []) + shown


def differences(committed, executed) -> list[str]:
    """The checked cells of ``committed`` whose outputs ``executed`` (the same notebook,
    run again) does not reproduce: what ``pytest --nbval-lax`` would report. A cell that
    declares its checks must print ``PASS <title>`` for each, in order, and nothing else."""
    if len(committed.cells) != len(executed.cells):
        return [f"{len(executed.cells)} cells, the committed notebook has "
                f"{len(committed.cells)}"]
    out = []
    for i, (old, new) in enumerate(zip(committed.cells, executed.cells)):
        checks = declared(old)
        want = [("prints", "".join(f"PASS {c}\n" for c in checks))] if checks else _shown(old)
        if is_checked(old) and want != _shown(new):
            out.append(f"cell {i}: expected {want!r}\n  got {_shown(new)!r}")
    return out


def errors(nb) -> list[str]:
    """Every error output of an executed notebook, one line each."""
    return [f"cell {i}: {o.get('ename')}: {o.get('evalue')}" for i, c in enumerate(nb.cells)
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


POLL_SLICE_S = 0.5


def notebook_client(nb, **kwargs):
    """An ``nbclient.NotebookClient`` for ``nb`` that does not stall after widget cells.

    nbclient waits for a kernel's reply with one long ``poll`` on the zmq socket, and that
    wait sometimes misses a message that has already arrived (nbclient issue #312, open: seen
    here after a cell that displays an ipywidget, when the next cell's reply only came back
    when the whole cell ``timeout`` had run out). Here every wait on the shell and IOPub
    channels is cut into slices of :data:`POLL_SLICE_S`; each new ``poll`` looks at the
    socket first, so a reply that is there is taken at once. Timeouts mean what they meant.
    """
    def sliced(channel) -> None:
        wait = channel.get_msg

        async def get_msg(timeout: float | None = None):
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = POLL_SLICE_S if deadline is None else deadline - time.monotonic()
                try:
                    return await wait(timeout=max(0.0, min(POLL_SLICE_S, left)))
                except Empty:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise

        channel.get_msg = get_msg

    class Client(NotebookClient):
        async def async_start_new_kernel_client(self):
            kc = await super().async_start_new_kernel_client()
            sliced(self.kc.shell_channel)
            sliced(self.kc.iopub_channel)
            return kc

    return Client(nb, **kwargs)


def refresh(path: Path, timeout: int = 600) -> None:
    """Execute with the reference solutions, keep checked outputs (a check cell: its
    declared titles), strip the rest."""
    nb = nbformat.read(path, as_version=4)
    saved = os.environ.get("EDU3D_SOLUTIONS")
    os.environ["EDU3D_SOLUTIONS"] = "1"  # the kernel inherits it
    try:
        notebook_client(nb, timeout=timeout, kernel_name="python3",
                        resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        if saved is None:
            os.environ.pop("EDU3D_SOLUTIONS")
        else:
            os.environ["EDU3D_SOLUTIONS"] = saved
    for cell in nb.cells:
        declare(cell)
    strip(nb)
    nbformat.write(nb, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edu3d.course.nbtools", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("refresh", "strip", "check", "retag"))
    p.add_argument("notebooks", nargs="+", type=Path)
    a = p.parse_args(argv)

    bad = 0
    for path in a.notebooks:
        if a.action == "refresh":
            refresh(path)
        elif a.action in ("strip", "retag"):
            nb = nbformat.read(path, as_version=4)
            strip(nb) if a.action == "strip" else retag(nb)
            nbformat.write(nb, path)
        for msg in problems(nbformat.read(path, as_version=4)):
            bad += 1
            print(f"{path}: {msg}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
