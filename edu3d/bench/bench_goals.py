"""``edu3d bench goals``: edu3d's speed goals, measured on this machine against each goal.

After reading this file you should understand why no test of edu3d times anything, and where
its speed promises are measured instead. A test proves what cannot depend on the machine:
the planner weighs a bounded number of layouts, a failing rank is named before a hang guard
fires, a chart draws one trace per kind of box whatever the number of boxes. How *fast* that
happens depends on the CPU and on whatever else runs beside it; a test that asserted it
would fail a good install on a busy laptop. Those numbers are goals, reported here against
the goal (``ratio = measured / goal``, at most 1 when met), never failed:

* **the planner** answers the largest inputs ``edu3d plan`` accepts (:data:`PLANS`, which
  tests/test_bad_input.py also holds to their bounded work) in 5 CPU seconds each, and
  refuses a bad number in 2; the divisors of a billion take 0.5;
* **the charts**: a timeline of 8 ranks x 2,000 events, and the pipeline chart of 8 ranks x
  32 micro-batches, in 2 CPU seconds each;
* **the launcher** names a failing rank (4 ranks, cold) within 30 s, and ``edu3d run``
  within 60; ends a run at its 8 s timeout within 20 s, and a warm pool's run at its 2 s
  timeout within 15; names a killed fork server within 30 s, a mismatched collective
  (``EDU3D_TIMEOUT=4``) within 60 s, and a hung rank within its heartbeat (1.5 s) + 6 s;
* **the set-up**: ``./edu3d.sh setup`` on an up-to-date clone takes at most 5 s more than
  importing torch and edu3d (only from a clone whose ``.venv`` is up to date: the command
  must not install anything).

Every goal runs in a fresh interpreter (``python -c``, :data:`CHILD`), as a user's command
or notebook cell would: its imports are made before its clock starts, no goal warms another's
caches, and ``cpu`` counts that interpreter's CPU only, so other work on the machine slows
``wall`` but not ``cpu``. It is also how a benchmark times what sits above it in the house
(the widgets, the command line): by running it, never importing it. Rows use the harness's
shape (:mod:`edu3d.bench.harness`): ``edu3d_s`` is the measurement, ``reference_s`` the goal.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass

from edu3d.bench.harness import progress, report, result

PLANS = [  # the largest inputs edu3d plan accepts, and its costliest searches
    ["--params", "1e13", "--gpus", "1048576"],
    ["--params", "1e13", "--gpus", "65536"],
    ["--model", "deepseek-v3", "--gpus", "16384"],
    ["--model", "deepseek-v3", "--gpus", "1048576"],
    ["--model", "llama2-70b", "--gpus", "720720"],  # 240 divisors
    ["--model", "deepseek-v3", "--gpus", "65536", "--layers", "64", "--experts", "4096"],
    ["--model", "llama2-7b", "--gpus", "1024", "--global-batch", "16777216", "--layers", "1024",
     "--heads", "16384", "--d-model", "1048576", "--schedule", "interleaved"],
    ["--model", "llama2-7b", "--layers", "1024", "--pp", "1024", "--microbatches", "1048576",
     "--global-batch", "1048576", "--schedule", "zb-h1"],
    ["--model", "llama2-7b", "--layers", "1024", "--pp", "32", "--vpp", "2", "--microbatches",
     "1024", "--global-batch", "1024", "--schedule", "interleaved"],
    ["--model", "tiny", "--dp", "1048576", "--zero", "1", "--global-batch", "1048576"],
]


@dataclass(frozen=True)
class Goal:
    """One goal: ``setup`` runs first, then ``timed`` on the clock, then ``after``; the
    row reports ``clock`` (``cpu``, ``wall``, or a number ``timed`` put in ``out``). A goal
    that waits for an error names what it ``says``: a run that failed another way measured
    nothing."""

    name: str
    goal_s: float
    clock: str
    setup: str
    timed: str
    after: str = ""
    says: str = ""  # what the error ``timed`` caught (``out["said"]``) must say


CHILD = """\
import contextlib, io, json, os, sys, tempfile, time
from pathlib import Path
tmp = Path(tempfile.mkdtemp())
out = {{}}
{setup}
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    wall, cpu = time.perf_counter(), time.process_time()
{timed}
    out.setdefault("wall", time.perf_counter() - wall)
    out.setdefault("cpu", time.process_time() - cpu)
{after}
print(json.dumps(out))
"""

# ---- what the launcher goals run: scripts whose ranks import nothing they do not use ----------
RAISES = """\
import os, time
import torch.distributed as dist
from edu3d.distributed import runtime
mesh = runtime.init()
if mesh.rank == 3:
    time.sleep(0.5)
    raise RuntimeError("rank three is broken")
dist.barrier()
"""
SLEEPS = "import time\nprint('up', flush=True)\ntime.sleep(3600)\n"
RUN_FAILS = """\
import os, time
if os.environ["RANK"] == "1":
    raise KeyError("missing shard")
time.sleep(3600)
"""
MISMATCHED = """\
import torch
from edu3d.distributed import comm, runtime, trace
mesh = runtime.init()
t = torch.ones(4)
with trace.current().context(step=3):
    comm.all_reduce(t)
    if mesh.rank == 0:
        comm.all_reduce(t)
    else:
        comm.broadcast(t, src=1)
"""
HANGS = """\
import time
import torch
from edu3d.distributed import comm, runtime, trace
mesh = runtime.init()
t = torch.ones(8)
for step in range(1, 9):
    with trace.current().context(step=step):
        if mesh.rank == 1 and step == 3:
            print(f"hanging at {time.time():.3f}", flush=True)
            while True:
                time.sleep(1.0)
        comm.all_reduce(t)
"""
KILLS_FORK_SERVER = """\
import os, signal, time
import torch
from edu3d.distributed import comm, runtime
mesh = runtime.init()
comm.all_reduce(torch.ones(4))
if mesh.rank == 0:
    os.kill(os.getppid(), signal.SIGKILL)
time.sleep(3600)
"""


def _script(name: str, text: str) -> str:
    """Setup lines that write ``text`` to ``tmp/NAME`` in the child."""
    return f"{name} = tmp / {name + '.py'!r}\n{name}.write_text({text!r})\n"


LAUNCH = "from edu3d.launch.api import LaunchError, LaunchTimeout, RankError, RankHung, launch\n"
POOL = "from edu3d.launch.warm import pool\n"
TIMELINE = """\
from edu3d.widgets.timeline import timeline_figure
ops = ["F", "B", "W", "all_reduce", "send", "recv"]
events = [{"rank": r, "lane": "compute" if ops[i % 6] in "FBW" else "comm", "op": ops[i % 6],
           "t0": i * 10.0, "t1": i * 10.0 + 8, "mb": i % 16, "bytes": 1024, "group": "pp",
           "n": 2, **({"sim": True} if i % 7 == 0 else {})}
          for r in range(8) for i in range(2000)]
timeline_figure(events[:10]).to_json()
"""
PIPELINE = """\
from edu3d.widgets.pipeline import pipeline_figure, synthetic_trace
events = synthetic_trace("1f1b", 8, 32)
pipeline_figure(synthetic_trace("1f1b", 2, 2), "1f1b", 2, 2).to_json()
"""
SETUP_SH = """\
import subprocess, edu3d
root = Path(edu3d.__file__).resolve().parent.parent
venv = root / ".venv" / "bin" / "python"
if not (root / "edu3d.sh").is_file() or not venv.is_file():
    out["skip"] = "edu3d is not installed from a clone set up by ./edu3d.sh"
elif subprocess.run([str(root / "edu3d.sh"), "setup", "--check"], capture_output=True).returncode:
    out["skip"] = "this clone's .venv is not up to date: ./edu3d.sh setup would install"
else:  # what the second run must do anyway: import torch and edu3d
    t0 = time.perf_counter()
    subprocess.run([str(venv), "-I", "-c", "import torch, edu3d"], check=True)
    importing = time.perf_counter() - t0
"""

def _caught(call: str, error: str = "LaunchError") -> str:
    """Timed lines: ``call``, keeping what the ``error`` it raises says in ``out["said"]``."""
    return f"try:\n    {call}\nexcept {error} as e:\n    out['said'] = str(e)"


GOALS = [
    *(Goal("plan " + " ".join(argv), 5.0, "cpu", "from edu3d.cli import main",
           f"main({['plan', *argv, '--json']!r})") for argv in PLANS),
    Goal("a 5000-digit number refused", 2.0, "cpu", "from edu3d.cli import main",
         _caught("main(['train', '--global-batch', '9' * 5000])", "SystemExit"), says="2"),
    Goal("divisors of a billion", 0.5, "cpu", "from edu3d.config.layout import divisors",
         "divisors(10**9)"),
    Goal("timeline, 8 ranks x 2000 events", 2.0, "cpu", TIMELINE,
         "timeline_figure(events, title='big').to_json()"),
    Goal("pipeline chart, 8 ranks x 32 mb", 2.0, "cpu", PIPELINE,
         "pipeline_figure(events, '1f1b', 8, 32).to_json()"),
    Goal("failing rank named (4, cold)", 30.0, "wall", LAUNCH + _script("s", RAISES),
         _caught("launch(s, 4, echo=False, timeout=600, pool=False, "
                 "env={'EDU3D_TIMEOUT': '3600'})"), says="rank 3 failed: RuntimeError"),
    Goal("edu3d run: failing rank named", 60.0, "wall",
         "import subprocess\n" + _script("s", RUN_FAILS),
         "out['said'] = subprocess.run([sys.executable, '-m', 'edu3d.cli', 'run', '-n', '2', "
         "str(s)], capture_output=True, text=True, timeout=600).stderr",
         says="rank 1 failed: KeyError"),
    Goal("8 s timeout: every rank ended", 20.0, "wall", LAUNCH + _script("s", SLEEPS),
         _caught("launch(s, 3, echo=False, timeout=8, pool=False)"), says="within 8 s"),
    Goal("warm pool, 2 s timeout: ended", 15.0, "wall",
         LAUNCH + POOL + _script("up", "print('up')\n") + _script("s", SLEEPS)
         + "launch(up, 2, echo=False, timeout=600, pool=True)",
         _caught("launch(s, 2, echo=False, timeout=2, pool=True)"), "pool.shutdown()",
         says="within 2 s"),
    Goal("killed fork server named", 30.0, "wall",
         LAUNCH + POOL + _script("up", "print('up')\n") + _script("s", KILLS_FORK_SERVER)
         + "launch(up, 2, echo=False, timeout=600, pool=True)",
         _caught("launch(s, 2, echo=False, timeout=600, pool=True)"), "pool.shutdown()",
         says="fork server died"),
    Goal("mismatched collective named", 60.0, "wall", LAUNCH + _script("s", MISMATCHED),
         _caught("launch(s, 2, echo=False, timeout=600, pool=False, "
                 "env={'EDU3D_TIMEOUT': '4'})"), says="broadcast(world) at step 3"),
    Goal("hang named, heartbeat 1.5 s", 1.5 + 6, "latency", LAUNCH + _script("s", HANGS)
         + "seen = {}\ndef echo(rank, stream, line):\n"
           "    if line.startswith('hanging at'):\n        seen['t'] = float(line.split()[-1])\n",
         _caught("launch(s, 3, echo=echo, timeout=600, heartbeat=1.5, pool=False, "
                 "env={'EDU3D_TIMEOUT': '60'})", "RankHung")
         + "\n    out['latency'] = time.time() - seen['t']", says="no progress for"),
    Goal("./edu3d.sh setup, up to date", 5.0, "overhead", SETUP_SH,
         "if 'skip' not in out:\n"
         "    subprocess.run([str(root / 'edu3d.sh'), 'setup'], check=True, "
         "capture_output=True)\n"
         "    out['overhead'] = time.perf_counter() - wall - importing"),
]


def measure(goal: Goal) -> dict:
    """``goal`` run once in a fresh interpreter: what its child printed (``cpu``, ``wall``,
    and what ``timed`` put in ``out``). Its runs go to a folder of their own."""
    code = CHILD.format(setup=goal.setup, timed=textwrap.indent(goal.timed, "    "),
                        after=goal.after)
    with tempfile.TemporaryDirectory() as runs:
        env = {**os.environ, "EDU3D_RUNS": runs, "OMP_NUM_THREADS": "1",
               "EDU3D_PROGRESS": "0"}
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, timeout=1200)
    if p.returncode or not p.stdout.strip():
        raise RuntimeError(f"goal {goal.name!r} failed (exit {p.returncode}): "
                           f"{p.stderr.strip().splitlines()[-1:] or 'no output'}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def row(goal: Goal, reps: int = 1) -> dict | None:
    """The report's row for ``goal``: the median of ``reps`` measurements against the
    goal; None (and one line saying why) when the goal cannot be measured here."""
    runs = [measure(goal) for _ in range(reps)]
    if "skip" in runs[0]:
        progress(f"{goal.name}: not measured: {runs[0]['skip']}")
        return None
    for r in runs:
        if goal.says not in r.get("said", "") or goal.clock not in r:
            raise RuntimeError(f"goal {goal.name!r} ended another way: "
                               f"{r.get('said', 'no error')[:300]!r}")
    got = statistics.median(r[goal.clock] for r in runs)
    progress(f"{goal.name}: {got:.2f} s ({goal.clock}), goal {goal.goal_s:g} s")
    return result(goal.name, got, f"goal ({goal.clock} s)", goal.goal_s,
                  met=got <= goal.goal_s, clock=goal.clock, reps=reps)


def run_benchmark(nprocs: int | None = None, reps: int = 1, json_out: bool = False,
                  goals: list[Goal] | None = None, **_) -> dict:
    """Every goal of :data:`GOALS` (or ``goals``), ``reps`` times each (medians); the
    rank counts are the goals' own, so ``nprocs`` is not used."""
    rows = [r for r in (row(g, reps) for g in (GOALS if goals is None else goals)) if r]
    progress(f"{sum(r['met'] for r in rows)} of {len(rows)} goals met")
    return report("goals", 1, rows, layout="each goal's own")
