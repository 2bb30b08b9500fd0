"""Exercise 05, solutions: the 1F1B schedule, the 1/m loss scale and the gradient check."""

from __future__ import annotations


def one_f_one_b(pp: int, m: int) -> list[list[str]]:
    out = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        ops = [f"{r}F{i}" for i in range(warmup)]
        for i in range(m - warmup):
            ops += [f"{r}F{warmup + i}", f"{r}B{i}"]
        ops += [f"{r}B{i}" for i in range(m - warmup, m)]
        out.append(ops)
    return out


def microbatch_loss(loss, m: int):
    # mean over the batch = (1/m) * sum of micro-batch means, so each back-propagates loss/m
    return loss / m


def gradient_scale(pipeline_grads: dict, serial_grads: dict) -> float:
    def norm(grads):
        return float(sum(g.double().norm() ** 2 for g in grads.values()) ** 0.5)

    return norm(pipeline_grads) / norm(serial_grads)


# ---- design: beat 1F1B's bubble at 1F1B's memory ----------------------------------------------
def faster_schedule(pp: int, m: int) -> list[list[str]]:
    """1F1B with every backward split (ZB-H1, Qi et al. 2023): ``I`` at once, since the
    previous stage waits for it, ``W`` postponed. Rank ``r`` lets ``r`` weight gradients wait:
    its warm-up is ``r`` forwards shorter than rank 0's, so it stays within ``pp``
    micro-batches in flight, and the postponed ``W`` fill the cool-down's idle time."""
    out = []
    for r in range(pp):
        ops, done = [], {"F": 0, "I": 0, "W": 0}

        def run(kind):
            ops.append(f"{r}{kind}{done[kind]}")
            done[kind] += 1

        for _ in range(min(pp - r - 1, m)):
            run("F")
        while done["F"] < m:
            run("F")
            run("I")
            if done["I"] - done["W"] > r:
                run("W")
        while done["I"] < m:
            run("I")
            if done["I"] - done["W"] > r:
                run("W")
        while done["W"] < m:
            run("W")
        out.append(ops)
    return out


# The deeper hints of exercises/pp_schedule.py (edu3d.course.grading.tiers): per function,
# a nudge (a check's second failure), then the answer's shape (its third).
HINTS = {'one_f_one_b': ('rank r warms up with min(pp - r - 1, m) forwards, then alternates one '
                 'forward and one backward, then runs the remaining backwards; micro-batches '
                 'in order',
                 "w = min(pp - r - 1, m); forwards 0..w-1; for i in range(m - w): f'{r}F{w + "
                 "i}', f'{r}B{i}'; then backwards m - w .. m - 1"),
 'microbatch_loss': ('the m gradients are added up: each micro-batch must carry 1/m of the '
                     "batch's mean",
                     'return loss / m'),
 'gradient_scale': ('the global norm is the square root of the sum over tensors of their '
                    'squared norms',
                    'norm(g) = sqrt(sum(t.double().norm() ** 2 for t in g.values())); return '
                    'float(norm(pipeline) / norm(serial))'),
 'faster_schedule': ('split each B into I (the gradient the previous stage waits for) and W '
                     '(nobody waits for it); run I at once and let a few W wait; a later rank '
                     'has a shorter warm-up, so it can afford more waiting W',
                     "1F1B's phases with I for B; rank r keeps at most r W pending (run the "
                     "oldest W right after an I once more than r wait); after the last I, "
                     "the remaining W")}
