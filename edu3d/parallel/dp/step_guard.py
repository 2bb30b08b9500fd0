"""The step guard: no optimizer steps gradients that a wrapper has not finished averaging.

After reading this file you should understand how a forgotten ``finish()`` (or an optimizer a
wrapper cannot see) becomes an error at ``optimizer.step()`` instead of a silently wrong step:

* torch calls every hook registered with
  ``torch.optim.optimizer.register_optimizer_step_pre_hook`` before *any* optimizer's
  ``step()``. edu3d registers one, once, the first time a wrapper is built;
* every :class:`~edu3d.parallel.dp.data_parallel.DataParallel` and
  :class:`~edu3d.parallel.zero.sharding.Zero` registers itself (weakly: a wrapper nobody
  holds goes away) with :func:`watch`, and before each step the hook asks each of them
  ``check_step(optimizer)``; a wrapper raises, with a message that says what to call,
  when the optimizer is about to step parameters whose gradients it has not finished
  (a last backward inside ``no_sync``, a parameter that got no gradient) or that it
  shards (``opt = SGD(model.parameters())`` after ``Zero``: FSDP2's habit);
* a wrapper with nothing pending answers at once, so the guard costs one Python call per
  wrapper and step.
"""

from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

WATCHED: weakref.WeakSet = weakref.WeakSet()
HOOK: list = []  # the one registered hook's handle, once registered


def watch(wrapper) -> None:
    """Ask ``wrapper.check_step(optimizer)`` before every optimizer step from now on."""
    if not HOOK:
        HOOK.append(register_optimizer_step_pre_hook(before_step))
    WATCHED.add(wrapper)


def before_step(optimizer, args, kwargs) -> None:
    for wrapper in list(WATCHED):
        wrapper.check_step(optimizer)


def stepped_by(optimizer, params) -> list:
    """The parameters of ``optimizer`` that are in ``params`` (a set or dict), in its order."""
    return [p for g in optimizer.param_groups for p in g["params"] if p in params]
