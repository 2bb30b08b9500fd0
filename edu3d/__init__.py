"""edu3d: 3D-parallel LLM training you can see.

The package is deliberately light to import: nothing here imports torch, so the
launcher (``edu3d run``) and the rank wrapper start as fast as a bare ``torchrun``.
Import the modules you need (``from edu3d.distributed import mesh, runtime, comm``); learners' files
write ``from edu3d import comm``, which this package hands the traced collectives for.

In a notebook, ``%load_ext edu3d`` registers the ``%%torchrun`` cell magic.

The imports inside functions below are what keeps ``import edu3d`` (and so the ``edu3d``
command and every rank's start-up) torch-free: ``comm`` and the magic are imported only when
first asked for.
"""

import importlib

__version__ = "0.1.0"


def __getattr__(name):
    """``from edu3d import comm`` (the path learners' exercise files use) gives
    :mod:`edu3d.distributed.comm`, imported on first use so that ``import edu3d`` stays torch-free."""
    if name == "comm":
        return importlib.import_module("edu3d.distributed.comm")
    raise AttributeError(f"module 'edu3d' has no attribute {name!r}")


def load_ipython_extension(ipython):
    """Entry point of ``%load_ext edu3d``: registers ``%%torchrun``."""
    from edu3d.launch.magic import register

    register(ipython)
