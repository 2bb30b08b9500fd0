"""Gradient buckets: which parameters' gradients travel together, and the flat buffer they share.

After reading this file you should understand how bucketed data parallelism (torch DDP's
``Reducer``) turns hundreds of small all-reduces into a few large ones that still start
while backward is running:

* backward produces gradients from the last layer to the first, so buckets are filled in
  *reverse* registration order: the first bucket is complete after the first few gradients,
  and its all-reduce overlaps the rest of backward. In forward order the first bucket would
  wait for the embedding's gradient, which arrives last: no overlap at all;
* the first bucket is capped (``first_bucket_mb``, torch DDP uses 1 MB) so that
  communication starts early; the others hold about ``bucket_mb`` each (DDP: 25 MB);
* a flat buffer has one dtype, so each dtype (and device) fills buckets of its own; the
  buckets are then ordered by their first parameter, as torch DDP orders them;
* each parameter's gradient lives in its bucket's buffer (``p.grad`` is a view of it), so
  autograd writes gradients straight into the message and nothing is copied before sending.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    """Parameters whose gradients travel together, and the flat buffer they live in
    (``None`` for ``overlap``'s one-parameter units, which all-reduce ``p.grad`` itself)."""

    params: list
    buffer: torch.Tensor | None
    ready: int = 0
    handle: object = None
    index: int = 0
    offsets: list = field(default_factory=list)


def make_buckets(params: list, bucket_mb: float, reverse: bool = True,
                 first_bucket_mb: float | None = None) -> list[Bucket]:
    """Group ``params`` into buckets of at least ``bucket_mb`` MB (the last may be smaller),
    by the rules of the module docstring: ``reverse`` order, the first bucket capped at
    ``first_bucket_mb``, one dtype (and device) per bucket."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb={bucket_mb} must be positive (e.g. 25, PyTorch's default)")
    order = list(reversed(params)) if reverse else list(params)
    limit = bucket_mb * 2**20
    first = min(first_bucket_mb, bucket_mb) * 2**20 if first_bucket_mb else limit
    groups, filling, closed = [], {}, set()  # filling: kind -> [params, bytes]
    for p in order:
        kind = (p.dtype, p.device)
        current = filling.setdefault(kind, [[], 0])
        current[0].append(p)
        current[1] += p.numel() * p.element_size()
        if current[1] >= (limit if kind in closed else first):
            groups.append(filling.pop(kind)[0])
            closed.add(kind)
    groups += [ps for ps, _ in filling.values()]
    position = {id(p): i for i, p in enumerate(order)}
    groups.sort(key=lambda ps: position[id(ps[0])])
    buckets = []
    for i, ps in enumerate(groups):
        buf = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
        offsets, off = [], 0
        for p in ps:
            offsets.append(off)
            off += p.numel()
        buckets.append(Bucket(ps, buf, index=i, offsets=offsets))
    return buckets
