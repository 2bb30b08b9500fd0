"""Grading: exercises load the learner's code, checks print stable verdict lines.

After reading this file you should understand how an exercise notebook is graded:

* ``exercises/<name>.py`` holds the learner's stubs; ``solutions/<name>.py`` has the same
  names implemented. :func:`load` returns the learner's module, or the solution when the
  environment variable ``EDU3D_SOLUTIONS=1`` is set (the instructor's and CI's setting). The
  variable travels to every rank a check launches, so multi-process checks grade the same
  code.
* ``EDU3D_SUBMISSION=DIR`` (what ``edu3d grade --submission DIR`` sets) grades one learner's
  folder instead of ``exercises/``: :func:`load` imports ``DIR/<name>.py``, and a module
  the folder lacks is the untouched stub from ``exercises/`` (so its checks fail, with the
  stub's hint). Only exercise module names are looked up there, and the module is compiled
  from its source without writing a ``__pycache__`` into the learner's folder.
  ``EDU3D_SOLUTIONS=1`` wins over it.
* :func:`check` runs one test and prints exactly one line, ``PASS <title>`` or
  ``FAIL <title>`` — nothing else, no timings or addresses. The notebook stores the ``PASS``
  lines, and nbval (``--nbval-lax``, cells tagged ``nbval-check-output``) compares them:
  with solutions every check passes; with the untouched stubs every check fails.
* A failure adds exactly one hint line on stderr (which nbval does not see in a passing run):
  the stub's own hint while a function still raises ``NotImplementedError``, else the
  assertion's message or the exception and where in *your* file it happened, and what to
  look at. Never a traceback through the grader; the same hint twice in a row within one
  cell is printed once. A check returns a :class:`Verdict`, true when it passed, which
  displays nothing (no stray ``True``/``False`` under the cell).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Callable

from IPython import get_ipython

from edu3d.launch.procs import LaunchError

ROOT = Path(__file__).resolve().parents[2]  # the course checkout (editable install)


def using_solutions() -> bool:
    return os.environ.get("EDU3D_SOLUTIONS", "0").lower() in ("1", "true", "yes")


def submission() -> Path | None:
    """The learner's folder being graded (``EDU3D_SUBMISSION``), or None."""
    folder = os.environ.get("EDU3D_SUBMISSION")
    return Path(folder).resolve() if folder else None


def source(name: str, solutions: bool | None = None) -> Path:
    """The file :func:`load` imports for exercise module ``name``: ``solutions/<name>.py``
    with solutions, else ``<submission>/<name>.py`` when a submission holds it, else the
    learner's ``exercises/<name>.py``."""
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        raise ValueError(f"{name!r} is not an exercise module name (e.g. 'ranks', 'zero1')")
    use = using_solutions() if solutions is None else solutions
    if not use and submission() is not None and (submission() / f"{name}.py").is_file():
        return submission() / f"{name}.py"
    return ROOT / ("solutions" if use else "exercises") / f"{name}.py"


def _label(path: Path) -> str:
    """``exercises/ranks.py``, ``solutions/ranks.py`` or ``<submission folder>/ranks.py``."""
    return f"{path.parent.name}/{path.name}"


def _graded_file(path: Path) -> bool:
    folder = path.parent
    return folder.name in ("exercises", "solutions") or (
        submission() is not None and folder.resolve() == submission())


def load(name: str, solutions: bool | None = None) -> ModuleType:
    """Import the exercise module ``name`` fresh (from the file :func:`source` names)."""
    path = source(name, solutions)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; is edu3d installed from a checkout "
                                f"(pip install -e .) and is {name!r} an exercise?")
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    if submission() is not None and path.parent.resolve() == submission():
        # compiled here, not by the import system: nothing is written into the learner's folder
        exec(compile(path.read_text(), str(path), "exec"), module.__dict__)  # noqa: S102
    else:
        spec.loader.exec_module(module)
    return module


def unfinished(name: str, *functions: str) -> str | None:
    """The hint of the first of ``functions`` (top-level names in the exercise ``name``; a
    class counts with all its methods) that still raises ``NotImplementedError``, or None.

    Read from the source, without importing or running it: a multi-process check can say
    "not written yet" at once instead of launching ranks that all stop at the stub.
    """
    path = source(name)
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if getattr(node, "name", None) not in functions:
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Raise) and isinstance(sub.exc, ast.Call) and getattr(
                    sub.exc.func, "id", None) == "NotImplementedError":
                args = sub.exc.args
                text = args[0].value if args and isinstance(args[0], ast.Constant) else ""
                return f"{node.name} is not written yet ({_label(path)}): " \
                       f"{_strip_hint(str(text))}"
    return None


class Verdict:
    """What :func:`check` returns: true when the check passed. It displays nothing in a
    notebook (the verdict line is already printed), so no stray ``True``/``False``."""

    def __init__(self, title: str, passed: bool, hint: str | None = None):
        self.title, self.passed, self.hint = title, passed, hint

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'} {self.title}"

    def _ipython_display_(self) -> None:
        pass


def _strip_hint(text: str) -> str:
    return re.sub(r"^(hint:\s*)", "", " ".join(text.split()))


def _where(err: BaseException) -> str:
    """Where in the learner's code (an exercise file or the notebook) ``err`` was raised."""
    frames = traceback.extract_tb(err.__traceback__)
    for fr in reversed(frames):
        path = Path(fr.filename)
        if _graded_file(path):
            return f" ({_label(path)}, line {fr.lineno}, in {fr.name})"
    return ""


def _reason(err: BaseException) -> str:
    """One line for the learner: what went wrong, never the grader's traceback."""
    text = str(err)
    if isinstance(err, AssertionError) and text:
        text = text.splitlines()[0]  # the message, not pytest's rewritten expression
    if "Traceback (most recent call last)" in text or "---- traceback of rank" in text:
        # a rank's traceback: its first line names the rank, its last line the error
        lines = [ln for ln in text.splitlines() if ln.strip()]
        last = lines[-1].strip()
        text = lines[0] if last in lines[0] else f"{lines[0]} ({last})"
    text = " ".join(text.split())
    nie = re.search(r"NotImplementedError:\s*(.*)", text)
    if isinstance(err, NotImplementedError) or nie:
        msg = _strip_hint(nie.group(1) if nie and not isinstance(err, NotImplementedError)
                          else text)
        return f"not written yet{_where(err)}: {msg}" if msg else f"not written yet{_where(err)}"
    if len(text) > 400:
        text = text[:400] + " ..."
    if isinstance(err, (AssertionError, LaunchError)):
        return text  # the message says it all (a failed run names its rank)
    return f"{type(err).__name__}: {text}{_where(err)}" if text else \
        f"{type(err).__name__}{_where(err)}"


_last_hint: dict = {}  # the last hint printed, and in which cell


def _cell() -> object:
    shell = get_ipython()
    return getattr(shell, "execution_count", None)


def _print_hint(hint: str) -> None:
    cell = _cell()
    if _last_hint.get("cell") == cell and _last_hint.get("hint") == hint and cell is not None:
        hint = "the same as above"
    else:
        _last_hint.update(cell=cell, hint=hint)
    print(f"  hint: {hint}", file=sys.stderr, flush=True)


def check(title: str, test: Callable[[], object], *, hint: str | None = None,
          requires: tuple[str, ...] | str = ()) -> Verdict:
    """Run ``test``; it passes when it returns without raising and does not return False.

    Prints one stable verdict line; a failure adds one hint line on stderr: the stub's hint
    while one of ``requires`` (``"exercise.function"``, see :func:`unfinished`) is still a
    stub, else what the test reported (an assertion's message, or the error and the line of
    your file), followed by ``hint`` (what to look at). Runs launched inside the check show
    no live status line, so the cell's output is the verdict alone.
    """
    reqs = (requires,) if isinstance(requires, str) else tuple(requires)
    saved = os.environ.get("EDU3D_PROGRESS")
    os.environ["EDU3D_PROGRESS"] = "0"  # runs launched by a check show no status line
    reason = None
    try:
        for req in reqs:
            module, _, func = req.partition(".")
            reason = unfinished(module, func)
            if reason:
                hint = None  # the stub's own hint says what to do
                break
        if reason is None and test() is False:
            reason = hint or "the check found a wrong result"
            hint = None
    except Exception as err:  # noqa: BLE001 - a check must report, not crash the notebook
        reason = _reason(err)
        if isinstance(err, NotImplementedError) or reason.startswith("not written yet"):
            hint = None  # the stub's own hint says what to do
    finally:
        if saved is None:
            os.environ.pop("EDU3D_PROGRESS", None)
        else:
            os.environ["EDU3D_PROGRESS"] = saved
    ok = reason is None
    print(f"{'PASS' if ok else 'FAIL'} {title}", flush=True)
    if not ok:
        if hint and hint not in reason:
            reason = f"{reason.rstrip('.')}. Look at: {hint}"
        _print_hint(reason)
    return Verdict(title, ok, reason)
