"""edu3d: 3D-parallel LLM training you can see.

The package is deliberately light to import: nothing here imports torch, so the
launcher (``edu3d run``) and the rank wrapper start as fast as a bare ``torchrun``.
Import the modules you need (``from edu3d import mesh, runtime, comm``).

In a notebook, ``%load_ext edu3d`` registers the ``%%torchrun`` cell magic.
"""

__version__ = "0.1.0"


def load_ipython_extension(ipython):
    """Entry point of ``%load_ext edu3d``: registers ``%%torchrun``."""
    from edu3d.magic import register

    register(ipython)
