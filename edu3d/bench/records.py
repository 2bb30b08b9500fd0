"""Benchmarks a user can keep: every report as rows of one CSV file, appended run after run.

After reading this file you should understand what one row of ``edu3d bench NAME --csv FILE``
says and where each column comes from:

* **one row per measurement** (a :class:`Measurement`): a report's result row (the
  :mod:`edu3d.bench.harness` JSON shape) gives ``step_s`` (edu3d's median seconds per
  repetition, the reference's beside it), ``tokens_per_s`` when the row knows its tokens,
  ``mfu`` and ``tflops`` when it carries them (``mfu`` and ``reference_mfu``), and one
  ``comm_share_<group>`` per process group it traced (the share of edu3d's step with that
  group's operation in flight; no reference). ``reference`` names what edu3d was timed
  against (PyTorch's implementation, or a baseline such as data parallelism for ``cp``);
  ``ratio`` is always ``value / reference value``:
  below 1 is faster for ``step_s``, above 1 is faster for ``tokens_per_s``;
* **where it ran** (:func:`context`): the date (UTC), the git commit of the edu3d that ran
  (``git rev-parse`` where edu3d is a checkout, ``-dirty`` when tracked files differ,
  ``unknown`` elsewhere), the machine (host name and the GPU's name, or the CPU model and its
  cores) and torch's version;
* **append-safe**: the header is written only when the file is new (or empty); a run's rows
  are appended in one write, under a lock where the system has one; a file whose header is not :data:`COLUMNS` is refused before the
  benchmark starts (:func:`check_appendable`), never overwritten.

A new benchmark needs nothing here: its report's rows in the harness's shape become CSV
rows (:func:`measurements`). :mod:`edu3d.bench.plot` draws the file.
Nothing here imports torch (the command that writes the CSV reads torch's version from the
installed package's metadata, and a GPU's name only if the benchmark already imported torch).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import importlib.metadata
import io
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; appends are still whole rows
    fcntl = None

COLUMNS = ("date", "git_commit", "machine", "torch_version", "benchmark", "case", "layout",
           "world_size", "metric", "value", "reference", "reference_value", "ratio")
# metric -> (the row's key for edu3d's value, its key for the reference's value)
METRICS = {"step_s": ("edu3d_s", "reference_s"),
           "tokens_per_s": ("tokens_per_s", "reference_tokens_per_s"),
           "tflops": ("tflops", "reference_tflops"),
           "mfu": ("mfu", "reference_mfu")}
COMM_SHARE = "comm_share_"  # + group name: comm_share_dp, comm_share_tp, ...


class RecordsError(ValueError):
    """A CSV that cannot be appended to or read; the message is one line for the user."""


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measured number of one benchmark case, with the reference's beside it."""

    benchmark: str
    case: str
    layout: str
    world_size: int
    metric: str
    value: float
    reference_value: float | None = None
    reference: str = ""  # what the reference is (PyTorch's implementation, or a baseline)

    @property
    def ratio(self) -> float | None:
        """``value / reference_value`` (None without a reference)."""
        if self.reference_value in (None, 0):
            return None
        return self.value / self.reference_value


def measurements(rep: dict) -> list[Measurement]:
    """Every measurement in a benchmark report (the harness's JSON shape)."""
    out = []
    for row in rep["results"]:
        where = dict(benchmark=rep["benchmark"], case=row["name"],
                     layout=row.get("layout") or rep.get("layout") or f"{rep['world_size']} ranks",
                     world_size=int(row.get("world_size", rep["world_size"])))
        for metric, (mine, theirs) in METRICS.items():
            if row.get(mine) is not None:
                ref = row.get(theirs)
                out.append(Measurement(**where, metric=metric, value=float(row[mine]),
                                       reference_value=None if ref is None else float(ref),
                                       reference="" if ref is None else row.get("reference", "")))
        for group, share in sorted((row.get("comm_share") or {}).items()):
            out.append(Measurement(**where, metric=COMM_SHARE + group, value=float(share)))
    return out


# ---- where it ran ------------------------------------------------------------------------
def git_commit(where: Path = Path(__file__).resolve().parent) -> str:
    """The commit of the edu3d checkout that holds ``where`` (``-dirty`` when tracked files
    differ from it), or ``unknown`` when edu3d is not a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        top = Path(git("rev-parse", "--show-toplevel"))
        if not (top / "edu3d" / "__init__.py").is_file():
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short=12", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, the platform's word elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def machine() -> str:
    """``host/GPU name`` where torch (already imported by the benchmark) sees CUDA, else
    ``host/CPU model (N cores)``."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"{cpu_name()} ({os.cpu_count()} cores)"
    return f"{socket.gethostname()}/{device}"


def torch_version() -> str:
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.__version__
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def context() -> dict[str, str]:
    """The columns that say when, with what and where: one dict for all rows of a run."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "machine": machine(), "torch_version": torch_version()}


# ---- the file ------------------------------------------------------------------------------
def header(path: Path) -> list[str] | None:
    """The first row of ``path``, or None when the file is missing or empty."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    with path.open(newline="") as f:
        return next(csv.reader(f), None)


def check_appendable(path: str | os.PathLike) -> None:
    """Refuse, before a benchmark runs, a CSV that rows could not be appended to."""
    path = Path(path)
    if path.is_dir():
        raise RecordsError(f"--csv {path}: is a folder; name a file (e.g. {path / 'bench.csv'})")
    if not path.parent.is_dir():
        raise RecordsError(f"--csv {path}: folder {path.parent} does not exist; create it first")
    found = header(path)
    if found is not None and tuple(found) != COLUMNS:
        raise RecordsError(f"--csv {path}: its header is not edu3d bench's ({','.join(COLUMNS)}); "
                           f"name a new file")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise RecordsError(f"--csv {path}: not writable")


def append(path: str | os.PathLike, rows: list[Measurement], where: dict | None = None) -> int:
    """Append ``rows`` to the CSV at ``path`` (the header first if the file is new);
    ``where`` is :func:`context` unless given. Returns how many rows were written."""
    check_appendable(path)
    where = context() if where is None else where
    lines = [[where[c] for c in COLUMNS[:4]] +
             [m.benchmark, m.case, m.layout, m.world_size, m.metric, repr(m.value), m.reference,
              "" if m.reference_value is None else repr(m.reference_value),
              "" if m.ratio is None else repr(m.ratio)] for m in rows]
    with Path(path).open("a", newline="") as f:
        if fcntl is not None:  # two runs appending at once: one after the other
            fcntl.flock(f, fcntl.LOCK_EX)
        new = f.seek(0, os.SEEK_END) == 0  # the header only into an empty file
        text = io.StringIO()
        csv.writer(text).writerows([COLUMNS, *lines] if new else lines)
        f.write(text.getvalue())
    return len(rows)


def read(path: str | os.PathLike) -> list[dict]:
    """The rows of an ``edu3d bench --csv`` file, numbers as floats (None where empty)."""
    path = Path(path)
    if not path.is_file():
        raise RecordsError(f"{path}: no such file (make one with edu3d bench NAME --csv {path})")
    if path.stat().st_size == 0:
        raise RecordsError(f"{path}: is empty; append rows with edu3d bench NAME --csv {path}")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise RecordsError(f"{path}: not an edu3d bench CSV: its header lacks "
                               f"{', '.join(missing)}")
        try:
            rows = [{**r, "world_size": int(r["world_size"]),
                     **{c: float(r[c]) if r[c] else None
                        for c in ("value", "reference_value", "ratio")}}
                    for r in reader]
        except (TypeError, ValueError) as e:
            raise RecordsError(f"{path}: line {reader.line_num}: not a number ({e})") from None
    if not rows:
        raise RecordsError(f"{path}: has a header but no rows; append some with "
                           f"edu3d bench NAME --csv {path}")
    return rows
