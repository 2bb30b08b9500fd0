"""Hints are tiered (issue 27): a stub says what and why, the formula comes only after
repeated failures, in the notebook and in ``edu3d grade``; and ``edu3d course`` opens
JupyterLab without its news pop-up.

* every stub's ``NotImplementedError`` is free of code (no call, no assignment, no API
  name), and every stubbed function has a nudge and an answer in its solution's ``HINTS``;
* :func:`edu3d.course.grading.check` shows the concept first, the nudge on the second
  failure of the same check, the answer's shape from the third (and ``hint_level``);
* ``edu3d grade`` deepens its hints from one run to the next through its own state file,
  ignores a file it did not write, and ``--hint-level 3`` shows the answer at once.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest

from edu3d.course.autograde import hints as grade_hints
from edu3d.commands.course import NEWS_PLUGIN, course_env
from edu3d.course.autograde.kernel import kernel_env
from edu3d.course import grading

from .test_grading import edu3d_grade

ROOT = Path(__file__).resolve().parent.parent
CODE = re.compile(r"\w\(|[^=!<>]=[^=]|\b(dist|comm|torch|F|math)\.\w")


def stubs() -> list[tuple[str, str, str]]:
    """(module, top-level name, message) of every NotImplementedError in exercises/*.py."""
    out = []
    for path in sorted((ROOT / "exercises").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Raise) and getattr(getattr(sub.exc, "func", None),
                                                          "id", None) == "NotImplementedError":
                    out.append((path.stem, node.name, sub.exc.args[0].value))
    return out


def test_no_stub_gives_the_answer_away():
    found = stubs()
    assert len(found) >= 30, found
    for module, name, message in found:
        assert not CODE.search(message), f"{module}.{name}: code in the stub: {message}"


def test_every_stub_has_a_nudge_and_an_answer_in_its_solution():
    for module, name, _ in stubs():
        tiers = grading.tiers(f"{module}.{name}")
        assert len(tiers) == 2 and all(len(t) > 10 for t in tiers), (module, name, tiers)


def test_check_deepens_its_hint_as_the_same_check_keeps_failing(capsys, monkeypatch):
    # outside a kernel: an IPython shell another test left in this process would make every
    # check here one "cell", and a repeated hint would print as "the same as above"
    monkeypatch.setattr(grading, "get_ipython", lambda: None)
    monkeypatch.delenv("EDU3D_SOLUTIONS", raising=False)
    monkeypatch.delenv("EDU3D_HINT_LEVEL", raising=False)
    monkeypatch.delenv("EDU3D_HINT_PRIOR", raising=False)
    nudge, answer = grading.tiers("rank_memory.rank_params")
    for _ in range(3):
        grading.check("tiers demo", lambda: None, requires="rank_memory.rank_params",
                      hint="the concept")
    grading.check("tiers demo", lambda: None)  # passes: the count starts again
    grading.check("tiers demo", lambda: False, about="rank_memory.rank_params", hint="concept")
    hints = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("  hint: ")]
    assert "Look at: the concept (fails again" in hints[0] and nudge not in hints[0]
    assert nudge in hints[1] and answer not in hints[1]
    assert nudge in hints[2] and answer in hints[2] and "-(-vocab // tp)" in hints[2]
    assert nudge not in hints[3] and "(fails again: a closer hint)" in hints[3]
    monkeypatch.setenv("EDU3D_HINT_PRIOR", json.dumps({"tiers demo": 5}))
    grading.check("tiers demo", lambda: False, about="rank_memory.rank_params")
    assert answer in capsys.readouterr().err  # earlier failures that edu3d grade counted
    monkeypatch.delenv("EDU3D_HINT_PRIOR")
    grading.hint_level(3)
    try:
        grading.check("another", lambda: False, about="rank_memory.rank_params")
        assert answer in capsys.readouterr().err  # asked for the deepest at once
    finally:
        grading._level.clear()
    with pytest.raises(ValueError, match="choose 1"):
        grading.hint_level(4)


def test_the_state_file_is_trusted_only_when_edu3d_wrote_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EDU3D_RUNS", str(tmp_path / "runs"))
    counts: dict = {}
    grade_hints.record(counts, "exercises", "07_memory", {"failures": [{"check": "a"}]})
    grade_hints.record(counts, "exercises", "07_memory", {"failures": [{"check": "a"},
                                                                      {"check": "b"}]})
    grade_hints.save(counts)
    assert grade_hints.load() == {"exercises": {"07_memory": {"a": 2, "b": 1}}}
    grade_hints.record(counts, "exercises", "07_memory", {"failures": [{"check": "b"}]})
    assert counts["exercises"]["07_memory"] == {"b": 2}  # a passed: back to the concept
    path = grade_hints.state_file()
    for planted in ('{"targets": {"exercises": {"07_memory": {"a": 99}}}}',  # no stamp
                    json.dumps({"stamp": grade_hints.STAMP, "targets": {"x": {"y": {"a": -1}}}}),
                    "not json"):
        path.write_text(planted)
        assert grade_hints.load() == {}
        assert "ignoring" in capsys.readouterr().err
    real = tmp_path / "elsewhere.json"
    real.write_text(json.dumps({"stamp": grade_hints.STAMP, "targets": {}}))
    path.unlink()
    path.symlink_to(real)
    assert grade_hints.load() == {} and "not a regular file" in capsys.readouterr().err


def test_the_kernel_never_inherits_hint_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("EDU3D_HINT_PRIOR", '{"x": 900}')
    monkeypatch.setenv("EDU3D_HINT_LEVEL", "3")
    env = kernel_env(False, None, tmp_path)
    assert "EDU3D_HINT_PRIOR" not in env and "EDU3D_HINT_LEVEL" not in env
    env = kernel_env(False, None, tmp_path, {"EDU3D_HINT_LEVEL": "2"})
    assert env["EDU3D_HINT_LEVEL"] == "2"


@pytest.mark.timeout(600)
def test_edu3d_grade_deepens_from_run_to_run_and_on_request(tmp_path):
    env = {"EDU3D_SOLUTIONS": "0", "EDU3D_RUNS": str(tmp_path / "runs")}
    nudge, answer = grading.tiers("layout_choice.choose")
    hints = []
    for extra in ((), (), ("--hint-level", "3")):
        code, out, err = edu3d_grade("11", "--json", *extra, env=env, timeout=300)
        assert code == 1, err
        report = json.loads(out)["exercises"]["11_layout_choice"]
        # every declared check fails on the stubs (job checks a-c and the tuning checks)
        assert report["passed"] == 0 and len(report["failures"]) == report["total"] >= 3, report
        hints.append(report["failures"][0]["hint"])
    assert "not written yet" in hints[0] and nudge not in hints[0]
    assert nudge in hints[1] and answer not in hints[1]  # the second run: a closer hint
    assert answer in hints[2]
    code, out, _ = edu3d_grade("11", "--hint-level", "4", env=env)
    assert code == 2 and out == ""


def test_edu3d_course_opens_jupyterlab_without_the_news_pop_up():
    from jupyterlab_server.config import get_page_config

    env = course_env({"PATH": "/bin", "JUPYTER_CONFIG_PATH": "/opt/mine"})
    first, *rest = env["JUPYTER_CONFIG_PATH"].split(os.pathsep)
    assert rest == ["/opt/mine"] and env["PATH"] == "/bin"
    saved = os.environ.get("JUPYTER_CONFIG_PATH")
    os.environ["JUPYTER_CONFIG_PATH"] = env["JUPYTER_CONFIG_PATH"]
    try:  # what the installed JupyterLab reads when it builds the page
        disabled = get_page_config([], None)["disabledExtensions"]
    finally:
        if saved is None:
            os.environ.pop("JUPYTER_CONFIG_PATH")
        else:
            os.environ["JUPYTER_CONFIG_PATH"] = saved
    assert NEWS_PLUGIN in disabled
    assert course_env({})["JUPYTER_CONFIG_PATH"] == first
