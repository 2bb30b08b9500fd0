"""argparse types shared by the ``edu3d`` subcommands: each says its valid range.

After reading this file you should understand how a bad number on the command line becomes
one line that says what was expected (``--lr: nan: must be a finite number > 0 (e.g.
3e-3)``) instead of a traceback, a hang or a silent "no limit": argparse calls the type on
the text and reports an :class:`argparse.ArgumentTypeError` with the option's name, before
any work starts. Every number has a floor and, where a huge value would make a command run
for hours or overflow a timer, a ceiling (``--timeout: 1e300: must be a finite number > 0
and <= 604800 (e.g. 600)``). No torch here: ``edu3d run`` builds its parser with these and
must start as fast as a bare torchrun.
"""

from __future__ import annotations

import argparse
import math

WEEK = 7 * 24 * 3600  # the longest timeout any edu3d command accepts, in seconds
MAX_RANKS = 1024  # ranks one node may start (edu3d run -n, edu3d bench -n)
MAX_COUNT = 10**9  # steps, repetitions, checkpoints kept ...: beyond any real run
MAX_SEED = 2**32 - 1  # what every seeded generator (torch, the data) accepts
MAX_NEW_TOKENS = 100_000  # edu3d generate: a course model's continuation, in seconds
SLOWEST_S = 3600.0  # --inject-fault kind=slow's longest sleep per step (a hang is kind=hang)


def integer(minimum: int, what: str, maximum: int | None = None):
    """An argparse type for integers ``>= minimum`` (and ``<= maximum``); ``what`` is said
    when one is not (a value over the ceiling also hears the ceiling, unless ``what`` says it)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also a number of more than 4300 digits
            raise argparse.ArgumentTypeError(f"{text[:40]!r}: must be {what}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be {what}")
        if maximum is not None and value > maximum:
            ceiling = "" if str(maximum) in what else f", at most {maximum}"
            raise argparse.ArgumentTypeError(f"{text[:40]}: must be {what}{ceiling}")
        return value

    parse.__name__ = what
    return parse


def between(minimum: int, maximum: int, unit: str = ""):
    """An argparse type for integers from ``minimum`` to ``maximum`` (both said)."""
    return integer(minimum, f"an integer from {minimum} to {maximum}{unit}", maximum)


def number(minimum: float, inclusive: bool, example: str, maximum: float | None = None):
    """An argparse type for finite numbers above ``minimum`` (or equal, ``inclusive``) and at
    most ``maximum``: nan, inf, and anything out of range is refused with the range."""
    bound = f"{'>=' if inclusive else '>'} {minimum:g}"
    if maximum is not None:
        bound += f" and <= {maximum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if (not math.isfinite(value) or value < minimum or (value == minimum and not inclusive)
                or (maximum is not None and value > maximum)):
            raise argparse.ArgumentTypeError(
                f"{text[:40]}: must be a finite number {bound} (e.g. {example})")
        return value

    parse.__name__ = f"number {bound}"
    return parse


def checked(check, what: str):
    """An argparse type from ``check(text)``, which returns the value or raises a one-line
    ``ValueError`` saying what was expected (a rule that lives beside what it guards)."""
    def parse(text: str):
        try:
            return check(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = what
    return parse


def seconds(example: str):
    """An argparse type for a timeout: more than 0 seconds, at most a week (never nan, never
    "no limit" by accident)."""
    return number(0, False, example, WEEK)


positive_int = integer(1, "a positive integer (1, 2, 3 ...)")
positive_int.__doc__ = "argparse type for counts (ranks, steps, micro-batches ...)."
non_negative_int = integer(0, "an integer >= 0")
count = integer(1, "a positive integer (1, 2, 3 ...)", MAX_COUNT)
count.__doc__ = "argparse type for counts with a ceiling (steps, repetitions ...)."
ranks = integer(1, "a positive integer (1, 2, 3 ...)", MAX_RANKS)
ranks.__doc__ = "argparse type for the ranks one node starts."
step_number = integer(0, "a step number >= 0", MAX_COUNT)
step_number.__doc__ = "argparse type for a checkpoint's step (edu3d generate/ckpt --step)."
