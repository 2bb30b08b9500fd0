"""``edu3d runs clean`` keeps the folder of a run that is still running (issue 41, item 3).

Before, ``clean`` removed every run folder but the newest ``--keep N``, a live one included,
and the run then finished without its folder. Now a folder still used by a running process is
kept, and the command says so:

* a real ``edu3d run`` of two ranks that sleep: while it runs, ``clean`` keeps its folder and
  names it; once it has been stopped, ``clean`` removes it;
* the pid-file rule, as a warm pool's ranks leave it (they outlive their jobs): a rank that is
  the run's (``EDU3D_RUN_ID`` in its environment) and has not written ``done/`` keeps the
  folder, also from the automatic pruning a new run does; a done rank does not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edu3d.launch import runs

ROOT = Path(__file__).resolve().parent.parent


def clean(base: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edu3d.cli", "runs", "clean", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "EDU3D_RUNS": str(base)})


@pytest.mark.timeout(300)
def test_clean_keeps_a_running_runs_folder_and_says_so(tmp_path, monkeypatch):
    base = tmp_path / "runs"
    monkeypatch.setenv("EDU3D_RUNS", str(base))
    old = runs.new_run_dir("finished")  # a run that has ended: clean removes it
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-m", "edu3d.cli", "run", "-n", "2", str(script)],
                            env={**os.environ, "EDU3D_RUNS": str(base)}, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        live = None
        while time.monotonic() < deadline and live is None:
            found = [d for d in base.iterdir() if d != old and len(runs.pid_files(d)) == 2]
            live = found[0] if found else None
            time.sleep(0.2)
        assert live is not None, "the run never started its two ranks"
        out = clean(base)
        assert out.returncode == 0, out.stderr
        assert "removed 1 run folder(s)" in out.stdout and not old.exists(), out.stdout
        assert f"kept {live.name}: its run is still running" in out.stdout, out.stdout
        assert live.is_dir() and proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    deadline = time.monotonic() + 60
    while runs.live([live]) and time.monotonic() < deadline:
        time.sleep(0.2)
    out = clean(base)
    assert "removed 1 run folder(s)" in out.stdout and not live.exists(), out.stdout


def test_a_live_rank_keeps_its_folder_from_pruning_until_it_is_done(tmp_path, monkeypatch):
    monkeypatch.setenv("EDU3D_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("EDU3D_KEEP_RUNS", "1")
    older = runs.new_run_dir("warm-job")
    (older / "command.json").write_text(json.dumps({"nprocs": 1, "run_id": "pool-7"}))
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            env={**os.environ, "EDU3D_RUN_ID": "pool-7"})
    try:
        (older / "pids").mkdir()
        (older / "pids" / "rank0.pid").write_text(str(rank.pid))
        time.sleep(0.05)  # the next folder is newer
        newer = runs.new_run_dir("next")  # prunes to one folder: never the live one
        assert older.is_dir() and newer.is_dir() and runs.live([older, newer]) == {older}
        (older / "done").mkdir()
        (older / "done" / "rank0").write_text("")  # its job is over (the rank lives on)
        assert runs.live([older]) == set()
        runs.new_run_dir("after")
        assert not older.exists()
    finally:
        rank.kill()
        rank.wait()
