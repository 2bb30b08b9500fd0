"""``python -m edu3d.production.compare``: each layout on edu3d's mechanics and on PyTorch's
own APIs (``--impl torch``), side by side.

For every layout: the same model, seed and batches through edu3d's
:class:`~edu3d.train.trainer.Trainer`, through :class:`~edu3d.production.torch_impl.TorchTrainer`
and through the serial reference step (:func:`edu3d.train.loop.train_step`):

* **gradients**, with plain SGD (Adam would hide a wrong ``1/dp`` or ``1/m``): every
  gradient of step 1 gathered by serial name (the worst relative error), the gradient norm of
  steps 1 and 2 and the loss of step 2 (which the first update produced);
* **5 AdamW steps**: the worst relative difference of the loss, torch against edu3d and
  against serial;
* **speed**: the median step time of steps 2-5 (the slowest rank's), torch over edu3d;
  step 1 builds the pipeline's buffers and the communicators. The two trainers alternate
  step by step, each step started together on every rank, so a busy machine slows both
  alike.

Layouts of one world size share one launch: inside the ranks each layout builds its own
meshes and its own fresh model. ``--json`` prints one object per layout instead of a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

from edu3d.distributed.mesh import Mesh
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.production.torch_impl import TorchTrainer
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import train_step
from edu3d.train.optim import make_optimizer
from edu3d.config.sections import from_flags
from edu3d.train.preflight import check_args, model_config
from edu3d.train.trainer import Trainer

LAYOUTS = {
    "dp2": "--dp 2",
    "dp2 ZeRO-1": "--dp 2 --zero 1",
    "dp2 ZeRO-2": "--dp 2 --zero 2",
    "dp2 ZeRO-3": "--dp 2 --zero 3",
    "tp2": "--tp 2",
    "tp2 SP": "--tp 2 --sp",
    "pp2 1F1B": "--pp 2 --schedule 1f1b --microbatches 4",
    "pp2 interleaved": "--pp 2 --schedule interleaved --vpp 2 --microbatches 4",
    "pp2 gpipe": "--pp 2 --schedule gpipe --microbatches 4",
    "dp2-tp2-pp2": "--dp 2 --tp 2 --pp 2 --microbatches 4",
    "dp4-tp2": "--dp 4 --tp 2 --zero 3",
}


# what the serial reference run depends on (not the layout)
SERIAL_KEYS = ("model", "layers", "heads", "d_model", "seq", "vocab", "tie", "seed", "lr",
               "global_batch", "warmup", "lr_schedule", "weight_decay", "clip", "optimizer",
               "steps")
_SERIAL: dict = {}


def options(argv: list[str]):
    """``edu3d train``'s options of the command line ``argv``, checked."""
    args = from_flags(argv)
    check_args(args)
    return args


def world_size(argv: list[str]) -> int:
    get = {k: int(argv[argv.index(f"--{k}") + 1]) if f"--{k}" in argv else 1
           for k in ("dp", "tp", "pp")}
    return get["dp"] * get["tp"] * get["pp"]


def _run(trainers: list, corpus, args, steps: int) -> tuple[list, list]:
    """``steps`` steps of each trainer, alternating step by step (a busy machine slows both
    alike), each started together on every rank; per trainer its records and its step
    times, the slowest rank's."""
    recs, secs = [[] for _ in trainers], [[] for _ in trainers]
    for s in range(1, steps + 1):
        x, y = corpus.batch(s, args.batch.global_batch)
        for k, trainer in enumerate(trainers):
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            recs[k].append(trainer.step(x, y, s))
            secs[k].append(time.perf_counter() - t0)
    if dist.is_initialized():
        t = torch.tensor(secs, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        secs = t.tolist()
    return recs, secs


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def parity(argv: list[str], steps: int = 5, edu3d_too: bool = True) -> dict:
    """One layout (every rank calls): torch vs serial with SGD and AdamW, and (``edu3d_too``)
    torch vs edu3d with AdamW, with step times."""
    adam = options([*argv, "--impl", "torch"])
    sgd = options([*argv, "--impl", "torch", "--optimizer", "sgd", "--lr", "0.1"])
    layout = adam.layout
    mesh = Mesh.build(layout)
    config = model_config(adam)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=adam.training.seed)

    def serial(args, n):
        key = (tuple(args.flat()[k] for k in SERIAL_KEYS), n)
        if key not in _SERIAL:  # the same for every layout: computed once per process
            model = GPT(config, seed=args.training.seed)
            opt = make_optimizer(model, args)
            _SERIAL[key] = [train_step(model, opt, *corpus.batch(s, args.batch.global_batch), s, args)
                            for s in range(1, n + 1)]
        return _SERIAL[key]

    out = {"argv": argv, "world_size": layout.world_size}
    trainer = TorchTrainer(GPT(config, seed=sgd.training.seed), mesh, sgd)
    x, y = corpus.batch(1, sgd.batch.global_batch)
    trainer.forward_backward(x, y)  # the gradients of step 1, every one, by serial name
    grads = trainer.gather("grad")
    key = ("grads", tuple(sgd.flat()[k] for k in SERIAL_KEYS))
    if key not in _SERIAL:
        model = GPT(config, seed=sgd.training.seed)
        model(x, y)[1].backward()
        _SERIAL[key] = {n: p.grad for n, p in model.named_parameters()}
    if set(grads) != set(_SERIAL[key]):
        raise RuntimeError(f"gradients named on one side only: {set(grads) ^ set(_SERIAL[key])}")
    out["grad_err"] = max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-12))
                          for n, g in _SERIAL[key].items())
    ref = serial(sgd, 2)
    ((ours,), _) = _run([trainer], corpus, sgd, 2)
    out["sgd_norm_err"] = max(_rel(a["grad_norm"], b["grad_norm"]) for a, b in zip(ours, ref))
    out["sgd_loss2_err"] = _rel(ours[1]["loss"], ref[1]["loss"])
    ref = serial(adam, steps)
    trainers = [TorchTrainer(GPT(config, seed=adam.training.seed), mesh, adam)]
    if edu3d_too:  # edu3d train's own trainer, the same options but --impl edu3d
        trainers.append(Trainer(GPT(config, seed=adam.training.seed), mesh, options(argv)))
    recs, secs = _run(trainers, corpus, adam, steps)
    torch_recs = recs[0]
    out["losses_torch"] = [r["loss"] for r in torch_recs]
    out["losses_serial"] = [r["loss"] for r in ref]
    out["adam_loss_err_serial"] = max(_rel(a["loss"], b["loss"]) for a, b in zip(torch_recs, ref))
    out["adam_norm_err_serial"] = max(_rel(a["grad_norm"], b["grad_norm"])
                                      for a, b in zip(torch_recs, ref))
    if edu3d_too:
        out["losses_edu3d"] = [r["loss"] for r in recs[1]]
        out["adam_loss_err_edu3d"] = max(_rel(a["loss"], b["loss"])
                                         for a, b in zip(torch_recs, recs[1]))
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        out["step_s_torch"], out["step_s_edu3d"] = med(secs[0][1:]), med(secs[1][1:])
        out["time_ratio"] = out["step_s_torch"] / out["step_s_edu3d"]
    mesh.release()
    return out


def parity_many(mesh, argvs: list[list[str]], steps: int = 5, edu3d_too: bool = True) -> list:
    """:func:`parity` for several layouts of one world size, in one launch."""
    return [parity(argv, steps, edu3d_too) for argv in argvs]


def measure(names: list[str], steps: int = 5, edu3d_too: bool = True,
            timeout: float = 600) -> dict[str, dict]:
    """Run the named layouts (one launch per world size); results by name."""
    by_ws: dict[int, list[str]] = {}
    for n in names:
        by_ws.setdefault(world_size(LAYOUTS[n].split()), []).append(n)
    out = {}
    for ws, group in sorted(by_ws.items()):
        run = launch(parity_many, ws, args=([LAYOUTS[n].split() for n in group], steps,
                                            edu3d_too), timeout=timeout, name="torchimpl")
        out.update(zip(group, run.results[0]))
    return out


def table(results: dict[str, dict]) -> str:
    rows = [f"{'layout':<16} {'loss edu3d':>10} {'loss torch':>10} {'worst rel':>9} "
            f"{'vs serial':>9} {'grads':>8} {'edu3d s':>8} {'torch s':>8} {'torch/edu3d':>11}"]
    for name, r in results.items():
        rows.append(f"{name:<16} {r['losses_edu3d'][-1]:>10.5f} {r['losses_torch'][-1]:>10.5f} "
                    f"{r['adam_loss_err_edu3d']:>9.1e} {r['adam_loss_err_serial']:>9.1e} "
                    f"{r['grad_err']:>8.1e} {r['step_s_edu3d']:>8.4f} "
                    f"{r['step_s_torch']:>8.4f} {r['time_ratio']:>11.2f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m edu3d.production.compare",
        description="Each layout on edu3d's mechanics and on PyTorch's own APIs: the loss "
                    "after 5 AdamW steps (worst relative difference over the steps) and the "
                    "median step time of steps 2-5 (slowest rank).")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS),
                        default=[n for n in LAYOUTS if n != "dp4-tp2"], metavar="NAME",
                        help="layouts to run (default: all of world size 2 and 4): "
                             + ", ".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=5, help="AdamW steps (default: 5)")
    parser.add_argument("--json", action="store_true", help="one JSON object per layout")
    args = parser.parse_args(argv)
    results = measure(args.layouts, args.training.steps)
    if args.launch.json:
        for name, r in results.items():
            print(json.dumps({"layout": name, **r}))
    else:
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
