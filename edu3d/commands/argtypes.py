"""argparse types shared by the ``edu3d`` subcommands: each says its valid range.

After reading this file you should understand how a bad number on the command line becomes
one line that says what was expected (``--lr: nan: must be a finite number > 0 (e.g.
3e-3)``) instead of a traceback: argparse calls the type on the text and reports an
:class:`argparse.ArgumentTypeError` with the option's name. No torch here: ``edu3d run``
builds its parser with these and must start as fast as a bare torchrun.
"""

from __future__ import annotations

import argparse
import math


def integer(minimum: int, what: str):
    """An argparse type for integers ``>= minimum``; ``what`` is said when one is not."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: must be {what}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be {what}")
        return value

    parse.__name__ = what
    return parse


def number(minimum: float, inclusive: bool, example: str):
    """An argparse type for finite numbers above ``minimum`` (or equal, ``inclusive``)."""
    bound = f"{'>=' if inclusive else '>'} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(
                f"{text}: must be a finite number {bound} (e.g. {example})")
        return value

    parse.__name__ = f"number {bound}"
    return parse


positive_int = integer(1, "a positive integer (1, 2, 3 ...)")
positive_int.__doc__ = "argparse type for counts (ranks, steps, micro-batches ...)."
non_negative_int = integer(0, "an integer >= 0")
