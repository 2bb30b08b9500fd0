"""`edu3d train` with a parallel layout prints the serial run's losses (same seed, same global
batch), because every layout is the serial computation cut into pieces."""

import io
import json
import re
import subprocess
import sys

import pytest

from edu3d.commands.train import parse
from edu3d.train.loop import run

STEPS = ["--steps", "3", "--json", "--global-batch", "8"]


def _losses(*argv):
    args = parse([*STEPS, *argv])
    return [(r["loss"], r["grad_norm"]) for r in run(args, out=io.StringIO())]


# The 8-rank test first: the 2- and 4-rank launches after it then run on its idle warm pool
# (edu3d.launch.warm.pool: a larger idle pool runs a smaller job) instead of starting pools of their own.
def test_3d_records_carry_memory_and_communication_per_axis():
    """``edu3d train`` on dp2-tp2-pp2 ZeRO-1: every record has the fullest rank's bytes by
    category (parameters, gradients and optimizer state of a quarter of the model, the
    optimizer state also halved by ZeRO-1) and rank 0's time in each axis's collectives (what
    --json prints); the table ends with a summary."""
    from edu3d.model.gpt import GPT, PRESETS

    args = parse(
        ["--steps", "3", "--global-batch", "8", "--dp", "2", "--tp", "2", "--pp", "2",
         "--zero", "1"])
    out = io.StringIO()
    records = run(args, out=out)
    psi = sum(q.numel() for q in GPT(PRESETS["tiny"]).parameters())
    for r in records:
        mem = r["mem_bytes"]
        assert mem["total"] == sum(mem[k] for k in ("params", "grads", "optimizer",
                                                    "activations"))
        assert mem["activations"] > 0
        assert 0.9 < mem["params"] / (4 * psi / 4) < 1.3  # the biggest of the 4 model pieces
        assert 0.9 < mem["optimizer"] / mem["params"] < 1.1  # 8 bytes / dp 2 = 4 bytes
        assert {"tp", "pp", "dp"} <= set(r["comm_s"]) and all(s > 0 for s in r["comm_s"].values())
    text = out.getvalue()
    assert "throughput:" in text and "memory of the fullest rank" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("communication on rank 0"))
    shares = [int(x) for x in re.findall(r"(\d+)%", line)]
    assert shares and all(0 <= x <= 100 for x in shares), line  # covered, never summed


@pytest.fixture(scope="module")
def serial():
    return _losses()


LAYOUTS = [
    ["--dp", "2", "--dp-impl", "naive"],
    ["--dp", "4", "--dp-impl", "bucketed", "--grad-accum", "2"],
    ["--dp", "2", "--zero", "1"],
    ["--dp", "2", "--zero", "2"],
    ["--dp", "2", "--zero", "3"],
    ["--tp", "2"],
    ["--tp", "2", "--sp", "--dp", "2"],
    ["--pp", "2", "--schedule", "1f1b", "--microbatches", "4"],
    ["--pp", "2", "--vpp", "2", "--schedule", "interleaved", "--microbatches", "4"],
    ["--pp", "2", "--dp", "2", "--schedule", "zb-h1", "--microbatches", "2"],
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[" ".join(a) for a in LAYOUTS])
def test_layout_losses_equal_serial(serial, layout):
    got = _losses(*layout)
    for (loss, norm), (ref_loss, ref_norm) in zip(got, serial):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-5)


def test_cli_stdout_is_rank0_records_only():
    p = subprocess.run([sys.executable, "-m", "edu3d.cli", "train", *STEPS, "--dp", "2"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert [json.loads(line)["step"] for line in p.stdout.splitlines()] == [1, 2, 3]


# Every axis composes (tp with pp, zero with tp and pp, micro-batches with any layout); what
# is left cannot work whatever the trainer does. tests/test_options.py checks each rule.
@pytest.mark.parametrize("argv,message", [
    (["--tp", "3"], "tp=3 does not divide n_heads=4; choose 1, 2, 4"),
    (["--pp", "8"], "choose pp*vpp <= 4"),
    (["--dp", "3"], "multiple of 3"),
    (["--sp"], "add --tp 2"),
    (["--zero", "2"], "add --dp 2"),
    (["--pp", "2", "--vpp", "2"], "needs --schedule interleaved"),
    (["--pp", "2", "--vpp", "2", "--schedule", "interleaved", "--microbatches", "3",
      "--global-batch", "6"],
     "must be a multiple of --pp 2"),
    (["--dp", "2", "--zero", "1", "--prefetch"], "add --zero 3"),
    (["--tp", "2", "--pp", "2", "--offload"], "add --zero 1"),
    (["--dp", "2", "--zero", "1", "--compress", "int8"], "without --zero"),
    (["--tp-overlap"], "add --tp 2"),
    (["--grad-accum", "2", "--microbatches", "4"], "are the same option"),
    (["--dp", "2", "--zero", "2", "--grad-reduce", "per-batch"], "invalid choice: 'per-batch'"),
    (["--dp", "2", "--pp", "2", "--zero", "2", "--impl", "torch"], "add --grad-reduce per-step"),
    (["--dp", "4", "--hsdp", "2"], "--hsdp 2 shards ZeRO's state within replica groups"),
    (["--dp", "4", "--zero", "3", "--hsdp", "3"], "--hsdp 3 must divide dp=4"),
    (["--dp", "4", "--zero", "1", "--hsdp", "2", "--impl", "torch"], "--hsdp with --zero 1"),
])
def test_bad_layouts_fail_before_any_process(argv, message, capsys, monkeypatch):
    """Through ``edu3d.cli.main`` in this process (a new interpreter per case would only add
    its start-up; the command as typed is the next test): exit code 2, the rule in one
    line, nothing launched."""
    from edu3d import cli
    from edu3d.launch import api as launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("launched"))
    try:
        code = cli.main(["train", *argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "launching" not in err and "Traceback" not in err, err


def test_a_bad_layout_typed_as_a_command_fails_before_any_process():
    p = subprocess.run([sys.executable, "-m", "edu3d.cli", "train", "--tp", "3"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "tp=3 does not divide n_heads=4" in p.stderr, p.stderr
    assert "launching" not in p.stderr and "Traceback" not in p.stderr


def test_offload_and_compression_options_reach_the_ranks():
    offload = _losses("--dp", "2", "--zero", "2", "--offload")
    assert offload[0][0] == pytest.approx(_losses()[0][0], rel=1e-5)
    compressed = _losses("--dp", "2", "--compress", "bf16")
    assert compressed[0][0] == pytest.approx(offload[0][0], rel=1e-5)  # step 1 loss: before any update
    assert compressed[-1][0] == pytest.approx(offload[-1][0], rel=1e-2)  # then close, not equal
