"""What ``edu3d grade`` prints, and the file its report goes to.

After reading this file you should understand the score table, and why the grader watches
its own standard output while a submission runs:

* the table has one row per exercise and, under it, every failed check with its hint (a hint
  equal to the one above it is said so, not repeated); an exercise whose notebook printed
  ``PASS`` lines the checker never reported, or whose submission left processes running, says
  so under its row;
* an instructor writes the report to a file (``edu3d grade --json > alice.json``). The
  submission runs with the instructor's rights and may find that file (the path is no
  secret) and write into it while it is graded. So when standard output is a regular file of
  its own (not shared with standard error), :func:`output_state` notes its size before any
  kernel starts, and :func:`restore_output` cuts off whatever was written there meanwhile,
  and says so, before the report is written. Every process of the grade is dead by then
  (:mod:`edu3d.course.autograde.processes`), so nothing writes after the report. Bytes the file
  held before the grade cannot be restored if they were changed; a replaced file (removed
  and made again) is said, not repaired; a pipe or a terminal cannot be taken back.
  ``--isolate`` keeps the submission from finding the grader's files at all.
"""

from __future__ import annotations

import os
import stat
import sys
import textwrap

SAME = "the same as above"


def table(report: dict, width: int = 100) -> str:
    """The score table (see the module docstring)."""
    name_w = max([len("exercise")] + [len(n) for n in report["exercises"]])
    head = f"{'exercise':<{name_w}}  passed  total  failed checks"
    rule = "-" * min(width, max(len(head), 40))
    lines = [f"graded: {report['graded']}", head, rule]
    for name, r in report["exercises"].items():
        fails = r["failures"]
        lines.append(f"{name:<{name_w}}  {r['passed']:>6}  {r['total']:>5}  "
                     + (f"{len(fails)} failed" if fails else "all passed"))
        for note in notes(r):
            lines += textwrap.wrap(f"! {note}", width, initial_indent="  ",
                                   subsequent_indent="    ")
        last = None
        for f in fails:
            lines += textwrap.wrap(f"FAIL {f['check']}", width, initial_indent="  ",
                                   subsequent_indent="      ")
            said = SAME if f["hint"] == last else f["hint"]
            lines += textwrap.wrap(f"hint: {said}", width, initial_indent="    ",
                                   subsequent_indent="      ")
            last = f["hint"]
    lines += [rule, f"{'total':<{name_w}}  {report['passed']:>6}  {report['total']:>5}"]
    return "\n".join(lines)


def notes(r: dict) -> list[str]:
    """What an instructor should know about one exercise's run besides its checks."""
    out = []
    if r.get("unreported_passes"):
        out.append(f"the notebook printed {r['unreported_passes']} PASS line(s) that the "
                   "checker did not report: they were not counted")
    if r.get("rejected_records"):
        out.append(f"{r['rejected_records']} line(s) on the verdict channel were not the "
                   "checker's (wrong key or number): ignored")
    if r.get("left_running"):
        out.append(f"the submission left {r['left_running']} process(es) running after its "
                   "kernel ended: killed")
    if r.get("survivors"):
        out.append(f"processes that would not die: {r['survivors']}")
    return out


def output_state(fd: int = 1) -> dict | None:
    """Standard output's file, when it is a regular file of its own: its identity and size."""
    try:
        st, err = os.fstat(fd), os.fstat(2)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) == (err.st_dev, err.st_ino):
        return None
    return {"fd": fd, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns}


def restore_output(state: dict | None, err=None) -> str | None:
    """Cut standard output's file back to its size before the grade, if anything wrote
    into it since; the line said on ``err`` (None when nothing had to be done)."""
    if state is None:
        return None
    st = os.fstat(state["fd"])
    said = None
    if st.st_nlink == 0:
        said = ("the file this report goes to was removed or replaced while the submission "
                "ran: the report below goes to the removed file, check the one at its path")
    elif st.st_size != state["size"] or st.st_mtime_ns != state["mtime_ns"]:
        os.ftruncate(state["fd"], state["size"])
        said = (f"something wrote into the file this report goes to while the submission ran "
                f"({st.st_size - state['size']:+d} bytes); cut back to the {state['size']} "
                "bytes it had before")
        if state["size"]:
            said += " (what those bytes held was not checked)"
    if said:
        print(f"edu3d grade: {said}", file=err or sys.stderr, flush=True)
    return said
