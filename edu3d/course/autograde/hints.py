"""How deep ``edu3d grade``'s hints go: the failures it counted in its own earlier runs.

After reading this file you should understand why a learner who grades the same failing
exercise again sees a closer hint, and why no one can plant that count:

* hints are tiered (:mod:`edu3d.course.grading`): concept, then a nudge, then the answer's
  shape. A notebook's kernel counts the failures of each check itself; ``edu3d grade`` runs
  each notebook in a fresh kernel, so it keeps the count between its runs in **its own state
  file**, ``$EDU3D_RUNS/grade/attempts.json``, per graded folder (``exercises/`` or a
  ``--submission``), exercise and check: failures since the check last passed;
* the kernel gets those counts as ``EDU3D_HINT_PRIOR`` (JSON, check title -> failures);
  ``--hint-level N`` (``EDU3D_HINT_LEVEL``) asks for tier N at once; ``--solutions`` keeps
  no count;
* the file is trusted only when edu3d wrote it: a regular file (no link) of this user in a
  private folder (:func:`edu3d.launch.runs.check_private`), carrying :data:`STAMP`, with
  small non-negative integers where counts belong. Anything else is ignored (one line on
  stderr says so) and replaced by a fresh count at the end of the run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from edu3d.launch.runs import RunsError, base, check_private

STAMP = "edu3d grade attempts v1"  # written with every state file, and checked on reading it


def state_file() -> Path:
    return base() / "grade" / "attempts.json"


def _valid(data) -> bool:
    if not (isinstance(data, dict) and data.get("stamp") == STAMP
            and isinstance(data.get("targets"), dict)):
        return False
    for exercises in data["targets"].values():
        if not isinstance(exercises, dict):
            return False
        for checks in exercises.values():
            if not isinstance(checks, dict) or not all(
                    isinstance(k, str) and type(v) is int and 0 <= v < 1000
                    for k, v in checks.items()):
                return False
    return True


def load(path: Path | None = None, err=None) -> dict:
    """The counts edu3d wrote, ``{target: {exercise: {check: failures}}}``; {} when there
    is no file, or one edu3d cannot vouch for (said on ``err``)."""
    path = path or state_file()
    if not os.path.lexists(path):
        return {}
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_uid != os.getuid():
            raise ValueError("not a regular file of yours")
        check_private(path.parent, "grade state folder")
        data = json.loads(path.read_text())
        if not _valid(data):
            raise ValueError("not written by edu3d grade")
    except (OSError, ValueError, RunsError) as why:
        print(f"edu3d grade: ignoring {path} ({why}); hints start from the concept again",
              file=err or sys.stderr)
        return {}
    return data["targets"]


def prior(counts: dict, target: str, exercise: str) -> dict[str, int]:
    """Earlier failures of each check of ``exercise`` graded from ``target``."""
    return dict(counts.get(target, {}).get(exercise, {}))


def record(counts: dict, target: str, exercise: str, result: dict) -> None:
    """Count this run of ``exercise``: +1 for each failed check, passed ones back to 0."""
    checks = counts.setdefault(target, {}).setdefault(exercise, {})
    failed = {f["check"] for f in result["failures"]}
    for title in list(checks):
        if title not in failed:
            checks.pop(title)
    for title in failed:
        checks[title] = min(999, checks.get(title, 0) + 1)


def save(counts: dict, path: Path | None = None) -> None:
    """Write the counts (atomically, private), with :data:`STAMP`."""
    path = path or state_file()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private(path.parent, "grade state folder")
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"stamp": STAMP, "targets": counts}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
