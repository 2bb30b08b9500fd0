"""``edu3d bench overhead`` runs both sides on the same model and data (the ratio itself is
a measurement, never a test: it depends on how busy the machine is)."""

import pytest

from edu3d.bench import bench_overhead
from edu3d.commands.bench import BENCHMARKS, benchmark


def test_both_sides_train_the_same_model_and_the_report_has_the_spread():
    rep = bench_overhead.run_benchmark(reps=2, model="tiny", steps=3, json_out=True)
    row = rep["results"][0]
    assert rep["benchmark"] == "overhead" and rep["world_size"] == 1
    assert row["loss_diff"] < 1e-5  # the same steps, computed two ways
    assert row["pair_ratio_min"] <= row["pair_ratio_median"] <= row["pair_ratio_max"]
    assert row["ratio"] == pytest.approx(row["edu3d_s"] / row["reference_s"])
    assert row["cpu_ratio"] > 0


def test_registered_and_one_process_only():
    assert benchmark("overhead") is bench_overhead.run_benchmark
    assert "overhead" in BENCHMARKS
    with pytest.raises(ValueError, match="use -n 1"):
        bench_overhead.run_benchmark(nprocs=2)


# ---- edu3d bench mfu: what can be checked without a GPU ------------------------------------
def test_mfu_formula_is_nanogpts_for_gpt2_small():
    from edu3d.bench.bench_mfu import flops_counted, formula
    from edu3d.model.gpt import GPT, config_from, num_params

    config = config_from("gpt2-small", vocab_pad=64)
    model = GPT(config)
    f = flops_counted(config)
    assert f["N"] == num_params(model) - model.pos_emb.weight.numel() == 123_689_472
    assert f["per_token"] == 6 * 123_689_472 + 12 * 12 * 768 * 1024
    assert formula(config).startswith("FLOPs/token = 6N + 12·L·h·s = 6 x 123,689,472 + 12 x 12")


@pytest.mark.parametrize("name,entry,tflops", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989), ("NVIDIA H100 PCIe", "H100 PCIe", 756),
    ("NVIDIA H200", "H200", 989), ("NVIDIA A100-SXM4-80GB", "A100", 312),
    ("NVIDIA H100 NVL", None, None), ("Tesla T4", None, None)])
def test_mfu_peak_table(name, entry, tflops):
    from edu3d.bench.bench_mfu import peak_for

    found = peak_for(name)
    assert (found is None) if entry is None else found == (entry, tflops * 1e12)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU refusal")
def test_mfu_refuses_on_cpu_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        benchmark("mfu")(json_out=False)  # what edu3d bench mfu calls
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs CUDA" in err[0] and "--allow-cpu" in err[0]
