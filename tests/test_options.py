"""edu3d train's options and the checks made before any process starts (no process started,
no model built)."""

import argparse
import subprocess
import sys

import pytest

from edu3d.config.layout import Layout, LayoutError
from edu3d.commands.argtypes import positive_int
from edu3d.commands.train import add_arguments, options_from
from edu3d.model.shapes import num_params_from_config
from edu3d.config.sections import Run, from_flags
from edu3d.train.preflight import MIN_VOCAB, PRESET_NAMES, check_args, check_fit, memory_per_rank, oversubscribed

GB = 10**9


def _parse(*argv):
    return options_from(add_arguments(argparse.ArgumentParser(prog="edu3d train"))
                        .parse_args(list(argv)))


def _check(*argv):
    return check_args(_parse(*argv))


def _parse_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        _parse(*argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_options_import_no_torch():
    code = "import sys, edu3d.train.preflight; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_constants_agree_with_the_model_and_the_corpus():
    from edu3d.train.data import SUCCESSORS
    from edu3d.model.gpt import PRESETS

    assert PRESET_NAMES == tuple(PRESETS)
    assert MIN_VOCAB == SUCCESSORS


@pytest.mark.parametrize("text", ["0", "-3", "two", "1.5"])
def test_positive_int_says_what_a_count_is(text):
    with pytest.raises(argparse.ArgumentTypeError, match="must be a positive integer"):
        positive_int(text)
    assert positive_int("3") == 3


@pytest.mark.parametrize("argv,message", [
    (["--lr", "nan"], "argument --lr: nan: must be a finite number > 0 (e.g. 3e-3)"),
    (["--lr", "inf"], "--lr: inf: must be a finite number > 0"),
    (["--lr", "-1"], "--lr: -1: must be a finite number > 0"),
    (["--lr", "0"], "--lr: 0: must be a finite number > 0"),
    (["--lr", "fast"], "--lr: fast: must be a finite number > 0"),
    (["--weight-decay", "nan"], "--weight-decay: nan: must be a finite number >= 0"),
    (["--weight-decay", "-0.1"], "--weight-decay: -0.1: must be a finite number >= 0"),
    (["--clip", "-1"], "--clip: -1: must be a finite number >= 0"),
    (["--clip", "inf"], "--clip: inf: must be a finite number >= 0"),
    (["--bucket-mb", "0"], "--bucket-mb: 0: must be a finite number > 0"),
    (["--bucket-mb", "-1"], "--bucket-mb: -1: must be a finite number > 0"),
    (["--timeout", "0"], "--timeout: 0: must be a finite number > 0"),
    (["--timeout", "nan"], "--timeout: nan: must be a finite number > 0"),
    (["--vocab", "1"], f"--vocab: 1: must be an integer >= {MIN_VOCAB}"),
    (["--vocab", "3"], f"--vocab: 3: must be an integer >= {MIN_VOCAB}"),
    (["--seed", "-1"], "--seed: -1: must be an integer >= 0"),
    (["--warmup", "-5"], "--warmup: -5: must be an integer >= 0"),
    (["--steps", "0"], "--steps: 0: must be a positive integer"),
    (["--dp", "0"], "--dp: 0: must be a positive integer"),
    (["--microbatches", "0"], "--microbatches: 0: must be a positive integer"),
    (["--global-batch", "-8"], "--global-batch: -8: must be a positive integer"),
    (["--precision", "fp4"], "invalid choice: 'fp4'"),  # fp8 is a choice (edu3d.parallel.fp8)
    (["--lr-schedule", "linear"], "invalid choice: 'linear'"),
])
def test_every_number_is_checked_with_its_range(capsys, argv, message):
    assert message in _parse_error(capsys, *argv)


def test_valid_edge_values_pass():
    args = _parse("--clip", "0", "--weight-decay", "0", "--seed", "0", "--warmup", "0",
                  "--vocab", str(MIN_VOCAB), "--lr", "1e-6", "--bucket-mb", "0.5")
    assert (args.training.clip, args.training.weight_decay, args.model.vocab, args.parallel.bucket_mb) == (0, 0, MIN_VOCAB, 0.5)


def test_defaults():
    args = _parse()
    assert (args.training.lr_schedule, args.precision.dtype, args.training.warmup, args.parallel.schedule) == \
        ("constant", "fp32", 0, "1f1b")


@pytest.mark.parametrize("argv,expected", [
    ([], 1),
    (["--pp", "2"], 2),
    (["--pp", "2", "--microbatches", "4"], 4),
    (["--grad-accum", "4"], 4),
    (["--microbatches", "4", "--grad-accum", "4"], 4),
    (["--tp", "2", "--grad-accum", "2"], 2),
])
def test_microbatches_for_every_layout(argv, expected):
    args = _parse(*argv)
    check_args(args)
    assert args.microbatches == expected


COMPOSE = [
    ["--tp", "2", "--pp", "2"],
    ["--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1"],
    ["--dp", "2", "--zero", "2", "--pp", "2", "--schedule", "gpipe"],
    ["--dp", "2", "--zero", "3", "--tp", "2"],
    ["--dp", "2", "--zero", "3", "--tie", "--prefetch", "--offload"],
    ["--tp", "2", "--sp", "--pp", "2", "--vpp", "2", "--schedule", "interleaved",
     "--microbatches", "4"],
    ["--tp", "2", "--tp-overlap", "--microbatches", "2"],
    ["--dp", "2", "--compress", "int8", "--pp", "2"],
    ["--pp", "2", "--tie", "--partition", "balanced"],
    ["--tp", "2", "--pp", "3", "--layers", "5", "--microbatches", "4"],
    ["--precision", "bf16", "--lr-schedule", "cosine", "--warmup", "10"],
    ["--precision", "fp16", "--dp", "2", "--tp", "2", "--pp", "2"],
    ["--dp", "4", "--zero", "3", "--hsdp", "2", "--tp", "2", "--pp", "2"],
    ["--dp", "4", "--zero", "1", "--hsdp", "2", "--experts", "4", "--ep", "2"],
]


@pytest.mark.parametrize("argv", COMPOSE, ids=[" ".join(a) for a in COMPOSE])
def test_every_axis_composes(argv):
    config, layout = _check(*argv)
    assert layout.world_size == layout.dp * layout.tp * layout.pp


@pytest.mark.parametrize("argv", COMPOSE, ids=[" ".join(a) for a in COMPOSE])
def test_a_command_line_written_as_data_reads_as_the_parser_reads_it(argv):
    assert from_flags(argv) == _parse(*argv)


def test_an_unknown_option_is_refused_with_the_valid_names():
    with pytest.raises(TypeError, match="unknown option.*microbatch.*options are .*microbatches"):
        Run.of(microbatch=4)
    with pytest.raises(ValueError, match="--microbatch.*not an edu3d train option"):
        from_flags(["--microbatch", "4"])


@pytest.mark.parametrize("argv,message", [
    (["--sp"], "--sp splits the sequence across the tensor-parallel group; add --tp 2"),
    (["--tp", "2", "--sp", "--seq", "33"], "sequence parallelism splits seq_len=33 over tp=2"),
    (["--tp", "3"], "tp=3 does not divide n_heads=4; choose 1, 2, 4"),
    (["--tp-overlap"], "--tp-overlap overlaps tensor-parallel communication; add --tp 2"),
    (["--pp", "2", "--vpp", "2"], "--vpp 2 needs --schedule interleaved"),
    (["--vpp", "2", "--schedule", "interleaved"], "vpp=2 needs pipeline parallelism"),
    (["--pp", "2", "--schedule", "interleaved", "--microbatches", "3", "--global-batch", "6"],
     "--microbatches 3 must be a multiple of --pp 2"),
    (["--pp", "8"], "choose pp*vpp <= 4"),
    (["--dp", "3"], "use a global batch that is a multiple of 3"),
    (["--dp", "2", "--microbatches", "3"], "multiple of 6"),
    (["--zero", "1"], "--zero 1 shards over the data-parallel group; add --dp 2"),
    (["--offload"], "--offload moves ZeRO's sharded optimizer state; add --zero 1"),
    (["--dp", "2", "--zero", "1", "--prefetch"], "--prefetch gathers ZeRO-3's parameters "
                                                  "early; add --zero 3"),
    (["--compress", "fp16"], "use it with --dp 2 (or more) and without --zero"),
    (["--dp", "2", "--zero", "1", "--compress", "fp16"], "without --zero"),
    (["--grad-accum", "2", "--microbatches", "4"], "--grad-accum 2 and --microbatches 4 are "
                                                   "the same option"),
    (["--heads", "5"], "n_heads=5 does not divide d_model=64"),
    (["--dp", "4", "--hsdp", "2"], "--hsdp 2 shards ZeRO's state within replica groups; plain "
                                   "data parallelism (--zero 0)"),
    (["--dp", "4", "--zero", "3", "--hsdp", "3"], "--hsdp 3 must divide dp=4 (replica groups "
                                                  "of dp/hsdp shard ranks); choose --hsdp in "
                                                  "1, 2, 4"),
    (["--dp", "2", "--zero", "3", "--hsdp", "2", "--experts", "4", "--ep", "2"],
     "--hsdp 2 must divide the 1 ranks holding the same experts"),
])
def test_what_cannot_work_is_refused_with_what_would(argv, message):
    with pytest.raises(ValueError) as err:
        _check(*argv)
    assert message in str(err.value)


# ---- memory -----------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("tie", [False, True])
def test_num_params_from_config_counts_the_model(preset, tie):
    from edu3d.model.gpt import GPT, config_from, num_params

    config = config_from(preset, tie=tie)
    assert num_params_from_config(config) == num_params(GPT(config))


def test_gpt2_small_has_124m_parameters():
    config, _ = _check("--model", "gpt2-small")
    assert num_params_from_config(config) == 124_439_808  # GPT-2 small, tied, no lm_head bias


def test_zero_stages_shard_what_the_paper_says():
    """The fit check is the planner's estimate at the step's peak. At rest (after the step)
    ZeRO shards what the paper says, up to padding and AdamW's 4-byte step counter per shard
    piece; at the peak ZeRO-2/3 also hold one unit's full gradient (ZeRO-3: its gathered
    weights) before its reduce-scatter, so the peak is never below the rest."""
    from edu3d.plan.estimate import estimate, spec_of

    def per_rank(*argv):
        args = _parse("--model", "medium", "--dp", "4", *argv)
        check_args(args)
        rest = estimate(spec_of(args), args, at="rest")
        peak = memory_per_rank(args)
        assert all(peak[c] >= rest[f"{c}_bytes"] for c in ("params", "grads", "optimizer"))
        return {c: rest[f"{c}_bytes"] for c in ("params", "grads", "optimizer")}

    z0, z1, z2, z3 = (per_rank("--zero", str(z)) for z in range(4))
    assert z1["optimizer"] == pytest.approx(z0["optimizer"] / 4, rel=1e-5)
    assert (z1["grads"], z1["params"]) == (z0["grads"], z0["params"])
    assert z2["grads"] == pytest.approx(z0["grads"] / 4, rel=1e-5) and z2["params"] == z0["params"]
    assert z3["params"] == pytest.approx(z0["params"] / 4, rel=1e-5)
    fp32_adamw = z0["params"] + z0["grads"] + z0["optimizer"]
    assert fp32_adamw == pytest.approx(16 * num_params_from_config(check_args(
        _parse("--model", "medium"))[0]), rel=1e-6)  # 4 + 4 + 8 bytes per parameter
    tp_pp = per_rank("--tp", "2", "--pp", "2", "--global-batch", "8")
    # a quarter, plus the LayerNorms and row biases TP keeps whole, on the fullest stage
    assert tp_pp["params"] == pytest.approx(z0["params"] / 4, rel=0.02)


def test_1f1b_holds_fewer_activations_than_gpipe():
    def act(schedule):
        args = _parse("--pp", "2", "--microbatches", "8", "--schedule", schedule)
        check_args(args)
        return memory_per_rank(args)["activations"]

    assert act("gpipe") > act("1f1b")


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_the_presets_fit_a_24gb_machine(preset):
    args = _parse("--model", preset)
    check_args(args)
    check_fit(args, available=20 * GB)


def test_a_78b_model_is_refused_with_the_numbers():
    args = _parse("--model", "gpt2-small", "--layers", "96", "--d-model", "8192",
                  "--heads", "64")
    with pytest.raises(LayoutError) as err:
        check_args(args)
        check_fit(args, available=24 * GB)
    msg = str(err.value)
    assert "this run cannot fit: 77.74 B parameters" in msg
    assert "but this machine has 24.0 GB available" in msg
    assert "optimizer 621.9 GB" in msg and "\n" not in msg


def test_many_ranks_of_a_fitting_model_are_refused_together():
    args = _parse("--model", "medium", "--dp", "8")
    check_args(args)
    per_rank = sum(memory_per_rank(args).values())
    check_fit(args, available=8 * per_rank + 1)
    with pytest.raises(LayoutError, match=r"x 8 rank\(s\).*or --zero 3"):
        check_fit(args, available=8 * per_rank - 1)


def test_oversubscription_warns_in_one_line():
    warning = oversubscribed(Layout(dp=64), cores=2)
    assert warning.startswith("warning: 64 ranks on 2 CPU core(s)") and "\n" not in warning
    assert oversubscribed(Layout(dp=8), cores=2) is None


def test_the_preflight_hands_the_launcher_every_node_option():
    """The pre-flight reads the launch section's fields by name, one by one (no getattr over
    the launcher's list): the keywords it hands node_args must be the launcher's list."""
    from edu3d.launch.api import NODE_OPTIONS
    from edu3d.train.preflight import node_options

    run = Run.of(nnodes=2, node_rank=1, master_port=29400)
    assert sorted(node_options(run)) == sorted(NODE_OPTIONS)
    assert {k: v for k, v in node_options(run).items() if v is not None} == {
        "nnodes": 2, "node_rank": 1, "master_port": 29400}
