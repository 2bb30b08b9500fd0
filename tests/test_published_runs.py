"""The published-runs table and the hardware profiles load, carry their citations, and refuse
bad rows and bad profiles with one-line messages naming what is wrong. Torch-free and fast."""

import copy
import json

import pytest

from edu3d.plan.hardware import (CONSTANTS, HARDWARE_DIR, PRECISIONS, ProfileError,
                                 load_profile, profile_from_dict, profiles)
from edu3d.plan.published import RUNS_FILE, RunError, load_runs, run_from_dict


@pytest.fixture(scope="module")
def raw_rows():
    return json.loads(RUNS_FILE.read_text())


@pytest.fixture(scope="module")
def raw_profile():
    return json.loads((HARDWARE_DIR / "h100-sxm.json").read_text())


def test_the_table_loads_with_enough_rows_and_frameworks():
    runs = load_runs()
    assert len(runs) >= 25
    assert len({r.framework for r in runs}) >= 4
    assert len({r.id for r in runs}) == len(runs)
    for run in runs:
        assert run.source.strip() and run.url.startswith("https://"), run.id
        assert run.layout.dp * run.layout.tp * run.layout.pp * run.layout.cp == run.gpus
        if run.micro_batch is not None:
            assert run.microbatches * run.micro_batch * run.layout.dp == run.global_batch


def test_every_row_names_a_shipped_profile_and_every_profile_loads():
    names = profiles()
    assert {"h100-sxm", "h200", "a100-80gb"} <= set(names)
    loaded = {name: load_profile(name) for name in names}
    assert {run.hardware for run in load_runs()} <= set(loaded)
    for profile in loaded.values():
        assert profile.peak_flops["bf16"] > 0
        required = {f"peak_flops.{p}" for p in PRECISIONS} | {k for k, _, _ in CONSTANTS}
        assert required <= set(profile.sources), required - set(profile.sources)
        assert all(len(s) > 10 for s in profile.sources.values())


def test_the_numbers_the_issue_quotes_are_in_the_table():
    """Spot-check of transcription: issue 35 cites these measurements."""
    by_id = {r.id: r for r in load_runs()}
    assert by_id["nanotron-llama-1b-1node-dp1-tp8-pp1-mbs1-zero0"].measured.tokens_per_s_per_gpu == 6907
    assert by_id["nanotron-llama-1b-1node-dp1-tp8-pp1-mbs16-zero0"].measured.tokens_per_s_per_gpu == 28101
    eight = by_id["torchtitan-llama3.1-8b-fsdp-8gpu-eager"].measured
    assert (eight.tokens_per_s_per_gpu, eight.memory_gib) == (5762, 82.4)
    assert by_id["torchtitan-llama3.1-8b-fsdp-128gpu-eager"].measured.tokens_per_s_per_gpu == 5605


def test_inter_node_bandwidth_falls_by_the_profile_falloff_per_doubling():
    h100 = load_profile("h100-sxm")
    assert h100.inter_bandwidth_at(2) == h100.inter_bandwidth
    assert h100.inter_bandwidth_at(8) == pytest.approx(h100.inter_bandwidth * (1 - h100.inter_falloff) ** 2)
    with pytest.raises(ValueError, match="at least 2 nodes"):
        h100.inter_bandwidth_at(1)


def mutate(row, path, value):
    row = copy.deepcopy(row)
    *parents, last = path.split(".")
    node = row
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return row


DELETE = object()
BAD_ROWS = [
    ("hardware", "tpu-v9", "unknown hardware profile 'tpu-v9'; choose one of"),
    ("gpus", 16, "layout dp x tp x pp x cp = 8 but gpus = 16"),
    ("global_batch", 24, "global_batch 24 / dp 8 is not a whole number of micro-batches of 2"),
    ("global_batch", 12, "global_batch 12 is not a multiple of dp = 8"),
    ("precision", "int4", "precision 'int4' is not one of bf16, fp16, fp8"),
    ("recompute", "some", "recompute 'some' is not one of none, selective, full, op (or null)"),
    ("notes", DELETE, "missing field(s) notes"),
    ("url", "github.com/x", "must be an https:// link"),
    ("model.n_kv_heads", 3, "model.n_heads 32 must divide d_model 4096 and be a multiple of n_kv_heads 3"),
    ("model.mlp", "relu", "model.mlp 'relu' is not one of swiglu, gelu"),
    ("layout.zero", 4, "layout.zero = 4 must be a whole number in [0, 3]"),
    ("layout.schedule", "1f1b", "layout.schedule '1f1b' given but pp = 1"),
    ("layout.vpp", DELETE, "layout lacks vpp"),
    ("measured.tokens_per_s_per_gpu", None, "measured needs one of tokens_per_s_per_gpu"),
    ("measured.mfu", 41.0, "measured.mfu = 41.0 must be null or a number in [0.001, 1]"),
    ("measured.memory_gib", None, "measured.memory_kind is given without memory_gib"),
]


@pytest.mark.parametrize("path,value,message", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_a_bad_row_is_refused_naming_the_row_and_field(raw_rows, path, value, message):
    good = raw_rows[0]
    assert good["id"] == "torchtitan-llama3.1-8b-fsdp-8gpu-eager"
    known = set(profiles())
    run_from_dict(good, known)
    with pytest.raises(RunError) as err:
        run_from_dict(mutate(good, path, value), known)
    assert str(err.value).startswith(f"run {good['id']}: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_duplicate_id_is_refused(raw_rows, tmp_path):
    path = tmp_path / "runs.json"
    path.write_text(json.dumps([raw_rows[0], raw_rows[0]]))
    with pytest.raises(RunError, match="id appears twice"):
        load_runs(path)


BAD_PROFILES = [
    ("mem_bandwidth", DELETE, "missing constant mem_bandwidth"),
    ("mem_bandwidth.value", 3.35, "mem_bandwidth = 3.35 is outside [1e+09, 1e+14]; check the unit"),
    ("matmul_efficiency.value", 1.7, "matmul_efficiency = 1.7 is outside [0.05, 1]"),
    ("link.inter.falloff", DELETE, "missing constant link.inter.falloff"),
    ("link.intra.alpha.source", "", "link.intra.alpha has no source"),
    ("peak_flops.bf16.value", None, "peak_flops.bf16 is null"),
    ("gpus_per_node.value", "eight", "gpus_per_node = 'eight' is not a finite number"),
]


@pytest.mark.parametrize("path,value,message", BAD_PROFILES, ids=[b[0] for b in BAD_PROFILES])
def test_a_bad_profile_is_refused_naming_the_file_and_key(raw_profile, tmp_path, path, value, message):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(mutate(raw_profile, path, value)))
    with pytest.raises(ProfileError) as err:
        load_profile(bad)
    assert str(err.value).startswith(f"{bad}: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_an_unknown_profile_name_lists_the_shipped_ones():
    with pytest.raises(ProfileError, match="unknown hardware profile 'h900'; choose one of a100-40gb"):
        load_profile("h900")
    with pytest.raises(ProfileError, match="a profile is a JSON object"):
        profile_from_dict([], "inline")
