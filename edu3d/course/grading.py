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
  the stub's own words while a function still raises ``NotImplementedError`` (what to
  compute and why, never the formula), else the assertion's message or the exception and
  where in *your* file it happened, and what to look at. Never a traceback through the
  grader; the same hint twice in a row within one cell is printed once. A check returns a
  :class:`Verdict`, true when it passed, which displays nothing (no stray ``True``/``False``).
* Hints are **tiered**, so that a learner thinks before reading an answer. The first failure
  of a check names the concept (the check's ``hint``); the second adds a closer nudge and the
  third (and later) the formula or the API call. Both live in the solution file,
  ``HINTS = {"function": ("nudge", "formula")}`` in ``solutions/<name>.py``, read as data
  (never run). Failures are counted per check title in this kernel (re-running a cell counts)
  since it last passed; ``edu3d grade`` passes the count it keeps between its own runs
  (``EDU3D_HINT_PRIOR``) and ``--hint-level`` (``EDU3D_HINT_LEVEL``, also yours to set in
  a notebook: :func:`hint_level`).
* Under ``edu3d grade`` the printed lines are for the learner only: each verdict also goes,
  with its hint, to the grader through a channel the submission's printing cannot reach,
  sealed before the submission is imported (:mod:`edu3d.course.verdict_channel`, which
  sets :data:`reporter`). Outside it (a notebook, nbval, the tests) nothing else changes.
"""

from __future__ import annotations

import ast
import importlib.util
import json
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
# where :func:`check` also sends its verdict under ``edu3d grade`` (set when the kernel is sealed)
reporter: Callable[[str, bool, str | None, object], None] | None = None


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


# ---- tiered hints ------------------------------------------------------------------------------
_failures: dict[str, int] = {}  # per check title: failures in this kernel since it last passed
_level: dict = {}  # the learner's own choice (hint_level), above the environment's


def hint_level(level: int | None = None) -> int:
    """The least hint tier every failure shows from now on (1 concept, 2 nudge, 3 formula);
    without an argument, the current one. ``edu3d grade --hint-level N`` sets it too."""
    if level is not None:
        if level not in (1, 2, 3):
            raise ValueError(f"hint level {level!r}: choose 1 (concept), 2 (nudge) or 3 "
                             "(formula)")
        _level["set"] = level
    env = os.environ.get("EDU3D_HINT_LEVEL", "1")
    return _level.get("set", int(env) if env in ("1", "2", "3") else 1)


def _prior(title: str) -> int:
    """Earlier failures of ``title`` that ``edu3d grade`` counted in its own state file."""
    try:
        prior = json.loads(os.environ.get("EDU3D_HINT_PRIOR") or "{}").get(title, 0)
    except (ValueError, AttributeError):
        return 0
    return prior if isinstance(prior, int) and 0 <= prior < 1000 else 0


def tiers(key: str) -> tuple[str, ...]:
    """The deeper hints of ``"exercise.function"``: ``HINTS[function]`` of the solution file,
    read as a literal (the solution is not run); () when it has none."""
    module, _, func = key.partition(".")
    try:
        tree = ast.parse(source(module, solutions=True).read_text())
    except (OSError, SyntaxError, ValueError):
        return ()
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] \
                == ["HINTS"]:
            found = ast.literal_eval(node.value).get(func, ())
            return (found,) if isinstance(found, str) else tuple(found)
    return ()


def _tiered(title: str, reason: str, hint: str | None, key: str | None) -> str:
    """The one hint line of this failure of ``title``, as deep as its failures so far."""
    _failures[title] = _failures.get(title, 0) + 1
    level = max(hint_level(), min(3, _failures[title] + _prior(title)))
    deeper = tiers(key) if key else ()
    if hint and hint not in reason:
        reason = f"{reason.rstrip('.')}. Look at: {hint}"
    if level >= 2 and deeper:
        reason = f"{reason.rstrip('.')}. Closer: {deeper[0]}"
    if level >= 3 and len(deeper) > 1:
        reason = f"{reason.rstrip('.')}. The answer's shape: {deeper[-1]}"
    elif deeper:
        reason += " (fails again: a closer hint)"
    return reason


def check(title: str, test: Callable[[], object], *, hint: str | None = None,
          requires: tuple[str, ...] | str = (), about: str | None = None) -> Verdict:
    """Run ``test``; it passes when it returns without raising and does not return False.

    Prints one stable verdict line; a failure adds one hint line on stderr: the stub's words
    while one of ``requires`` (``"exercise.function"``, see :func:`unfinished`) is still a
    stub, else what the test reported (an assertion's message, or the error and the line of
    your file), then ``hint`` (the concept to look at) and, as this check keeps failing, the
    deeper tiers of ``about`` (default: the unfinished function, else the first of
    ``requires``; see :func:`tiers`). Runs launched inside the check show no live status
    line, so the cell's output is the verdict alone.
    """
    reqs = (requires,) if isinstance(requires, str) else tuple(requires)
    key = about or (reqs[0] if reqs else None)
    saved = os.environ.get("EDU3D_PROGRESS")
    os.environ["EDU3D_PROGRESS"] = "0"  # runs launched by a check show no status line
    reason = None
    try:
        for req in reqs:
            module, _, func = req.partition(".")
            reason = unfinished(module, func)
            if reason:
                key = about or req
                break
        if reason is None and test() is False:
            reason = hint or "the check found a wrong result"
    except Exception as err:  # noqa: BLE001 - a check must report, not crash the notebook
        reason = _reason(err)
    finally:
        if saved is None:
            os.environ.pop("EDU3D_PROGRESS", None)
        else:
            os.environ["EDU3D_PROGRESS"] = saved
    ok = reason is None
    print(f"{'PASS' if ok else 'FAIL'} {title}", flush=True)
    if ok:
        _failures.pop(title, None)
    else:
        reason = _tiered(title, reason, hint, key)
        _print_hint(reason)
    if reporter is not None:
        reporter(title, ok, reason, test)
    return Verdict(title, ok, reason)
