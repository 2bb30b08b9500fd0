"""``edu3d grade`` against a submission that attacks the grader instead of solving (issue 41).

One submission for exercise 00 (``ranks.py``, its functions left as stubs) carries every
attack, each aimed at its own checked cell, so the report shows which defence held:

* **forged lines**: ``coords_of`` prints a ``PASS`` line for each of cell 3's 11 checks;
* **a patched checker**: just before cell 5 (an IPython ``pre_run_cell`` hook) it wraps
  ``grading.check`` to run the real checker on a test that passes; for cell 7 the wrapper
  prints ``PASS`` itself; before cell 9 it puts the real ``check`` back and replaces
  ``grading._reason`` so that any error reads as a pass;
* **a daemon** forked at import (``setsid``, forked again) that waits for the kernel to end,
  then writes a forged report into the grade's output file, again and again;
* **a write into the grade's output** while the grade runs (the path is no secret).

Before issue 41 this submission scored 19/19, exit code 0, and the daemon left the forged
report in the output file. Here: 0 of them all (21 since the design part), every failure saying
what happened, the output file holding the grader's report alone, the submission's home and
folder gone, and no process of the grade left. With ``--isolate`` (where the machine allows
namespaces) the same submission cannot write outside the grade's folder, see the grader or
reach a port of the machine, and nothing of it survives either.

Plus the verdict channel's own rules, without a kernel: a forged or replayed line is
rejected, and a process outside the grader's tree is turned away.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from edu3d.course.autograde import isolate as grade_isolate
from edu3d.course.autograde import scoring as grade
from edu3d.course.autograde.channel import Channel
from edu3d.course.verdict_channel import encode

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = nbformat.read(ROOT / "exercises" / "00_ranks.ipynb", as_version=4)
CELL3 = grade.declared_titles(NOTEBOOK.cells[3])  # coords_of's 11 checks
TOTAL = sum(len(grade.declared_titles(c)) for _, c in grade.checked_cells(NOTEBOOK))  # 21

EVIL = '''"""A submission that attacks the grader instead of computing anything."""
import json
import os
import socket
import time

from IPython import get_ipython

import edu3d.course.grading as grading

OUT, SEEN, CELL3, PORT = {out!r}, {seen!r}, {cell3!r}, {port!r}
FORGED = json.dumps({{"graded": "forged", "passed": 19, "total": 19, "exercises": {{}}}})
SAW = []  # what the attacks met, said in coords_of's error (so in the report's hints)

try:  # a write into the grade's output, while the grade runs
    with open(OUT, "w") as f:
        f.write(FORGED)
    SAW.append("wrote the report")
except OSError as err:
    SAW.append(f"could not write the report: {{err.strerror}}")
SAW.append("grader visible" if any(
    b"edu3d.cli\\0grade" in open(f"/proc/{{p}}/cmdline", "rb").read()
    for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{{p}}/cmdline"))
    else "grader not visible")

try:  # a service of this machine (the test listens on a loopback port)
    socket.create_connection(("127.0.0.1", PORT), timeout=5).close()
    SAW.append("reached a port of the machine")
except OSError as err:
    SAW.append(f"could not reach a port of the machine: {{err.strerror or err}}")

kernel = os.getpid()
r, w = os.pipe()
if os.fork() == 0:  # a daemon: its own session, orphaned, waiting for the kernel to end
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        try:
            with open(SEEN, "w") as f:
                json.dump({{"daemon": os.getpid(), "home": os.environ["HOME"],
                           "cwd": os.getcwd()}}, f)
        except OSError:
            pass
        while True:
            if not os.path.exists(f"/proc/{{kernel}}") or \\
                    open(f"/proc/{{kernel}}/stat").read().rsplit(") ", 1)[1][0] == "Z":
                try:
                    with open(OUT, "w") as f:
                        f.write(FORGED)
                except OSError:
                    pass
            time.sleep(0.1)
    os._exit(0)
os.waitpid(-1, 0)
SAW.append(f"daemon {{os.read(r, 20).decode()}}")

real_check, real_reason = grading.check, grading._reason


def check(title, test, **kw):
    if title.startswith("group_members(5") or title.endswith("layouts"):
        return real_check(title, lambda: True, **kw)  # the real checker, a test that passes
    if title.endswith("[3, 7]]"):
        grading.check = real_check
    print(f"PASS {{title}}")  # the checker replaced outright
    return True


def arm(info):  # each patch just before the cell it aims at
    if "group_members(5" in info.raw_cell:
        grading.check = check
    if "agrees_with_live_run" in info.raw_cell:
        grading._reason = lambda err: None if "group_members" in str(err) else real_reason(err)


get_ipython().events.register("pre_run_cell", arm)
printed = []


def coords_of(rank, dp, tp, pp):
    if not printed:  # forged lines: a PASS for each of the cell's checks
        printed.append(1)
        print("\\n".join("PASS " + t for t in CELL3))
    raise NotImplementedError("saw: " + "; ".join(SAW))


def group_members(rank, dim, dp, tp, pp):
    raise NotImplementedError("group_members: not written")
'''


def attack(tmp: Path, *flags: str) -> dict:
    """Grade the attacking submission with its report going to a file, as an instructor's
    shell does; what the report file and the submission's own notes say afterwards."""
    sub, out, seen = tmp / "evil", tmp / "report.json", tmp / "seen.json"
    sub.mkdir()
    service = socket.create_server(("127.0.0.1", 0))
    (sub / "ranks.py").write_text(EVIL.format(out=str(out), seen=str(seen), cell3=CELL3,
                                              port=service.getsockname()[1]))
    with service, open(out, "w") as report:
        run = subprocess.run([sys.executable, "-m", "edu3d.cli", "grade", "00", "--submission",
                              str(sub), "--json", *flags], stdout=report, stderr=subprocess.PIPE,
                             text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                          "EDU3D_RUNS": str(tmp / "runs")})
    written = out.read_text()
    time.sleep(1.0)  # ten of the daemon's turns, had it survived
    text = out.read_text()
    try:
        report = json.loads(text)
    except ValueError:
        report = {"not json": text[:300]}
    return {"code": run.returncode, "err": run.stderr, "report": report, "sub": sub,
            "changed_after": text != written, "seen": json.loads(seen.read_text())
            if seen.exists() else {}}


def of_grade(sub: Path) -> list[int]:
    """Processes still running with this submission in their environment."""
    mark = f"EDU3D_SUBMISSION={sub.resolve()}".encode()
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and mark in (p / "environ").read_bytes().split(b"\0"):
                found.append(int(p.name))
        except OSError:
            continue
    return found


def exercise(r: dict) -> dict:
    assert "exercises" in r["report"], f"the report file is not the grader's: {r['report']}"
    return r["report"]["exercises"]["00_ranks"]


def hints(r: dict, first: int, last: int) -> list[str]:
    return [f["hint"] for f in exercise(r)["failures"][first:last]]


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    return attack(tmp_path_factory.mktemp("attack"))


@pytest.mark.timeout(600)
def test_forged_pass_lines_count_for_nothing(attacked):
    assert f"00_ranks ... 0/{TOTAL} passed" in attacked["err"], attacked["err"][-500:]
    ex = exercise(attacked)
    assert attacked["code"] == 1 and ex["passed"] == 0 and ex["total"] == TOTAL, ex
    assert ex["unreported_passes"] >= len(CELL3) == 11
    # the checker's own verdicts for cell 3: the stub's failure, whatever the cell printed
    assert all(h.startswith("not written yet (evil/ranks.py") for h in hints(attacked, 0, 11))


@pytest.mark.timeout(600)
def test_a_patched_checker_passes_nothing(attacked):
    assert f"00_ranks ... 0/{TOTAL} passed" in attacked["err"], attacked["err"][-500:]
    cell5, cell7, cell9 = hints(attacked, 11, 15), hints(attacked, 15, 18), hints(attacked, 18, 19)
    assert all("tampered with (check was called from ranks.py" in h for h in cell5), cell5
    assert all("the checker reported none to the grader" in h for h in cell7), cell7
    assert "tampered with (edu3d.course.grading._reason was replaced)" in cell9[0], cell9


@pytest.mark.timeout(600)
def test_a_daemon_forked_at_import_does_not_outlive_the_grade(attacked):
    daemon = attacked["seen"].get("daemon")
    assert daemon and not os.path.exists(f"/proc/{daemon}"), attacked["seen"]
    assert not of_grade(attacked["sub"])
    assert exercise(attacked)["left_running"] >= 1 and not exercise(attacked)["survivors"]
    assert not attacked["changed_after"], "something wrote the report file after the grade"


@pytest.mark.timeout(600)
def test_a_write_into_the_grade_output_is_cut_off(attacked):
    assert attacked["report"]["graded"] == str(attacked["sub"].resolve())  # the whole file
    assert "something wrote into the file this report goes to" in attacked["err"]
    assert "saw: wrote the report" in hints(attacked, 0, 1)[0]  # the attack did happen


@pytest.mark.timeout(600)
def test_the_submission_runs_in_a_fresh_home_and_folder(attacked):
    home, cwd = Path(attacked["seen"]["home"]), Path(attacked["seen"]["cwd"])
    assert home != Path.home() and home.parent.name.startswith("edu3d-grade-")
    assert cwd.parent == home.parent and not home.parent.exists()  # removed with the grade


@pytest.mark.timeout(600)
@pytest.mark.skipif(grade_isolate.unavailable() is not None,
                    reason=f"--isolate cannot run here: {grade_isolate.unavailable()}")
def test_isolated_the_submission_cannot_write_out_nor_see_the_grader(tmp_path):
    r = attack(tmp_path, "--isolate")
    ex = exercise(r)
    assert r["code"] == 1 and ex["passed"] == 0 and ex["total"] == TOTAL, ex
    saw = hints(r, 0, 1)[0]
    assert "could not write the report: Read-only file system" in saw, saw
    assert "grader not visible" in saw and "daemon " in saw, saw
    assert "could not reach a port of the machine" in saw, saw
    assert not r["seen"] and not of_grade(r["sub"]) and not r["changed_after"]
    assert "something wrote" not in r["err"]


# ---- the channel's own rules ---------------------------------------------------------------------
# a kernel's end of the channel: prints the grader's hello, then sends each line it is given
RELAY = """import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
data = b""
while not data.endswith(b"\\n"):
    data += s.recv(1 << 16)
print(data.decode().strip(), flush=True)
for line in sys.stdin:
    s.sendall(bytes.fromhex(line.strip()))
    print("sent", flush=True)
"""


def test_the_channel_rejects_forged_and_replayed_lines(tmp_path):
    ch = Channel(tmp_path, ["cell"])
    kernel = subprocess.Popen([sys.executable, "-c", RELAY, str(ch.path)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        hello = json.loads(kernel.stdout.readline())
        key = bytes.fromhex(hello["key"])

        def send(data: bytes) -> None:
            kernel.stdin.write(data.hex() + "\n")
            kernel.stdin.flush()
            assert kernel.stdout.readline() == "sent\n"

        ok = {"n": 1, "title": "one", "passed": False, "hint": "h"}
        ch.mark("start", 3)
        send(encode(key, ok) + encode(b"x" * 32, {**ok, "n": 2, "passed": True})
             + encode(key, {**ok, "passed": True})  # a replay of number 1
             + b'{"n": 3, "title": "two", "passed": true, "hint": null}\n'
             + encode(key, {**ok, "n": 4, "title": "two"}))
        ch.mark("end", 3)
        send(encode(key, {**ok, "n": 5, "title": "three"}))  # between cells: no cell's
    finally:
        kernel.stdin.close()
        kernel.wait(timeout=30)
        ch.close()
    records, rejected = ch.records()
    assert records == {3: [ok, {**ok, "n": 4, "title": "two"}]} and rejected == 3
    assert hello["cells"] == ["cell"] and not ch.path.exists()


def test_a_process_outside_the_graders_tree_is_turned_away(tmp_path):
    ch = Channel(tmp_path, [])
    # a grandchild whose parent exited: adopted by init, no longer below this process
    orphan = subprocess.run([sys.executable, "-c", (
        "import os, socket, sys, time\n"
        "if os.fork(): os._exit(0)\n"
        "time.sleep(0.5)\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        f"s.connect({str(ch.path)!r})\n"
        "time.sleep(1)\n")], timeout=30)
    assert orphan.returncode == 0
    deadline = time.monotonic() + 10
    while not ch.refused and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ch.refused and "does not run below the grader" in ch.refused[0], ch.refused
    assert not ch.connected
    ch.close()
