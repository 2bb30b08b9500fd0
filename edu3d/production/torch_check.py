"""Which ``edu3d train`` options ``--impl torch`` can honour (torch-free: checked before any
process starts)."""

from __future__ import annotations

import argparse


def unsupported(args: argparse.Namespace) -> str | None:
    """Why ``args`` cannot run on PyTorch's own APIs (the flag named), or None."""
    return None
