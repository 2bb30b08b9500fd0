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
