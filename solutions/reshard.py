"""Exercise 08, solved: read one parameter's full tensor from the shards of another layout.

Both steps are index arithmetic on the placements: a box is one slice per dimension, and
``flat`` picks a run of the box's elements in row-major order. (The library's own version
is :mod:`edu3d.ckpt.reshard`: ``place_all``, ``assemble`` and ``read``.)
"""

import torch


def _box(placement: dict) -> tuple:
    return tuple(slice(a, b) for a, b in placement["box"])


def full_tensor(pieces: list) -> torch.Tensor:
    """The full tensor from the saved ``(placement, data)`` pieces of one tensor; raises
    ``ValueError`` when they leave an element uncovered (a missing shard)."""
    shape = pieces[0][0]["shape"]
    full = torch.zeros(shape, dtype=pieces[0][1].dtype)
    seen = torch.zeros(shape, dtype=torch.bool)
    for placement, data in pieces:
        lo, hi = placement["flat"]
        for target, values in ((full, data), (seen, torch.ones(hi - lo, dtype=torch.bool))):
            block = target[_box(placement)]
            flat = block.reshape(-1).clone()  # a box of a larger tensor is not contiguous
            flat[lo:hi] = values.reshape(-1)
            block.copy_(flat.view(block.shape))
    if not seen.all():
        missing = int((~seen).sum())
        raise ValueError(f"{pieces[0][0]['name']}: {missing} of {seen.numel()} elements are "
                         "in no saved piece (a shard is missing)")
    return full


def piece_for(full: torch.Tensor, placement: dict) -> torch.Tensor:
    """The 1-D data a rank of the new layout loads for ``placement``."""
    lo, hi = placement["flat"]
    return full[_box(placement)].reshape(-1)[lo:hi].clone()


# The deeper hints of exercises/reshard.py (edu3d.course.grading.tiers): per function,
# a nudge (a check's second failure), then the answer's shape (its third).
HINTS = {'full_tensor': ("a box is one slice per dimension; flat = [lo, hi] picks a run of the box's "
                 'elements in row-major order, which may start mid-row; keep a mask of what '
                 'was written',
                 'block = full[tuple(slice(a, b) for a, b in box)]; flat = '
                 'block.reshape(-1).clone(); flat[lo:hi] = data; '
                 'block.copy_(flat.view(block.shape)); the same for a bool mask; raise '
                 'ValueError unless mask.all()'),
 'piece_for': ('the box of the full tensor, flattened row-major, then the run lo .. hi-1',
               'full[tuple(slice(a, b) for a, b in '
               "placement['box'])].reshape(-1)[lo:hi].clone()")}
