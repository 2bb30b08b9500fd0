"""The live monitor (issue 28): a straggler injected with ``--inject-fault rank=R,kind=slow``
stands out in the table that ``edu3d train --monitor``, ``edu3d top`` and the notebook's
widget draw from the ranks' status records (edu3d.launch.live, edu3d.train.publish).

Three launches in all (each costs seconds): one watched run through ``edu3d train --monitor``
(its refresh lines, its final table, ``edu3d top`` on it afterwards, the widget's HTML of its
records), one unwatched run that must write one record per rank, and one watched run whose
folder another process vandalises (issue 44: nothing written there may crash a rank or the
launcher). Costs are compared as counts of writes, never as times."""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edu3d import cli
from edu3d.commands import top
from edu3d.commands.train import fault_spec
from edu3d.config.layout import Layout
from edu3d.launch import launch, live, runs
from edu3d.train import faults, loop
from edu3d.config.sections import Run
from edu3d.train.preflight import check_args
from tests import workers_failures

SLEEP = 0.3  # the straggler's extra seconds a step: ten times a step's own compute here
# (busy 28 ms at load 20 on 2 cores), so it stands out on a busy machine too


def test_slow_fault_parses_and_sleeps_every_step_of_every_attempt(monkeypatch):
    assert fault_spec("rank=1,kind=slow") == {"rank": 1, "kind": "slow", "step": 1}
    assert fault_spec("rank=0,kind=slow,step=3,seconds=0.5") == {
        "rank": 0, "kind": "slow", "step": 3, "seconds": 0.5}
    for bad in ("rank=1,step=2,seconds=1", "rank=1,kind=slow,seconds=0", "kind=slow"):
        with pytest.raises(argparse.ArgumentTypeError):
            fault_spec(bad)
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    spec = {"rank": 1, "kind": "slow", "step": 2, "seconds": 0.3}
    for step in (1, 2, 3):
        faults.maybe_inject(spec, 1, step, attempt=step - 1)  # restarts do not cure it
        faults.maybe_inject(spec, 0, step)
    assert slept == [0.3, 0.3]


def test_monitor_on_one_rank_is_refused_before_any_process(capfd):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--monitor", "--steps", "2"])
    assert exit_.value.code == 2
    err = capfd.readouterr().err
    assert "--monitor watches the ranks of a parallel run; add --dp 2" in err


def test_a_slow_rank_stands_out_live_and_in_top_afterwards(capfd, tmp_path, monkeypatch):
    code = cli.main(["train", "--dp", "2", "--layers", "2", "--steps", "8", "--json",
                     "--monitor", "--inject-fault", f"rank=1,kind=slow,seconds={SLEEP}"])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert len([json.loads(line) for line in out.splitlines()]) == 8  # --json untouched
    refreshes = [line for line in err.splitlines() if line.startswith("[monitor")]
    assert refreshes and all("(* slowest: rank 1)" in line for line in refreshes), err
    assert "\x1b[" not in err  # not a terminal: lines, no redraw codes
    assert "* rank 1: the slowest" in err and "memory: CPU: tracked tensors" in err

    title = next(line for line in err.splitlines() if line.startswith("edu3d monitor: "))
    run_dir = runs.base() / title.split()[2].rstrip(",")
    records = live.read(run_dir)
    assert [r["rank"] for r in records] == [0, 1] and all(r["done"] for r in records)
    slow, fast = records[1], records[0]
    assert slow["step_ms"] >= 1e3 * SLEEP and fast["step_ms"] >= 1e3 * SLEEP  # all wait
    assert live.slowest(records) == 1
    assert live.busy_ms(slow) >= 1e3 * SLEEP > live.busy_ms(fast)  # rank 0 waits in dp
    assert fast["comm_ms"]["dp"] > slow["comm_ms"].get("dp", 0.0)
    assert slow["coords"] == {"pp": 0, "dp": 1, "tp": 0}
    assert slow["memory"]["kind"] == "tensors" and slow["memory"]["bytes"] > 0
    assert all(r["n"] > 1 for r in records)  # watched: it published during the run

    shown = io.StringIO()
    assert top.main(run_dir.name[-6:], out=shown) == 0  # the id at the end of its name
    table = shown.getvalue().splitlines()
    assert table[1].split()[:4] == ["rank", "(pp,dp,tp)", "step", "step"]
    assert table[3].split()[:3] == ["*1", "(0,1,0)", "8/8"] and table[3].endswith("done")
    assert top.main("no-such-run", out=shown) == 2
    assert "no run matches" in capfd.readouterr().err

    from edu3d.widgets.monitor import table_html
    page = table_html(records, "t")
    assert page.count("<tr") == 3 and "background:#D55E00" in page.split("<tr")[3]


def test_nobody_watching_costs_one_write_per_rank():
    options = Run.of(layers=2, dp=2, steps=6, json=True,
                       inject_fault={"rank": 0, "kind": "slow", "step": 1, "seconds": 0.06})
    check_args(options)  # 6 steps of >= 60 ms: past a publish interval without a watcher
    run = launch(loop.worker, 2, args=(options.flat(),), layout=Layout(dp=2),
                 echo=False, timeout=120, name="unwatched")
    records = live.read(run.run_dir, 2)
    assert [r["n"] for r in records] == [1, 1]  # only the final record, nothing per step
    assert all(r["step"] == 6 and r["window_steps"] == 6 for r in records)
    assert not live.watch_file(run.run_dir).exists()
    assert live.slowest(records) == 0


def test_a_reader_never_takes_half_a_record(tmp_path):
    """A writer process rewrites its record as fast as it can; every record read whole."""
    import subprocess
    import sys

    path = tmp_path / "status" / "rank0.json"
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys; from pathlib import Path; from edu3d.launch import live\n"
        f"f = live.StatusFile(Path({str(path)!r}))\n"
        "for i in range(30000): f.write({'a': i, 'pad': 'x' * (i % 997), 'b': i})\n")])
    seen = set()
    try:
        while writer.poll() is None or not seen:
            rec = live.read_status(path)
            if rec is not None:
                assert rec["a"] == rec["b"] and len(rec["pad"]) == rec["a"] % 997
                seen.add(rec["a"])
    finally:
        writer.kill()
    assert len(seen) > 1


def test_on_a_terminal_the_table_is_redrawn_in_place(tmp_path):
    """Synthetic records (no ranks): a terminal gets the table in ANSI codes, the slowest row
    in reverse video, and each refresh first erases the lines the last one drew."""
    class Tty(io.StringIO):
        def isatty(self):
            return True

    for rank, (step_ms, dp_ms) in enumerate([(210.0, 200.0), (211.0, 2.0)]):
        f = live.StatusFile(live.status_file(tmp_path, rank))
        f.write({"rank": rank, "coords": {"pp": 0, "dp": rank, "tp": 0}, "step": 3,
                 "steps": 9, "step_ms": step_ms, "tokens_per_s": 1200.0,
                 "comm_ms": {"dp": dp_ms}, "memory": {"kind": "tensors", "bytes": 2 ** 20},
                 "t": 0.0, "done": False})
    screen = Tty()
    view = live.Terminal(tmp_path, 2, screen)
    assert live.watched(tmp_path)  # the ranks would publish now
    view.refresh()
    first = screen.getvalue()
    assert "\x1b[1;7m" in first and "*1" in first and "95%" in first and "1.00" in first
    view.refresh()
    assert f"\x1b[{view.drawn}F\x1b[J" in screen.getvalue()[len(first):]


# ---- what others write into a run folder (issue 44) --------------------------------------------
GARBAGE = [b'{"rank": 1, "t": "yesterday"}', b'{"t": 1.0, "step": 3}', b"[1, 2, 3]",
           b'{"rank": 0, "t": 1.0}', b"[" * 100_000, b"\xff\xfe not json"]  # rank 0's in rank1


def _plant(path: Path, data: bytes, framed: bool) -> None:
    """``data`` as a status record would hold it (``framed``, behind the sequence lock's
    header), or written over the file as it is (``echo ... > status/rank1.json``)."""
    path.write_bytes((0).to_bytes(8, "little") + len(data).to_bytes(4, "little") + data
                     if framed else data)


def test_garbage_in_a_status_file_is_no_record(tmp_path):
    good = live.StatusFile(live.status_file(tmp_path, 0))
    good.write({"rank": 0, "step": 2, "steps": 9, "step_ms": 5.0, "t": 0.0,
                "memory": {"kind": "cuda", "allocated": "lots"}, "comm_ms": {"dp": "x"}})
    screen = io.StringIO()
    view = live.Terminal(tmp_path, 2, screen)
    for data, framed in itertools.product(GARBAGE, (True, False)):
        _plant(live.status_file(tmp_path, 1), data, framed)
        assert [r["rank"] for r in view.refresh()] == [0], (data[:40], framed)
    assert [r["rank"] for r in view.close()] == [0]
    assert "MiB alloc/resv" in screen.getvalue()  # rank 0's memory: no number, a dash


def test_a_rank_survives_its_files_being_truncated(tmp_path):
    """``truncate -s 0`` of a flight record or a status record while its rank rewrites it:
    a write into a memory map past the file's end was a SIGBUS that killed the rank."""
    code = ("import sys, time; from pathlib import Path\n"
            "from edu3d.distributed.trace import Flight\n"
            "from edu3d.launch.live import StatusFile\n"
            "d = Path(sys.argv[1]); f = Flight(d / 'flight' / 'rank0.json')\n"
            "s = StatusFile(d / 'status' / 'rank0.json')\n"
            "print('ready', flush=True)\n"
            "end, whole = time.monotonic() + 2.0, 0\n"
            "while time.monotonic() < end:\n"
            "    f.note('in', {'op': 'all_reduce', 'lane': 'comm'})\n"
            "    s.write({'rank': 0, 't': time.time()})\n"
            "    whole += (d / 'flight' / 'rank0.json').stat().st_size == Flight.SIZE\n"
            "f.close(); s.close()\n"
            "sys.exit(0 if whole else 3)  # each write makes the file whole again\n")
    writer = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "ready\n"
        cuts = 0
        while writer.poll() is None:
            for path in (tmp_path / "flight" / "rank0.json", tmp_path / "status" / "rank0.json"):
                os.truncate(path, 0)
                cuts += 1
        assert writer.wait() == 0 and cuts > 2, f"exit {writer.returncode} after {cuts} cuts"
    finally:
        writer.kill()


def test_a_watched_run_survives_what_another_process_writes_into_its_folder(tmp_path):
    """Two ranks all-reduce and rewrite their status records, watched by the live table and
    the heartbeat, while another process writes garbage into the folder, truncates its
    files, and forges errors and exits without the fields a real one has. The run ends
    well: each once ended a run with a traceback (the watcher's or the heartbeat's), or a
    rank with SIGBUS."""
    run_dir, vandalised = tmp_path / "run", []
    view = live.Terminal(run_dir, 2, io.StringIO())

    def vandal(elapsed, done):
        view.poll(elapsed, done)
        if done or len(vandalised) == 4 or not (run_dir / "flight" / "rank1.json").exists():
            return
        for i, data in enumerate(GARBAGE):
            _plant(live.status_file(run_dir, 1), data, framed=i % 2 == 0)
            (run_dir / "flight" / "rank1.json").write_bytes(data)
            for kind in ("errors", "exits"):
                (run_dir / kind).mkdir(exist_ok=True)
                (run_dir / kind / "rank1.json").write_bytes(data)
            view.refresh()
        for path in (live.status_file(run_dir, 0), run_dir / "flight" / "rank0.json"):
            os.truncate(path, 0)
        vandalised.append(elapsed)

    run = launch(workers_failures.steps_with_status, 2, args=(40, 0.05), run_dir=run_dir,
                 on_poll=vandal, heartbeat=5.0, echo=False, timeout=120)
    assert run.results == [0, 1] and vandalised, vandalised  # no rank died, no traceback
    view.close()  # and the final table is drawn from whatever is left there


def test_top_writes_only_into_a_folder_edu3d_made(tmp_path, capsys):
    """``edu3d top DIR`` made ``DIR/status/watching`` in any folder. A folder without the run
    marker is shown if it holds status records (a copied run), never written to; one with
    neither is refused."""
    plain, copied = tmp_path / "plain", tmp_path / "copied"
    plain.mkdir()
    assert top.main(str(plain), once=True) == 2 and list(plain.iterdir()) == []
    assert "is not a run folder" in capsys.readouterr().err
    live.StatusFile(live.status_file(copied, 0)).write(
        {"rank": 0, "step": 4, "steps": 4, "t": 0.0, "done": False})
    shown = io.StringIO()
    assert top.main(str(copied), once=True, out=shown) == 0 and "4/4" in shown.getvalue()
    assert not live.watch_file(copied).exists()
