"""ZBV and DualPipeV through ``edu3d train``'s option check: what composes passes, what cannot
work is refused before any process starts, in one line naming the flag and the fix
(:mod:`edu3d.train.pipeline_rules`). Pure Python, no ranks."""

from __future__ import annotations

import pytest

from edu3d.commands.train import parse
from edu3d.config.layout import LayoutError
from edu3d.production.torch_check import unsupported
from edu3d.train.preflight import check_args

COMPOSE = [
    "--pp 2 --schedule zbv --microbatches 2",
    "--pp 2 --schedule dualpipev --microbatches 4 --tie",
    "--pp 2 --dp 2 --zero 1 --schedule zbv --microbatches 4",
    "--pp 2 --dp 2 --zero 2 --schedule dualpipev --microbatches 4 --grad-reduce per-step",
    "--pp 2 --tp 2 --sp --schedule dualpipev --microbatches 4",
    "--pp 4 --layers 8 --schedule zbv --microbatches 8",
]


@pytest.mark.parametrize("argv", COMPOSE)
def test_v_schedules_compose(argv):
    args = parse(argv.split())
    _, layout = check_args(args)
    assert layout.pp == args.layout.pp and args.parallel.schedule in ("zbv", "dualpipev")


def test_impl_torch_takes_the_v_schedules():
    """PyTorch has both (ScheduleZBVZeroBubble, ScheduleDualPipeV): --impl torch runs them."""
    for name in ("zbv", "dualpipev"):
        assert unsupported(parse(["--pp", "2", "--schedule", name, "--microbatches", "4"])) is None


@pytest.mark.parametrize("argv,message", [
    ("--pp 2 --schedule zbv --layers 3",
     "--schedule zbv puts 2 stages on each of --pp 2 ranks: 4 stages, but the model has 3 "
     "layers; use --layers 4 (or more) or --pp 1 (or fewer)"),
    ("--pp 4 --schedule dualpipev --microbatches 8 --layers 6", "use --layers 8 (or more)"),
    ("--pp 2 --schedule dualpipev --microbatches 2",
     "--schedule dualpipev needs a micro-batch per stage of its V: --microbatches 4 (2 * --pp) "
     "or more, got 2"),
    ("--pp 2 --dp 2 --zero 3 --schedule zbv --microbatches 4",
     "--zero 3 with --schedule zbv: ZeRO-3 frees a stage's weights"),
    ("--pp 2 --dp 2 --zero 3 --schedule dualpipev --microbatches 4", "use --zero 1 or 2"),
    ("--pp 2 --dp 2 --zero 3 --schedule zb-h1 --microbatches 4", "--zero 3 with --schedule zb-h1"),
    ("--pp 2 --vpp 2 --schedule zbv", "--vpp 2 needs --schedule interleaved"),
])
def test_what_cannot_run_is_refused_before_launch(argv, message):
    with pytest.raises(LayoutError) as err:
        check_args(parse(argv.split()))
    assert message in str(err.value) and "\n" not in str(err.value)
