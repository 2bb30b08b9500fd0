"""Where a check's verdict goes under ``edu3d grade``: a channel the submission cannot print to.

After reading this file you should understand why a graded notebook's ``PASS`` lines prove
nothing, what the grader counts instead, and where that stops:

* the learner's code runs in the kernel that runs the checks, so whatever the kernel prints
  (stdout, stderr, displays) is the submission's to write: a module can print ``PASS`` lines,
  or wrap ``sys.stdout`` to turn every ``FAIL`` into one. ``edu3d grade`` does not count them;
* before the first cell (an IPython startup file: before the submission is imported),
  :func:`seal` connects to a Unix socket the grader listens on (its path in
  ``EDU3D_GRADE_CHANNEL``, dropped from the environment once read; the grader accepts one
  connection, from a process it started, and removes the socket's file). The grader sends a
  key made for this run and the source of the notebook's cells. From then on every
  :func:`edu3d.course.grading.check` sends one record, ``{"n", "title", "passed", "hint"}``,
  with the HMAC-SHA256 of it under that key; the grader drops a line whose MAC or number is
  wrong (:mod:`edu3d.course.autograde.channel`);
* a submission that patches the checker from its own module is caught where the record is
  made. A record says ``passed`` only when it was made by :func:`edu3d.course.grading.check`
  as sealed (the same code object), called from the code of the notebook's own cells (a frame
  compiled from one of the cells the grader sent, running in the notebook's namespace), on a
  test written in those cells; with every name of ``edu3d.course.grading`` as it was at the
  seal (a replaced ``check``, ``_reason`` or ``load`` shows), ``EDU3D_SOLUTIONS`` and
  ``EDU3D_SUBMISSION`` as the grader set them, and in the kernel's own process (a fork holds
  the key too, and sends nothing). Otherwise the record is a failure that says what was
  tampered with. A ``check`` replaced outright sends nothing, and a check without a record
  fails;
* the limit, plainly: the submission runs in this process, with the grader's rights, and
  Python hides nothing from code in its own process. A learner who reads this file can find
  the key and the socket (``gc``, frames), forge a frame, or make what the checks compare
  against lie (a value whose ``__eq__`` is always true, a patched ``torch.allclose``). The
  seal stops the tampering that needs no knowledge of the grader; it does not make the kernel
  a sandbox. README ("Security") says what ``--isolate`` adds around it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import sys
from types import FunctionType

from IPython import get_ipython

from edu3d.course import grading

ADDRESS = "EDU3D_GRADE_CHANNEL"  # the grader's socket, read once by the startup file
PINNED = ("EDU3D_SOLUTIONS", "EDU3D_SUBMISSION")  # which code is graded: fixed at the seal
HINT_MAX = 2000  # characters of a hint one record carries
HELLO_MAX = 16 << 20  # bytes of the grader's hello (the key and the cells' sources)


def sign(key: bytes, body: dict) -> str:
    """A record's MAC: HMAC-SHA256 of its canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def encode(key: bytes, body: dict) -> bytes:
    """One line of the channel: the record and its MAC."""
    return (json.dumps({**body, "mac": sign(key, body)}) + "\n").encode()


def decode(key: bytes, line: bytes) -> dict | None:
    """The record one line carries, or None when this key did not sign it."""
    try:
        data = json.loads(line)
        mac = data.pop("mac")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(mac, str) or not hmac.compare_digest(mac, sign(key, data)):
        return None
    return data


def _parts(value) -> tuple:
    """What must not change in one name of the checker: the object, and a function's code."""
    if isinstance(value, FunctionType):
        return (value, value.__code__, value.__defaults__, value.__kwdefaults__)
    return (value,)


def _changed(sealed: dict, module) -> str | None:
    now = vars(module)
    for name, parts in sealed.items():
        if name not in now or now[name] is not parts[0]:
            return f"edu3d.course.grading.{name} was replaced"
        if any(a is not b for a, b in zip(_parts(now[name]), parts)):
            return f"edu3d.course.grading.{name} was changed"
    return None


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1 << 16)
        if not chunk or len(data) > HELLO_MAX:
            raise ConnectionError("the grader's channel closed before its hello")
        data += chunk
    return data


def seal(address: str | None = None) -> bool:
    """Connect the checker to the grader's channel (``address``, else ``EDU3D_GRADE_CHANNEL``)
    and seal it; False when there is no grader (a notebook run by hand, nbval)."""
    address = address or os.environ.get(ADDRESS)
    os.environ.pop(ADDRESS, None)  # ranks and subprocesses never see it
    if not address:
        return False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    hello = json.loads(_read_line(sock))
    shell = get_ipython()
    # the file names IPython compiles each of the notebook's cells under (a hash of the source)
    cells = frozenset(shell.compile.get_code_name(src, src, 0) for src in hello["cells"])
    _install(sock.sendall, bytes.fromhex(hello["key"]), cells, shell.user_ns)
    return True


def _install(send, key: bytes, cells: frozenset, user_ns: dict) -> None:
    """Make ``grading.reporter`` the function :func:`edu3d.course.grading.check` sends its
    verdicts through, then take the seal: the checker's names as they are now."""
    pid, check_code = os.getpid(), grading.check.__code__
    pinned = {k: os.environ.get(k) for k in PINNED}
    count, sealed = [0], {}

    def from_cells(code, namespace) -> bool:
        return code is not None and namespace is user_ns and code.co_filename in cells

    def tampered(maker, caller, test) -> str | None:
        if maker.f_code is not check_code:
            return "the record was not made by edu3d.course.grading.check"
        if not from_cells(caller.f_code, caller.f_globals):
            return (f"check was called from {os.path.basename(caller.f_code.co_filename)}:"
                    f"{caller.f_lineno}, not from the notebook's cells")
        if not (isinstance(test, FunctionType) and from_cells(test.__code__, test.__globals__)):
            return "the test it ran is not one of the notebook's"
        changed = _changed(sealed, grading)
        if changed:
            return changed
        moved = [k for k, v in pinned.items() if os.environ.get(k) != v]
        return f"{moved[0]} was changed after the grader set it" if moved else None

    def report(title: str, passed: bool, hint: str | None, test) -> None:
        if os.getpid() != pid:
            return  # a fork of the kernel: it holds the key, but speaks for nobody
        why = tampered(sys._getframe(1), sys._getframe(2), test)
        if why:
            passed, hint = False, f"the grader found its checker tampered with ({why}): " \
                                  "this check cannot pass"
        count[0] += 1
        send(encode(key, {"n": count[0], "title": str(title), "passed": passed is True,
                          "hint": None if hint is None else str(hint)[:HINT_MAX]}))

    grading.reporter = report
    sealed.update({name: _parts(value) for name, value in vars(grading).items()})
