"""Grading: exercises load the learner's code, checks print stable verdict lines.

After reading this file you should understand how an exercise notebook is graded:

* ``exercises/<name>.py`` holds the learner's stubs; ``solutions/<name>.py`` has the same
  names implemented. :func:`load` returns the learner's module, or the solution when the
  environment variable ``EDU3D_SOLUTIONS=1`` is set (the instructor's and CI's setting). The
  variable travels to every rank a check launches, so multi-process checks grade the same
  code.
* :func:`check` runs one test and prints exactly one line, ``PASS <title>`` or
  ``FAIL <title>`` — nothing else, no timings or addresses. The notebook stores the ``PASS``
  lines, and nbval (``--nbval-lax``, cells marked ``# NBVAL_CHECK_OUTPUT``) compares them:
  with solutions every check passes; with the untouched stubs every check fails.
* Why it failed goes to stderr, which nbval does not compare, so the learner still sees it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent  # the course checkout (editable install)


def using_solutions() -> bool:
    return os.environ.get("EDU3D_SOLUTIONS", "0").lower() in ("1", "true", "yes")


def load(name: str, solutions: bool | None = None) -> ModuleType:
    """Import ``exercises/<name>.py`` (or ``solutions/<name>.py``) fresh from the checkout."""
    use = using_solutions() if solutions is None else solutions
    folder = "solutions" if use else "exercises"
    path = ROOT / folder / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; is edu3d installed from a checkout "
                                f"(pip install -e .) and is {name!r} an exercise?")
    spec = importlib.util.spec_from_file_location(f"{folder}.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def check(title: str, test: Callable[[], object]) -> bool:
    """Run ``test``; it passes when it returns without raising and does not return False.

    Prints one stable verdict line; the reason for a failure goes to stderr. Runs launched
    inside the check show no live status line, so the cell's output is the verdict alone.
    """
    saved = os.environ.get("EDU3D_PROGRESS")
    os.environ["EDU3D_PROGRESS"] = "0"  # runs launched by a check show no status line
    try:
        ok = test() is not False
        reason = "" if ok else "the check returned False"
    except NotImplementedError as err:
        ok, reason = False, f"not implemented yet: {err}"
    except Exception:  # noqa: BLE001 - a check must report, not crash the notebook
        ok, reason = False, traceback.format_exc(limit=3)
    finally:
        if saved is None:
            os.environ.pop("EDU3D_PROGRESS", None)
        else:
            os.environ["EDU3D_PROGRESS"] = saved
    print(f"{'PASS' if ok else 'FAIL'} {title}", flush=True)
    if not ok:
        print(f"  why: {reason}", file=sys.stderr, flush=True)
    return ok
