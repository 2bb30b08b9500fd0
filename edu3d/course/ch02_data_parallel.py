"""Chapters 02 and 03 and their exercises: data parallelism and ZeRO, run live.

After reading this file you should know how the chapters' runs are made: every version is
``edu3d train``'s own :class:`~edu3d.train.trainer.Trainer` with a few options changed
(:func:`compare_versions`), each traced as its own ``case``; the graders run the learner's
code next to the serial model's gradient and answer with booleans.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.distributed import trace
from edu3d.course import lesson_args  # chapter 02 reads dp.lesson_args() too
from edu3d.train.data import shard_rows
from edu3d.parallel.dp.compress import HOOKS


def compare_versions(mesh, versions: dict[str, dict], steps: int = 3, **common) -> dict:
    """Train the same model with each version (trainer options by name) for ``steps`` steps,
    traced as ``case=name``; rank 0 also trains the serial reference.

    Returns ``{"serial": losses, name: {"losses", "step_s", "launch_log", "psi", "memory"
    (measured bytes per category after the last step), "units" (ZeRO: name, numel, padded
    size of each flat unit)}}``.
    """
    import statistics
    import time

    from edu3d.distributed import meter
    from edu3d.train.data import SyntheticCorpus
    from edu3d.model.gpt import GPT, num_params
    from edu3d.train.loop import train_step
    from edu3d.train.optim import make_optimizer
    from edu3d.train.options import config_from_args
    from edu3d.train.trainer import Trainer

    out = {}
    base = lesson_args(**common)
    config = config_from_args(base)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=base.seed)
    if dist.get_rank() == 0:
        model = GPT(config, seed=base.seed)
        opt = make_optimizer(model, base)
        out["serial"] = [train_step(model, opt, *corpus.batch(s, base.global_batch), s,
                                    base)["loss"] for s in range(1, steps + 1)]
    for name, options in versions.items():
        args = lesson_args(**{**common, **options})
        model = GPT(config, seed=args.seed)
        trainer = Trainer(model, mesh, args)
        losses, times = [], []
        with trace.current().context(case=name):
            for s in range(1, steps + 1):
                t0 = time.perf_counter()
                losses.append(trainer.step(*corpus.batch(s, args.global_batch), s)["loss"])
                times.append(time.perf_counter() - t0)
        log = getattr(trainer.par.dp, "launch_log", [])
        out[name] = {"losses": losses, "step_s": statistics.median(times),
                     "launch_log": list(log), "psi": num_params(model),
                     "memory": meter.measure(trainer.tensors())}
        if trainer.par.zero is not None:
            out[name]["units"] = [(u.name, u.numel, u.padded) for u in trainer.par.zero.units]
    return out


# ---- grading exercise 02 -------------------------------------------------------------------------
def grade_ddp_exercise(mesh, bucket_mb: float = 0.02) -> dict:
    """Run the learner's ``sync_gradients`` and ``BucketedDDP`` (exercises/bucketed_ddp.py)
    against the serial gradient of the global batch; every verdict is a bool (an unfinished
    or broken part is False, never an exception, so all ranks stay in step)."""
    from edu3d.course import grading
    from edu3d.train.data import SyntheticCorpus
    from edu3d.model.gpt import GPT, config_from

    mod = grading.load("bucketed_ddp")
    config = config_from("tiny", layers=2)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
    x, y = corpus.batch(1, 8)
    serial = GPT(config, seed=0)
    serial(x, y)[1].backward()
    want = [p.grad for p in serial.parameters()]
    n, index = mesh.size("dp"), mesh.index("dp")
    xs, ys = shard_rows(x, index, n), shard_rows(y, index, n)

    def matches(model):
        return all(torch.allclose(p.grad, g, rtol=1e-5, atol=1e-7)
                   for p, g in zip(model.parameters(), want))

    out = {}
    model = GPT(config, seed=0)
    model(xs, ys)[1].backward()
    try:
        mod.sync_gradients(model, mesh.dp)
        out["sync_gradients"] = matches(model)
    except NotImplementedError:
        out["sync_gradients"] = False
    model = GPT(config, seed=0)
    try:
        ddp = mod.BucketedDDP(model, mesh.dp, bucket_mb)
        model(xs, ys)[1].backward()
        ddp.finish()
        total = len(list(model.parameters()))
        out["bucketed"] = matches(model)
        out["overlap"] = bool(ddp.launched_at) and ddp.launched_at[0] < total
    except NotImplementedError:
        out["bucketed"] = out["overlap"] = False
    return out


def compression_error(mesh, hooks=("none",) + HOOKS, steps: int = 10, **common) -> dict:
    """Train with each hook (traced as ``case=name``) and compare with uncompressed training:
    ``{name: {"losses", "max_loss_rel_diff", "param_rel_diff"}}`` (differences against
    ``"none"``, which must come first)."""
    from edu3d.distributed import trace
    from edu3d.train.data import SyntheticCorpus
    from edu3d.model.gpt import GPT
    from edu3d.train.options import config_from_args
    from edu3d.train.trainer import Trainer

    out, ref_params = {}, None
    for name in hooks:
        args = lesson_args(**{**common, "compress": name})
        config = config_from_args(args)
        corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.seed)
        model = GPT(config, seed=args.seed)
        trainer = Trainer(model, mesh, args)
        with trace.current().context(case=name):
            losses = [trainer.step(*corpus.batch(s, args.global_batch), s)["loss"]
                      for s in range(1, steps + 1)]
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if ref_params is None:
            ref_params, ref_losses = flat, losses
        out[name] = {"losses": losses,
                     "max_loss_rel_diff": max(abs(a - b) / abs(b)
                                              for a, b in zip(losses, ref_losses)),
                     "param_rel_diff": float((flat - ref_params).norm() / ref_params.norm())}
    return out


# ---- grading exercise 03 -------------------------------------------------------------------------
def grade_zero1_exercise(mesh, lr: float = 0.1) -> bool:
    """Run the learner's ``zero1_sgd_step`` (exercises/zero1.py) on this rank's rows of a
    global batch, traced as ``case=exercise``; True when the parameters equal one serial SGD
    step on the whole batch (False, never an exception, when the code is unfinished)."""
    from edu3d.course import grading
    from edu3d.train.data import SyntheticCorpus
    from edu3d.model.gpt import GPT, config_from

    mod = grading.load("zero1")
    config = config_from("tiny", layers=1, d_model=35, heads=5, vocab=100)  # 23,345 = 3k + 2
    x, y = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0).batch(1, 6)
    serial = GPT(config, seed=0)
    serial(x, y)[1].backward()
    with torch.no_grad():
        want = [p - lr * p.grad for p in serial.parameters()]
    model = GPT(config, seed=0)
    n, index = mesh.size("dp"), mesh.index("dp")
    model(shard_rows(x, index, n), shard_rows(y, index, n))[1].backward()
    try:
        with trace.current().context(case="exercise"):
            mod.zero1_sgd_step(list(model.parameters()), lr, mesh.dp)
    except NotImplementedError:
        return False
    return all(torch.allclose(p, w, rtol=1e-5, atol=1e-7)
               for p, w in zip(model.parameters(), want))
