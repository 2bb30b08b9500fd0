#!/usr/bin/env bash
# edu3d.sh: set the course up (a virtual environment in .venv, in this clone) when needed,
# then open the course or run the tests. `./edu3d.sh help` says how; README's "Set-up" says why.
# Written for bash 3.2 (macOS) too: no arrays, no associative arrays, no ${var,,}.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")" && pwd -P)
case "${EDU3D_PYTHON:-}" in  # a relative path is the caller's, not the clone's
    */*) [ "${EDU3D_PYTHON#/}" != "$EDU3D_PYTHON" ] || EDU3D_PYTHON="$PWD/$EDU3D_PYTHON" ;;
esac
cd "$ROOT"

VENV="$ROOT/.venv"
VENV_PY="$VENV/bin/python"
STAMP="$VENV/.edu3d-setup"
LOG="$VENV/edu3d-setup.log"
STAMP_FORMAT=1  # raise when the steps below change, so that every .venv is set up again
CPU_INDEX="https://download.pytorch.org/whl/cpu"
CANDIDATES="python3.13 python3.12 python3.11 python3.10 python3"

say() { echo "edu3d.sh: $*" >&2; }
die() { echo "edu3d.sh: error: $*" >&2; exit 1; }

usage() {
    cat <<'EOF'
usage: ./edu3d.sh COMMAND [ARGS...]

Sets up the course's Python environment (.venv in this clone) if needed, then:

  course [ARGS]    open the course: JupyterLab on notebooks/, on 127.0.0.1 only
                   (ARGS go to `edu3d course`, e.g. --no-browser or --port 8890)
  test [ARGS]      run the test suite, README's test command (ARGS go to pytest:
                   -k zero, or paths such as tests/test_project.py instead of tests/)
  setup [--check]  only set up; --check only says whether .venv is up to date
                   (exit 0) or would be set up (exit 1), and installs nothing
  help             this help

The first run creates .venv and installs torch and edu3d into it; later runs check it
(about a second) and install again only when pyproject.toml, the Python or the torch
choice changed. Torch is the CPU build from PyTorch's CPU index on Linux without an
NVIDIA GPU, the default build otherwise.

Environment:
  EDU3D_PYTHON   the Python to create .venv with (default: the newest of python3.13,
                 python3.12, python3.11, python3.10 and python3 that is 3.10 or newer)
  EDU3D_TORCH    the torch to install instead, a pip requirement or a wheel file (e.g.
                 torch==2.13.0 or ~/wheels/torch-2.13.0+cpu-...whl), installed with
                 pip's configured index (a mirror, a local folder); for machines that
                 cannot reach PyTorch's CPU index
EOF
}

# --- Python -----------------------------------------------------------------------------

# "3.11.7" for a Python command, or nothing (and status 1) if it does not run
py_version() {
    local out
    out=$("$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null) || return 1
    case "$out" in
        [0-9]*.[0-9]*.[0-9]*) echo "$out" ;;
        *) return 1 ;;
    esac
}

# status 0 when version $1 is 3.10 or newer
new_enough() {
    local major minor rest
    major=${1%%.*}; rest=${1#*.}; minor=${rest%%.*}
    [ "$major" -gt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -ge 10 ]; }
}

# the interpreter itself, not a launcher in front of it (a pyenv shim, say)
real_executable() {
    "$1" -c 'import sys; print(sys.executable)' 2>/dev/null | grep . || echo "$1"
}

has_venv() { "$1" -c 'import venv, ensurepip' >/dev/null 2>&1; }

no_venv_message() {  # $1 command, $2 version
    local minor=${2%.*}
    echo "$1 (Python $2) has no venv module (ensurepip is missing), so it cannot create" \
         ".venv. On Debian or Ubuntu: sudo apt install python$minor-venv; or set" \
         "EDU3D_PYTHON to another Python 3.10+"
}

# sets BASE_PY (a path) and BASE_VER: the Python to create .venv with
pick_python() {
    local cmd path ver too_old="" no_venv=""
    if [ -n "${EDU3D_PYTHON:-}" ]; then
        path=$(command -v "$EDU3D_PYTHON" 2>/dev/null) \
            || die "EDU3D_PYTHON=$EDU3D_PYTHON is not a command or an executable file"
        ver=$(py_version "$path") \
            || die "EDU3D_PYTHON=$EDU3D_PYTHON does not run as a Python (it could not print its version)"
        new_enough "$ver" \
            || die "EDU3D_PYTHON=$EDU3D_PYTHON is Python $ver; edu3d needs Python 3.10 or newer"
        has_venv "$path" || die "$(no_venv_message "EDU3D_PYTHON=$EDU3D_PYTHON" "$ver")"
        BASE_PY=$(real_executable "$path"); BASE_VER=$ver
        return 0
    fi
    for cmd in $CANDIDATES; do
        path=$(command -v "$cmd" 2>/dev/null) || continue
        ver=$(py_version "$path") || continue  # e.g. a pyenv shim of a version not enabled
        if ! new_enough "$ver"; then
            [ -n "$too_old" ] || too_old="$cmd is Python $ver"
            continue
        fi
        if ! has_venv "$path"; then
            say "$cmd (Python $ver) has no venv module; trying the next Python"
            [ -n "$no_venv" ] || no_venv=$(no_venv_message "$cmd" "$ver")
            continue
        fi
        BASE_PY=$(real_executable "$path"); BASE_VER=$ver
        return 0
    done
    [ -z "$no_venv" ] || die "$no_venv"
    [ -z "$too_old" ] || die "edu3d needs Python 3.10 or newer, and $too_old (none of" \
        "$CANDIDATES is newer). Install Python 3.10+ (python.org, or your package manager)" \
        "and run again, or set EDU3D_PYTHON to one"
    die "no Python found (none of $CANDIDATES runs). Install Python 3.10 or newer, or set" \
        "EDU3D_PYTHON to one"
}

# --- torch ------------------------------------------------------------------------------

# what to install torch with, one line: "EDU3D_TORCH=<requirement>", "cpu-index" or
# "default (...)". Without EDU3D_TORCH, the choice an earlier set-up recorded is kept.
torch_choice() {
    local recorded
    if [ -n "${EDU3D_TORCH:-}" ]; then
        echo "EDU3D_TORCH=$EDU3D_TORCH"
        return 0
    fi
    if [ -f "$STAMP" ]; then
        recorded=$(sed -n 's/^torch=//p' "$STAMP")
        if [ -n "$recorded" ]; then
            echo "$recorded"
            return 0
        fi
    fi
    case "$(uname -s)" in
        Linux)
            if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
                echo "default (an NVIDIA GPU was found)"
            else
                echo "cpu-index"
            fi ;;
        Darwin) echo "default (macOS)" ;;
        *) echo "default ($(uname -s))" ;;
    esac
}

# runs pip in .venv, its output appended to the log; status is pip's
pip_logged() {
    echo "+ pip $*" >>"$LOG"
    "$VENV_PY" -m pip "$@" >>"$LOG" 2>&1
}

show_log_tail() {
    echo "edu3d.sh: the last lines pip wrote (all of them: $LOG):" >&2
    tail -n "${1:-6}" "$LOG" | sed 's/^/    /' >&2
}

install_torch() {  # $1: the torch choice
    local have
    case "$1" in
        EDU3D_TORCH=*)
            say "installing torch from EDU3D_TORCH=${1#EDU3D_TORCH=} with pip's configured index (not PyTorch's CPU index)"
            pip_logged install "${1#EDU3D_TORCH=}" || { show_log_tail; die "pip could not install EDU3D_TORCH=${1#EDU3D_TORCH=}"; }
            return 0 ;;
    esac
    if have=$("$VENV_PY" -I -c 'import torch; print(torch.__version__)' 2>/dev/null); then
        say "torch $have is already installed in .venv; keeping it"
        return 0
    fi
    case "$1" in
        cpu-index)
            say "installing torch, CPU build, from PyTorch's CPU index $CPU_INDEX (no NVIDIA GPU here; about 200 MB)"
            # only that index: pip's configuration files, extra indexes and find-links are left
            # out, so that no other index can substitute a CUDA build (GBs) when it fails
            if ! (unset PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_NO_INDEX
                  export PIP_CONFIG_FILE=/dev/null
                  pip_logged install --retries 2 --index-url "$CPU_INDEX" torch); then
                show_log_tail 4
                die "could not install torch from PyTorch's CPU index ($CPU_INDEX): it could" \
                    "not be reached from here, or has no torch for this Python or machine. Set" \
                    "EDU3D_TORCH to a torch requirement your pip index or mirror provides, or to" \
                    "a wheel file, and run again; for example: EDU3D_TORCH=torch==2.13.0 ./edu3d.sh $COMMAND"
            fi ;;
        *)
            say "installing torch, the default build, from pip's configured index: $1"
            pip_logged install torch || { show_log_tail; die "pip could not install torch"; }
            ;;
    esac
}

# --- the environment --------------------------------------------------------------------

stamp_text() {  # $1 python version, $2 torch choice
    echo "format=$STAMP_FORMAT"
    echo "root=$ROOT"
    echo "python=$1"
    echo "pyproject=$(cksum <pyproject.toml | tr -s ' \t' ' ')"
    echo "torch=$2"
}

# status 0 when torch and this clone's edu3d import in .venv (-I: not from the current folder)
imports_ok() {
    "$VENV_PY" -I -c 'import os, sys, torch, edu3d
sys.exit(os.path.realpath(edu3d.__file__) != os.path.join(sys.argv[1], "edu3d", "__init__.py"))' \
        "$ROOT" >/dev/null 2>&1
}

# sets up .venv unless it is up to date. $1 = "check": only report (exit 0 if up to date, 1 if not)
ensure_env() {
    local mode=${1:-} venv_ver="" choice want recreate="" made_in
    [ -f pyproject.toml ] || die "no pyproject.toml in $ROOT; run edu3d.sh from the edu3d clone"
    if [ -x "$VENV_PY" ]; then
        venv_ver=$(py_version "$VENV_PY") || venv_ver=""
    fi
    if [ -z "$venv_ver" ]; then
        [ ! -e "$VENV" ] || recreate="its Python does not run"
    elif [ -n "${EDU3D_PYTHON:-}" ]; then
        pick_python
        [ "$venv_ver" = "$BASE_VER" ] || recreate="it has Python $venv_ver, EDU3D_PYTHON is $BASE_VER"
    elif ! new_enough "$venv_ver"; then
        recreate="it has Python $venv_ver, older than 3.10"
    fi
    if [ -z "$recreate" ] && [ -f "$STAMP" ]; then
        made_in=$(sed -n 's/^root=//p' "$STAMP")
        # a virtual environment does not survive a move: its scripts name their old path
        [ -z "$made_in" ] || [ "$made_in" = "$ROOT" ] || recreate="it was made in $made_in"
    fi
    choice=$(torch_choice)

    if [ -n "$venv_ver" ] && [ -z "$recreate" ] && [ -f "$STAMP" ]; then
        want=$(stamp_text "$venv_ver" "$choice")
        if [ "$(cat "$STAMP")" = "$want" ] && imports_ok; then
            say "environment up to date (.venv, Python $venv_ver)"
            return 0
        fi
    fi
    if [ "$mode" = check ]; then
        say "environment not up to date${recreate:+ (.venv: $recreate)}; ./edu3d.sh setup would set it up"
        exit 1
    fi

    # anything below may be interrupted: the stamp goes first and is written last
    rm -f "$STAMP"
    if [ -n "$venv_ver" ] && [ -z "$recreate" ] && ! "$VENV_PY" -m pip --version >/dev/null 2>&1; then
        recreate="it has no pip (an interrupted or failed creation)"
    fi
    if [ -z "$venv_ver" ] || [ -n "$recreate" ]; then
        [ -n "${BASE_PY:-}" ] || pick_python
        if [ -n "$recreate" ]; then
            say "making .venv again with Python $BASE_VER ($BASE_PY): $recreate"
        else
            say "creating the environment .venv with Python $BASE_VER ($BASE_PY)"
        fi
        local out
        out=$("$BASE_PY" -m venv --clear "$VENV" 2>&1) || {
            echo "$out" | tail -n 5 | sed 's/^/    /' >&2
            die "$BASE_PY -m venv could not create .venv (see above). On Debian or Ubuntu:" \
                "sudo apt install python${BASE_VER%.*}-venv"
        }
        venv_ver=$BASE_VER
    else
        say "setting up the existing environment .venv (Python $venv_ver)"
    fi
    echo "=== edu3d.sh $COMMAND, $(date)" >>"$LOG"

    say "upgrading pip in .venv"
    pip_logged install --upgrade pip || say "warning: could not upgrade pip; going on with $("$VENV_PY" -m pip --version | cut -d' ' -f1-2)"
    install_torch "$choice"
    say "installing edu3d from this clone and its dependencies (pip install -e \".[dev]\")"
    pip_logged install -e ".[dev]" || { show_log_tail; die "pip could not install edu3d (pip install -e \".[dev]\")"; }
    compile_bytecode
    imports_ok || die "torch or edu3d does not import in .venv after the set-up; see $LOG"
    stamp_text "$venv_ver" "$choice" >"$STAMP.tmp"
    mv "$STAMP.tmp" "$STAMP"
    say "ready: $("$VENV_PY" -I -c 'import sys, torch, edu3d; print("Python %d.%d.%d, torch %s, edu3d %s" % (sys.version_info[:3] + (torch.__version__, edu3d.__version__)))') in .venv"
}

# pip compiles every installed package's bytecode but not this editable checkout's; where
# PYTHONDONTWRITEBYTECODE is set nothing caches it, and each of the many processes a run
# starts (ranks, kernels, commands) would compile edu3d again
compile_bytecode() {
    say "compiling edu3d's bytecode"
    "$VENV_PY" -m compileall -q edu3d widgets tests >/dev/null
}

activate() {
    export VIRTUAL_ENV="$VENV"
    export PATH="$VENV/bin:$PATH"
    unset PYTHONHOME
}

# status 0 when pytest's arguments name paths (tests/test_x.py, tests/test_x.py::name), which
# then replace the default tests/
names_paths() {
    local arg
    for arg in "$@"; do
        case "$arg" in -*) continue ;; esac
        [ ! -e "${arg%%::*}" ] || return 0
    done
    return 1
}

# --- commands ---------------------------------------------------------------------------

COMMAND=${1:-}
[ "$#" -eq 0 ] || shift
case "$COMMAND" in
    course)
        ensure_env
        activate
        say "opening the course: .venv/bin/edu3d course ${*:-}"
        exec "$VENV/bin/edu3d" course ${1+"$@"}
        ;;
    test)
        ensure_env
        activate
        compile_bytecode
        say "running the tests (README's test command) in .venv"
        set +e
        if [ "$#" -gt 0 ] && names_paths "$@"; then
            EDU3D_SOLUTIONS=1 OMP_NUM_THREADS=1 python -m pytest -p no:cacheprovider -n 2 --dist loadfile -v --durations=15 "$@"
        else
            EDU3D_SOLUTIONS=1 OMP_NUM_THREADS=1 python -m pytest -p no:cacheprovider -n 2 --dist loadfile -v --durations=15 tests ${1+"$@"}
        fi
        status=$?
        set -e
        if [ "$status" -eq 5 ]; then
            say "error: pytest collected no tests; that is a failure"
            exit 1
        fi
        exit "$status"
        ;;
    setup)
        case "${1:-}" in
            "") ensure_env ;;
            --check) ensure_env check ;;
            *) echo "edu3d.sh: setup takes no argument but --check" >&2; usage >&2; exit 2 ;;
        esac
        ;;
    help | -h | --help)
        usage
        ;;
    *)
        [ -z "$COMMAND" ] || echo "edu3d.sh: unknown command: $COMMAND" >&2
        usage >&2
        exit 2
        ;;
esac
