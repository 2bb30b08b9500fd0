"""``edu3d train``: the command line of a training run, parsed once into typed options.

After reading this file you should understand the road from a command line to ranks:

1. argparse reads every flag, each with its range (:mod:`edu3d.commands.argtypes`) and
   ``--inject-fault``'s little language (:func:`fault_spec`);
2. the parsed namespace becomes one :class:`~edu3d.config.sections.Run` (:func:`options_from`):
   below this file nothing reads an ``argparse.Namespace``;
3. every check that needs no process runs here, once, so a bad run is refused in a second
   with what would work: :func:`edu3d.train.preflight.preflight` (the composition rules,
   the memory from the planner's estimate, the frozen names, the checkpoint folder) and
   what ``--impl torch`` cannot honour (:func:`edu3d.production.torch_check.unsupported`);
   the ranks trust what passed;
4. ``--impl`` picks the trainer class: edu3d's :class:`~edu3d.train.trainer.Trainer`, or
   :class:`~edu3d.production.torch_impl.TorchTrainer` (the same layout on PyTorch's own
   APIs); :func:`edu3d.train.loop.run` trains with it, serially or on ``dp * tp * pp`` ranks.

Exit codes: 2 bad options, 1 a rank failed, 124 timeout, 130 interrupted.

The modules that need torch (the loop, the trainers, the checkpoint format) come in through
imports inside functions: ``edu3d train --help`` and a refused run must start without
torch, as the whole ``edu3d`` command does.
"""

from __future__ import annotations

import argparse
import sys

from edu3d.commands.argtypes import (MAX_COUNT, MAX_SEED, SLOWEST_S, count, integer,
                                     non_negative_int, number, ranks, seconds)
from edu3d.commands.run import add_node_arguments
from edu3d.config.layout import LayoutError
from edu3d.launch.api import LaunchError, LaunchTimeout
from edu3d.launch.cores import RANKS_PER_CORE
from edu3d.production.torch_check import unsupported
from edu3d.config.sections import ALIASES, FLAGS, OFFLOAD_HELP, Run
from edu3d.train.axis_rules import AUX_SCOPES
from edu3d.train.preflight import (ATTENTION, BATCHING, FAULT_KINDS, GRAD_REDUCE, MIN_VOCAB,
                                   PRESET_NAMES, RECOMPUTE, SCHEDULES, Checked, preflight)

HELP = "train the reference GPT, serially or on a parallel layout"
POSITIVE = "a positive integer (1, 2, 3 ...)"
WIDE = 2**20  # the most of any width, sequence or batch (the fit check refuses sooner)
D = " (default: %(default)s)"  # argparse fills in each option's default in --help


def fault_spec(text: str) -> dict:
    """argparse type for ``--inject-fault rank=R,step=S[,kind=exit|kill|hang]`` and
    ``rank=R,kind=slow[,step=S][,seconds=X]`` (a straggler from step S on, default 1)."""
    usage = ("rank=R,step=S[,kind=exit|kill|hang] or rank=R,kind=slow[,step=S][,seconds=X] "
             "(e.g. rank=1,step=3,kind=kill)")
    spec: dict = {"kind": "exit"}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("rank", "step", "kind", "seconds"):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {usage}")
        if key == "kind":
            if value not in FAULT_KINDS:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: kind must be one of {', '.join(FAULT_KINDS)}")
            spec["kind"] = value
        elif key == "seconds":
            spec["seconds"] = number(0, False, "0.2", SLOWEST_S)(value)
        else:
            spec[key] = (integer(1, "a step >= 1") if key == "step" else non_negative_int)(value)
    if spec["kind"] == "slow":
        spec.setdefault("step", 1)
    elif "seconds" in spec:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds= is the sleep of kind=slow only")
    if "rank" not in spec or "step" not in spec:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {usage}")
    return spec


def globs(text: str) -> str:
    """argparse type for ``--freeze GLOB[,GLOB...]``: at least one glob, none empty (whether
    each matches a parameter is checked against the model, :func:`check`)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected GLOB[,GLOB...] over parameter "
                                         "names, e.g. 'tok_emb.*,blocks.0.*' (no empty glob)")
    return ",".join(parts)


# ---- the options ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every option of ``edu3d train`` to ``parser``; help texts show the defaults."""
    model = parser.add_argument_group("model (a preset; each override replaces one field)")
    model.add_argument("--model", default="tiny", choices=PRESET_NAMES,
                       help="preset" + D)
    model.add_argument("--layers", type=integer(1, POSITIVE, 1024),
                       help="override the preset's n_layers")
    model.add_argument("--heads", type=integer(1, POSITIVE, 2**14), help="override n_heads")
    model.add_argument("--d-model", type=integer(1, POSITIVE, WIDE), help="override d_model")
    model.add_argument("--seq", type=integer(1, POSITIVE, WIDE), help="override seq_len")
    model.add_argument("--vocab", type=integer(MIN_VOCAB, f"an integer >= {MIN_VOCAB} (the "
                                                          "corpus gives each token "
                                                          f"{MIN_VOCAB} successors)", 16 * WIDE),
                       help="override vocab_size (at least 4)")
    model.add_argument("--vocab-pad", type=integer(1, POSITIVE, 1 << 16), default=1, metavar="N",
                       help="pad the vocabulary's tables to a multiple of N (64: GPU-friendly "
                            "shapes); the padding logits are -inf, the loss unchanged" + D)
    model.add_argument("--tie", action="store_true", default=None,
                       help="tie lm_head to the token embedding (default: the preset's choice)")
    moe = parser.add_argument_group("mixture of experts (without --experts every MLP is dense)")
    moe.add_argument("--experts", type=integer(0, "an integer >= 0", 4096), default=0,
                     help="routed experts per mixture-of-experts layer; 0: dense" + D)
    moe.add_argument("--topk", type=integer(1, POSITIVE, 4096), default=2,
                     help="experts each token is sent to (gates renormalised over them when "
                          "k > 1, as Mixtral does)" + D)
    moe.add_argument("--moe-every", type=integer(1, POSITIVE, 1024), default=1,
                     help="block i is a mixture of experts when i %% N == 0" + D)
    moe.add_argument("--shared-experts", type=integer(0, "an integer >= 0", 4096), default=0,
                     help="always-on experts every token goes through (DeepSeek)" + D)
    moe.add_argument("--capacity-factor", type=number(0, True, "1.0", 1024), default=0.0,
                     help="each expert takes at most ceil(T*k/E*C) of a micro-batch's T "
                          "tokens, the rest are dropped; 0: dropless" + D)
    moe.add_argument("--aux-loss-coef", type=number(0, True, "1e-2", 1e3), default=None,
                     help="weight of the load-balancing loss E*sum(f_i*P_i) (default: 1e-2, "
                          "or 0 with --balance bias; give both to use both)")
    moe.add_argument("--aux-scope", choices=AUX_SCOPES, default="microbatch",
                     help="the tokens the load-balancing loss counts f_i and P_i over. "
                          "microbatch: each data rank's micro-batch (with its cp ranks), so "
                          "--dp/--ep N runs equal the serial command with N x --microbatches; "
                          "sequence: each sequence (DeepSeek-V3), the same in every layout; "
                          "global: each micro-batch over every dp and cp rank, so a layout "
                          "equals the serial command with the same --microbatches" + D)
    moe.add_argument("--z-loss-coef", type=number(0, True, "1e-3", 1e3), default=0.0,
                     help="weight of the router z-loss mean(logsumexp(logits)^2)" + D)
    moe.add_argument("--balance", choices=("aux", "bias"), default="aux",
                     help="bias: DeepSeek-V3's aux-loss-free balancing, a per-expert bias "
                          "used only to choose experts, nudged after each step (the aux loss "
                          "is then off unless --aux-loss-coef is given)" + D)
    moe.add_argument("--router-dtype", choices=("fp32", "fp64"), default="fp32",
                     help="the router's logits, softmax and z-loss are computed in this dtype, "
                          "outside autocast, whatever --precision says" + D)
    opt = parser.add_argument_group("training")
    opt.add_argument("--steps", type=count, default=60, help="training steps" + D)
    opt.add_argument("--seed", type=integer(0, "an integer >= 0", MAX_SEED), default=0,
                     help="seeds the weights and the data" + D)
    opt.add_argument("--lr", type=number(0, False, "3e-3"), default=3e-3,
                     help="peak learning rate" + D)
    opt.add_argument("--global-batch", type=integer(1, POSITIVE, WIDE), default=8,
                     help="sequences per step, whatever the layout" + D)
    opt.add_argument("--data", default="synthetic", metavar="synthetic|stdlib|text:PATH",
                     help="what to train on: the synthetic Markov corpus (known best loss; "
                          "the parity tests' data), stdlib (the Python standard library's "
                          "own sources, on every machine) or text:PATH (a UTF-8 file or a "
                          "folder of them); real text is read as bytes (vocabulary 256), "
                          "prepared once into a memory-mapped token file" + D)
    opt.add_argument("--warmup", type=integer(0, "an integer >= 0", MAX_COUNT), default=0,
                     help="steps of linear learning-rate warmup" + D)
    opt.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                     help="after warmup: constant, or cosine decay to 10%% of --lr "
                                    "at the last step" + D)
    opt.add_argument("--weight-decay", type=number(0, True, "0.1", 1e3), default=0.1,
                     help="AdamW weight decay on matrices" + D)
    opt.add_argument("--clip", type=number(0, True, "1.0", 1e9), default=1.0,
                     help="max global gradient norm; 0 disables" + D)
    opt.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                     help="sgd is plain SGD, the honest check of gradient scale" + D)
    opt.add_argument("--precision", choices=("fp32", "bf16", "fp16", "fp8"), default="fp32",
                     help="bf16: autocast, fp32 master weights; fp16: plus dynamic "
                                    "loss scaling; fp8: the blocks' matrix products in FP8 "
                                    "(emulated on a CPU), fp32 elsewhere" + D)
    opt.add_argument("--fp8-scaling", choices=("tensorwise", "rowwise"), default="tensorwise",
                     help="--precision fp8: one scale per tensor, or one per row along the "
                          "product's sum (torchao's recipes)" + D)
    opt.add_argument("--fp8-recipe", choices=("current", "delayed"), default="current",
                     help="--precision fp8: scales from each tensor as it is cast, or from "
                          "the amax history of earlier steps (tensorwise)" + D)
    opt.add_argument("--fp8-history", type=integer(1, POSITIVE, MAX_COUNT), default=16,
                     help="--fp8-recipe delayed: steps of amax history" + D)
    par = parser.add_argument_group("parallelism (ranks = dp * cp * tp * pp, launched with "
                                    "torchrun)")
    par.add_argument("--dp", type=ranks, default=1, help="data-parallel degree" + D)
    par.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage" + D)
    par.add_argument("--hsdp", type=ranks, default=1, help="HSDP replica groups: ZeRO shards "
                     "within dp*cp/HSDP ranks, all-reduces across groups (needs --zero)" + D)
    par.add_argument("--microbatches", type=integer(1, POSITIVE, WIDE), default=None,
                     help="micro-batches per step, for every layout: without --pp this is "
                          "gradient accumulation (default: 1, or pp with --pp); with --experts "
                          "each micro-batch is a group the load balance counts (--aux-scope)")
    par.add_argument("--grad-accum", type=integer(1, POSITIVE, WIDE), default=None,
                     help="the same as --microbatches")
    par.add_argument("--dp-impl", choices=("naive", "flat", "overlap", "bucketed"),
                     default="bucketed", help="how gradients are averaged" + D)
    par.add_argument("--bucket-mb", type=number(0, False, "25", 1e6), default=25.0,
                     help="bucket size in MB for --dp-impl bucketed (PyTorch DDP's)" + D)
    par.add_argument("--prefetch", action="store_true", help="ZeRO-3: gather the next layer early")
    par.add_argument("--grad-reduce", choices=GRAD_REDUCE, default="per-microbatch",
                     help="ZeRO-2/3 with micro-batches: reduce-scatter after every "
                          "micro-batch and keep only the gradient shard (DeepSpeed's and "
                          "FSDP2's default), or accumulate full gradients (ZeRO-3: keep the "
                          "parameters gathered) and reduce once per step (Megatron's); "
                          "ignored with --zero 0 or 1, which always accumulate full "
                          "gradients and reduce once per step" + D)
    par.add_argument("--offload", action="store_true",
                     help="ZeRO: keep the optimizer state (and its update) on the CPU")
    par.add_argument("--compress", choices=("fp16", "bf16", "int8", "topk"), default=None,
                     help="compress data-parallel gradients (lossy: losses drift from serial)")
    par.add_argument("--ep", type=ranks, default=1,
                     help="expert-parallel degree: the experts are shared out over groups of "
                          "ep of the dp x cp ranks (adds no ranks; alone, --ep N means --dp N "
                          "--ep N; the load balance then counts each data rank's micro-batch "
                          "unless --aux-scope global)" + D)
    par.add_argument("--cp", type=ranks, default=1,
                     help="context-parallel degree: each sequence is split over cp ranks" + D)
    par.add_argument("--cp-impl", choices=("ring", "allgather", "ulysses"), default="ring",
                     help="ring: K and V travel around the ranks; allgather: gathered once "
                          "(Llama 3); ulysses: all-to-all from sequence to heads" + D)
    par.add_argument("--cp-split", choices=("zigzag", "plain"), default="zigzag",
                     help="zigzag: rank r holds chunks r and 2cp-1-r (balanced causal work); "
                          "plain: contiguous quarters (imbalanced)" + D)
    par.add_argument("--tp", type=ranks, default=1,
                     help="tensor-parallel degree" + D)
    par.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp)")
    par.add_argument("--tp-overlap", action="store_true",
                     help="overlap the input-gradient all-reduce with weight gradients")
    par.add_argument("--pp", type=ranks, default=1, help="pipeline stages" + D)
    par.add_argument("--vpp", type=integer(1, POSITIVE, 1024), default=1,
                     help="model chunks per pipeline rank (interleaved)" + D)
    par.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                     help="pipeline schedule" + D)
    par.add_argument("--partition", choices=("uniform", "balanced"), default="uniform",
                     help="how layers are cut into pipeline stages" + D)
    par.add_argument("--recompute", choices=RECOMPUTE, default="none",
                     help="activation recomputation: full recomputes each block in backward "
                          "(keeping its input), selective only the attention core" + D)
    par.add_argument("--offload-activations", action="store_true", help=OFFLOAD_HELP[0])
    par.add_argument("--offload-every", type=count, default=1, help=OFFLOAD_HELP[1] + D)
    par.add_argument("--offload-last", action="store_true", help=OFFLOAD_HELP[2])
    par.add_argument("--freeze", type=globs, default=None, metavar="GLOB[,GLOB...]",
                     help="train without these parameters (serial names, e.g. 'tok_emb.*,"
                          "blocks.0.*'): no gradient, no optimizer state, in every layout")
    par.add_argument("--impl", choices=("edu3d", "torch"), default="edu3d",
                     help="edu3d: edu3d's own mechanics; torch: the same layout on PyTorch's "
                          "own APIs (DDP, ZeroRedundancyOptimizer, FSDP2, DTensor TP, "
                          "torch.distributed.pipelining)" + D)
    par.add_argument("--timeout", type=seconds("600"), default=600.0,
                     help="seconds before a parallel run is killed" + D)
    ck = parser.add_argument_group("checkpoints and failures")
    ck.add_argument("--ckpt-dir", default=None,
                    help="folder of sharded checkpoints (one sub-folder per saved step)")
    ck.add_argument("--save-every", type=count, default=None,
                    help="save every K steps (default with --ckpt-dir: at the last step only)")
    ck.add_argument("--keep-last", type=count, default=None, metavar="K",
                    help="keep only the newest K complete checkpoints: once a save is "
                         "committed, older step folders are removed (default: keep all)")
    ck.add_argument("--resume", action="store_true",
                    help="continue from the newest complete checkpoint in --ckpt-dir, whatever "
                         "layout wrote it")
    ck.add_argument("--resume-step", type=count, default=None, metavar="N",
                    help="continue from the checkpoint of step N rather than the newest "
                         "(implies --resume; as edu3d generate --step)")
    ck.add_argument("--async-save", action="store_true",
                    help="snapshot the state and write it in the background while training "
                         "continues (at most one save in flight)")
    ck.add_argument("--incremental", action="store_true",
                    help="content-addressed checkpoints: one file per tensor piece, named by "
                         "its sha256, shared by every save whose bytes are the same; a save "
                         "writes only the tensors that changed (frozen ones never do)")
    ck.add_argument("--max-restarts", type=integer(0, "an integer >= 0", 1000), default=0,
                    help="when a rank dies or hangs, restart every rank from the last complete "
                         "checkpoint, up to N times" + D)
    ck.add_argument("--inject-fault", type=fault_spec, default=None,
                    metavar="rank=R,step=S[,kind=exit|kill|hang|slow][,seconds=X]",
                    help="make rank R die (exit, kill) or hang at step S, once, or sleep X s "
                         "(default 0.2) before every step from S on (slow: a straggler); for "
                         "tests and the course")
    ck.add_argument("--heartbeat", type=seconds("20"), default=None,
                    help="seconds without progress after which a rank counts as hung and is "
                         "handled like a dead one (default: half the collective timeout)")
    par.add_argument("--oversubscribe", action="store_true", help=f"start more than "
                     f"{RANKS_PER_CORE} ranks per CPU core (else refused: they wait for cores)")
    docs = parser.add_argument_group("documents of different lengths (edu3d.train.batching)")
    docs.add_argument("--batching", choices=BATCHING, default="fixed",
                      help="fixed: equal sequences; pad: documents padded to the longest of "
                           "each micro-batch; bucket: sorted by length first; tokens: each "
                           "micro-batch filled to --max-tokens; pack: several documents per "
                           "sequence, kept apart by the mask" + D)
    docs.add_argument("--max-tokens", type=integer(1, POSITIVE, WIDE * 64), default=None,
                      help="--batching tokens: rows x longest document per micro-batch "
                           "(default: seq x global-batch / (dp x micro-batches))")
    docs.add_argument("--doc-mean", type=number(1, True, "8", WIDE), default=None,
                      help="mean document length, log-normal (default: a quarter of seq)")
    docs.add_argument("--doc-sigma", type=number(0, True, "0.8", 4), default=0.8,
                      help="spread of the document lengths (std of their log)" + D)
    fast = parser.add_argument_group("fast path (the same numbers, computed faster)")
    fast.add_argument("--attn", choices=ATTENTION, default="sdpa",
                      help="sdpa: F.scaled_dot_product_attention (flash kernels on a GPU); "
                           "explicit: softmax(QK^T)V with the scores as a tensor" + D)
    fast.add_argument("--compile", action="store_true",
                      help="torch.compile each block (inductor; needs a C++ compiler on CPU)")
    fast.add_argument("--no-tf32", action="store_true",
                      help="keep fp32 matmuls in full fp32 on a GPU (TF32 is on by default)")
    add_node_arguments(parser)  # edu3d run's: the same flags, one command per node
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per step and nothing else on stdout")
    parser.add_argument("--monitor", action="store_true",
                        help="a live table of every rank on stderr (step time, tokens/s, "
                             "communication share per axis, memory; the slowest rank "
                             "highlighted), refreshed twice a second; another terminal can "
                             "watch with 'edu3d top RUN'")
    parser.add_argument("--memory-timeline", default=None, metavar="FILE.json",
                        help="record the last step's memory on every rank at each of its "
                             "events (parameters, gradients, optimizer state, activations, "
                             "communication buffers) and write it, with the planner's estimate, "
                             "to FILE.json (chapter 07 draws it); needs --steps 2 or more")
    parser.add_argument("--log-every", type=count, default=1, metavar="K",
                        help="read the loss and print a record every K steps (reading it waits "
                             "for the device)" + D)
    return parser


def options_from(namespace: argparse.Namespace) -> Run:
    """The parsed command line as one :class:`~edu3d.config.sections.Run` (argparse's own
    entries, such as the subcommand's ``func``, left out). ``--ep N`` alone is ``--dp N --ep
    N`` (:func:`edu3d.train.preflight.resolve`'s rule, applied before the layout is built,
    which refuses ep > dp*cp)."""
    flags = {k: v for k, v in vars(namespace).items() if k in FLAGS or k in ALIASES}
    if flags.get("ep", 1) > 1 and flags.get("dp", 1) * flags.get("cp", 1) == 1:
        flags["dp"] = flags["ep"]
    return Run.of(**flags)


def parse(argv: list[str]) -> Run:
    """``edu3d train``'s options from a command line (``SystemExit`` 2 on a bad flag)."""
    return options_from(add_arguments(argparse.ArgumentParser(prog="edu3d train"))
                        .parse_args(argv))


def trainer_class(run: Run):
    """The trainer ``--impl`` asks for (both build from the full serial model, the same way)."""
    if run.parallel.impl == "torch":
        from edu3d.production.torch_impl import TorchTrainer

        return TorchTrainer
    from edu3d.train.trainer import Trainer

    return Trainer


# ---- the command ---------------------------------------------------------------------------
def add_subcommand(sub) -> argparse.ArgumentParser:
    """Register ``train`` on ``edu3d``'s subcommands."""
    p = sub.add_parser("train", help=HELP,
                       description="Train the reference GPT on the synthetic corpus (or real "
                                   "text, --data), serially or on a parallel layout (dp * tp * pp ranks). With --json, "
                                   "stdout holds exactly one JSON object per step.")
    add_arguments(p)
    p.set_defaults(func=lambda namespace: main_from_args(namespace, p))
    return p


def check(run: Run) -> Checked:
    """Every check made before any process starts, once (:func:`~edu3d.train.preflight.
    preflight`, then what ``--impl torch`` cannot honour); raises ``ValueError`` saying what
    would work (a foreign, corrupted or used checkpoint folder included)."""
    problem = unsupported(run) if run.parallel.impl == "torch" else None
    if problem:
        raise LayoutError(problem)
    return preflight(run)


def main_from_args(namespace: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check the options (before any process starts), then train."""
    try:
        checked = check(options_from(namespace))
    except ValueError as err:
        parser.error(str(err))
    from edu3d.train.loop import run

    try:
        run(checked, trainer_class=trainer_class(checked.run))
    except LaunchTimeout as err:
        print(f"edu3d train: --timeout {checked.run.launch.timeout:g} s: {err}", file=sys.stderr)
        return 124
    except LaunchError as err:
        print(f"edu3d train: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a serial run's save that failed (disk full): the file is named
        print(f"edu3d train: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("edu3d train: interrupted", file=sys.stderr)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="edu3d train", description="Train the reference GPT on the synthetic corpus."))
    return main_from_args(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
