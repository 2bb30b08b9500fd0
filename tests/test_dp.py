"""Data parallelism equals the serial model: every DP version at world sizes 2, 4 and 8 gives
the serial gradients after one SGD step and the serial weights after 3 AdamW steps, within
1e-5 relative (fp32; after AdamW, beyond what rounding can do there: tests/adamw_noise.py),
with and without gradient accumulation, on a model whose parameter sizes do not divide by N
(d_model=27: every unit's size is odd). One launch per world size runs every configuration;
the serial reference is computed once, in the test process, and handed to the ranks."""

import functools

import pytest
import torch

from edu3d.train.data import SyntheticCorpus
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.commands.train import parse
from edu3d.train.loop import train_step
from edu3d.train.optim import make_optimizer
from edu3d.config.sections import Run
from edu3d.train.preflight import model_config
from edu3d.train.trainer import Trainer
from tests.adamw_noise import beyond, beyond_records, serial_and_control, without_key_bias

TOL = 1e-5
ADAM_STEPS = 3  # AdamW's state carried through two updates after the first; more repeat them
MODEL = ["--layers", "2", "--heads", "3", "--d-model", "27", "--seq", "16", "--vocab", "101",
         "--global-batch", "16"]


def make_args(optimizer: str, **extra) -> Run:
    # AdamW divides each gradient by its own root-mean-square, so elements with tiny gradients
    # turn fp32 rounding into large updates (tests/adamw_noise.py allows for it, entry by
    # entry); lr 1e-3 with 10 warmup steps keeps those first updates small, so what it
    # allows stays small
    lr = ["--lr", "0.1"] if optimizer == "sgd" else ["--lr", "1e-3", "--warmup", "10"]
    args = parse(
        MODEL + ["--optimizer", optimizer] + lr)
    return args.replace(**{**dict(dp=1, zero=0, grad_accum=1, dp_impl="bucketed",
                                  bucket_mb=0.01), **extra})


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def param_error(got: dict, ref: dict, allowed: dict | None = None) -> float:
    """The worst relative error over the tensors of ``ref``; with ``allowed`` (after AdamW),
    of what is left beyond each entry's allowed move (:mod:`tests.adamw_noise`)."""
    if allowed is None:
        return max(_rel(without_key_bias(n, got[n]), without_key_bias(n, t))
                   for n, t in ref.items())
    return max(beyond(without_key_bias(n, got[n]), without_key_bias(n, t),
                      without_key_bias(n, allowed[n])) for n, t in ref.items())


@functools.lru_cache(maxsize=None)
def serial_reference():
    """Gradients and weights after 1 SGD step, weights after ADAM_STEPS AdamW steps (serial),
    with what rounding can do to the latter (:mod:`tests.adamw_noise`). The same for every
    world size and configuration: computed once per test process."""
    args = make_args("sgd")
    config = model_config(args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
    model = GPT(config, seed=args.training.seed)
    x, y = corpus.batch(1, args.batch.global_batch)
    loss = train_step(model, make_optimizer(model, args), x, y, 1, args)["loss"]
    out = {"sgd": {"grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                   "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                   "losses": [loss]}}
    args = make_args("adamw")

    def build():
        model = GPT(config, seed=args.training.seed)
        return model, make_optimizer(model, args)

    def train(model, optimizer):
        return [train_step(model, optimizer, *corpus.batch(step, args.batch.global_batch), step, args)
                for step in range(1, ADAM_STEPS + 1)]

    adamw = serial_and_control(build, train, TOL)
    out["adamw"] = {"params": adamw["final"], "allowed": adamw["allowed"],
                    "records": adamw["records"], "control": adamw["control"], "tol": TOL}
    return out


def parity_worker(mesh, configs: list[dict], ref: dict):
    """Run every config (keyword overrides of the trainer's args) with SGD and AdamW; return
    {config name: {"sgd_grad", "sgd_param", "adamw_param", "loss"}: max relative errors}
    against ``ref``, :func:`serial_reference`'s result."""
    from edu3d.distributed import meter
    from edu3d.distributed import trace
    from edu3d.model.gpt import num_params

    summary = {}
    for cfg in configs:
        cfg = dict(cfg)
        name = cfg.pop("name")
        errs = {}
        for opt, steps in (("sgd", 1), ("adamw", ADAM_STEPS)):
            args = make_args(opt, dp=mesh.size("dp"), **cfg)
            config = model_config(args)
            model = GPT(config, seed=args.training.seed)
            corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=args.training.seed)
            psi = num_params(model)
            trainer = Trainer(model, mesh, args)
            with trace.current().context(case=f"{name}/{opt}"):
                records = [trainer.step(*corpus.batch(step, args.batch.global_batch), step)
                           for step in range(1, steps + 1)]
            params = full_state(trainer, "params")
            if opt == "sgd":
                errs["sgd_param"] = param_error(params, ref[opt]["params"])
                grads = full_state(trainer, "grads")
                errs["sgd_grad"] = param_error(grads, ref[opt]["grads"])
                errs["sgd_loss"] = abs(records[0]["loss"] - ref[opt]["losses"][0]) / abs(
                    ref[opt]["losses"][0])
            else:
                errs["adamw_param"] = param_error(params, ref[opt]["params"],
                                                  ref[opt]["allowed"])
                errs["adamw_loss"] = beyond_records(records, ref[opt], errs["sgd_grad"],
                                                    ("loss",))
                errs["memory"] = meter.measure(trainer.tensors())
                errs["psi"] = psi
        summary[name] = errs
    return summary


def full_state(trainer, what: str) -> dict:
    """Full (unsharded) parameters or gradients by name, whatever the trainer shards."""
    return trainer.gather("grad" if what == "grads" else "param")


DP_CONFIGS = [{"name": f"{impl}/k{k}", "dp_impl": impl, "grad_accum": k}
              for impl in ("naive", "flat", "overlap", "bucketed") for k in (1, 2)]


# 8 first: the 4- and 2-rank launches then run on its idle warm pool (edu3d.launch.warm.pool: a larger
# idle pool runs a smaller job) instead of starting pools of their own
@pytest.mark.parametrize("world", [pytest.param(8, marks=pytest.mark.slow), 4, 2])
def test_every_dp_version_equals_serial(world):
    # at 8 ranks only with accumulation (2 and 4 cover K = 1), to keep CI short
    configs = [c for c in DP_CONFIGS if world < 8 or c["grad_accum"] > 1]
    result = launch(parity_worker, world, args=(configs, serial_reference()), timeout=240,
                    echo=False)
    summary = result.results[0]
    assert all(r == summary for r in result.results)  # every rank agrees
    report_and_check(world, summary)


def errors(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k not in ("memory", "psi")}


def report_and_check(world: int, summary: dict) -> None:
    print(f"world {world}: " + ", ".join(
        f"{k}: {max(errors(v).values()):.1e}" for k, v in summary.items()))
    bad = {k: errors(v) for k, v in summary.items() if max(errors(v).values()) > TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"


def test_buckets_follow_reverse_registration_order():
    from edu3d.parallel.dp.data_parallel import make_buckets

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 200, 300, 400)]
    rev = make_buckets(params, bucket_mb=500 * 4 / 2**20)
    assert [[p.numel() for p in b.params] for b in rev] == [[400, 300], [200, 100]]
    fwd = make_buckets(params, bucket_mb=500 * 4 / 2**20, reverse=False)
    assert [[p.numel() for p in b.params] for b in fwd] == [[100, 200, 300], [400]]
    first = make_buckets(params, bucket_mb=500 * 4 / 2**20, first_bucket_mb=300 * 4 / 2**20)
    assert [[p.numel() for p in b.params] for b in first] == [[400], [300, 200], [100]]
    with pytest.raises(ValueError, match="bucket_mb"):
        make_buckets(params, 0)


def test_overlap_helpers_read_run_shaped_events():
    from edu3d.course.ch02_data_parallel import traffic_per_step
    from edu3d.widgets.overlap import compression_figure, launched_during_backward, overlap_figure

    events = [{"rank": 0, "lane": "compute", "op": "B", "t0": 10.0, "t1": 50.0, "step": 1,
               "case": "c"},
              {"rank": 0, "lane": "comm", "op": "all_reduce", "t0": 30.0, "t1": 60.0,
               "step": 1, "case": "c", "bytes": 400, "n": 2}]
    assert traffic_per_step(events, "c", 1) == 800  # all-reduce counts 2S
    assert launched_during_backward([(0, 3), (1, 10)], 10) == 1
    fig = overlap_figure(events, "c", 1)
    assert {t.name for t in fig.data} >= {"B", "all_reduce"}
    errs = {"none": {"losses": [2.0, 1.0], "param_rel_diff": 0.0},
            "fp16": {"losses": [2.0, 1.1], "param_rel_diff": 1e-3}}
    assert len(compression_figure(errs).data) == 2
