"""./edu3d.sh, the two-command set-up: its refusals are one clear line, and a second run in
a set-up checkout installs nothing. Fast and offline: nothing here creates an environment."""

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "edu3d.sh"
STAMP = ROOT / ".venv" / ".edu3d-setup"


def run(args, cwd=ROOT, env=None, script=SCRIPT, timeout=240):  # a hang guard: busy machines
    """The script's result; ``env`` adds to this process's environment (None: removes)."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items()
           if v is not None and not k.startswith("PYTEST_")}
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def scratch(tmp_path):
    """A scratch clone: the script and pyproject.toml, no .venv."""
    clone = tmp_path / "clone"
    clone.mkdir()
    shutil.copy2(SCRIPT, clone / "edu3d.sh")
    shutil.copy2(ROOT / "pyproject.toml", clone / "pyproject.toml")
    return clone


def without_venv_module(folder: Path, name: str) -> Path:
    """A real Python whose ensurepip is missing, as on Debian without python3.X-venv."""
    shadow = folder / "shadow"
    (shadow / "ensurepip").mkdir(parents=True, exist_ok=True)
    (shadow / "ensurepip" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'ensurepip'\")\n")
    return executable(folder / name,
                      f'#!/bin/sh\nPYTHONPATH="{shadow}" exec "{sys.executable}" "$@"\n')


def one_clear_error(result) -> str:
    assert result.returncode == 1, result
    assert "Traceback" not in result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("edu3d.sh: error: "), result.stderr
    return errors[0]


def test_script_is_bash_with_strict_mode():
    text = SCRIPT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "\nset -euo pipefail\n" in text
    assert os.access(SCRIPT, os.X_OK)
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    # bash 3.2 (macOS): no associative arrays, no case conversion expansions
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "declare -A" not in code and ",,}" not in code and "^^}" not in code


def test_help_names_both_commands():
    result = run(["help"])
    assert result.returncode == 0, result
    for command in ("course", "test", "setup", "EDU3D_TORCH", "EDU3D_PYTHON"):
        assert command in result.stdout


@pytest.mark.parametrize("args", [["bogus"], [], ["setup", "--bogus"]])
def test_unknown_command_gives_usage_and_exit_2(args, scratch):
    result = run(args, script=scratch / "edu3d.sh", cwd=scratch)
    assert result.returncode == 2, result
    assert "usage: ./edu3d.sh" in result.stderr
    assert not (scratch / ".venv").exists()


def test_too_old_python_is_refused_in_one_line(scratch, tmp_path):
    old = executable(tmp_path / "python3.8", "#!/bin/sh\necho 3.8.18\n")
    result = run(["setup"], script=scratch / "edu3d.sh", cwd=scratch,
                 env={"EDU3D_PYTHON": str(old)})
    error = one_clear_error(result)
    assert "3.8.18" in error and "3.10 or newer" in error
    assert not (scratch / ".venv").exists()


def test_python_without_venv_is_refused_in_one_line(scratch, tmp_path):
    python = without_venv_module(tmp_path, "python3")
    result = run(["course"], script=scratch / "edu3d.sh", cwd=scratch,
                 env={"EDU3D_PYTHON": str(python)})
    error = one_clear_error(result)
    minor = "%d.%d" % sys.version_info[:2]
    assert "no venv module" in error and f"apt install python{minor}-venv" in error
    assert not (scratch / ".venv").exists()


def test_not_a_python_is_refused_in_one_line(scratch):
    result = run(["test"], script=scratch / "edu3d.sh", cwd=scratch,
                 env={"EDU3D_PYTHON": "no-such-python-here"})
    assert "not a command" in one_clear_error(result)


def test_the_newest_usable_python_is_picked(scratch, tmp_path):
    """python3.13 does not run (a pyenv shim of a version not enabled), python3.12 has no
    venv module, the others are too old: the one clear error is the venv one."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    executable(bin_ / "python3.13", "#!/bin/sh\necho 'pyenv: python3.13: command not found' >&2\n"
                                    "exit 127\n")
    without_venv_module(bin_, "python3.12")
    for name, version in (("python3.11", "3.9.6"), ("python3.10", "3.9.6"), ("python3", "3.9.6")):
        executable(bin_ / name, f"#!/bin/sh\necho {version}\n")
    result = run(["setup"], script=scratch / "edu3d.sh", cwd=scratch,
                 env={"EDU3D_PYTHON": None, "PATH": f"{bin_}:/usr/bin:/bin"})
    error = one_clear_error(result)
    assert "python3.12" in error and "no venv module" in error
    assert "trying the next Python" in result.stderr


def test_check_installs_nothing(scratch):
    result = run(["setup", "--check"], script=scratch / "edu3d.sh", cwd=scratch)
    assert result.returncode == 1 and "not up to date" in result.stderr, result
    assert not (scratch / ".venv").exists()


def _set_up_checkout():
    """Skips unless this checkout's .venv was made by ./edu3d.sh and is up to date."""
    if not STAMP.is_file():
        pytest.skip("this checkout has no .venv made by ./edu3d.sh (a conda or hand-made "
                    "environment, say); run ./edu3d.sh setup to test its second run")
    check = run(["setup", "--check"])
    if check.returncode != 0:
        pytest.skip(f"this checkout's .venv is not up to date for ./edu3d.sh: {check.stderr}")


@pytest.fixture
def no_pip(tmp_path):
    """PYTHONPATH that makes any `python -m pip` (or bin/pip) leave a mark and fail."""
    shadow = tmp_path / "no_pip"
    (shadow / "pip").mkdir(parents=True)
    mark = tmp_path / "pip-was-called"
    code = f"import pathlib, sys\npathlib.Path({str(mark)!r}).touch()\nsys.exit(3)\n"
    (shadow / "pip" / "__init__.py").write_text(code)
    (shadow / "pip" / "__main__.py").write_text(code)
    return {"PYTHONPATH": str(shadow)}, mark


def test_second_run_does_nothing_and_calls_no_pip(no_pip):
    """What makes the second run fast, checked as behaviour (its seconds against importing
    torch and edu3d: ``edu3d bench goals``): no pip, the stamp untouched, nothing written."""
    _set_up_checkout()
    env, mark = no_pip
    before = STAMP.stat().st_mtime_ns, STAMP.read_text()
    result = run(["setup"], env=env)
    assert result.returncode == 0, result
    assert "environment up to date (.venv" in result.stderr
    assert not mark.exists(), "the second run called pip"
    assert (STAMP.stat().st_mtime_ns, STAMP.read_text()) == before


def test_test_command_runs_the_paths_given_and_fails_when_nothing_ran(no_pip):
    """`./edu3d.sh test PATH` runs that file only (not all of tests/), and pytest's exit 5
    (no tests ran) is a failure, exit 1."""
    _set_up_checkout()
    env, mark = no_pip
    result = run(["test", "tests/test_project.py", "-k", "no_such_test_anywhere",
                  "-n", "0"], env=env, timeout=120)
    assert result.returncode == 1, result
    assert "collected no tests" in result.stderr
    in_file = len(re.findall(r"^def test_", (ROOT / "tests" / "test_project.py").read_text(),
                             re.M))
    assert f"collected {in_file} items / {in_file} deselected" in result.stdout, result.stdout
    assert not mark.exists()
