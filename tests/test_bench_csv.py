"""Benchmarks a user can keep: ``edu3d bench NAME --csv FILE`` appends one row per measurement
(the header once), and ``edu3d bench plot FILE -o out.png`` draws the panels the file has data
for; bad input is one line and exit code 2. No timing is asserted: only shapes and arithmetic."""

import csv

import pytest

from edu3d import cli
from edu3d.bench import plot, records
from edu3d.bench.bench_pp import run_benchmark as run_pp
from edu3d.commands import bench as bench_command

CALLS = []


def fake_benchmark(nprocs: int = 2, reps: int = 3, json_out: bool = False) -> dict:
    """A benchmark in the harness's shape, as a new one would return it (``edu3d bench fake``)."""
    CALLS.append(nprocs)
    return {"benchmark": "fake", "world_size": nprocs, "layout": f"dp{nprocs}", "results": [
        {"name": "step", "edu3d_s": 0.02, "reference": "torch", "reference_s": 0.025,
         "ratio": 0.8, "tokens": 1000, "tokens_per_s": 50000.0,
         "reference_tokens_per_s": 40000.0, "comm_share": {"dp": 0.25}},
        {"name": "launch", "edu3d_s": 1.5, "reference": "torchrun", "reference_s": 1.0,
         "ratio": 1.5, "layout": "1 rank"}]}


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(bench_command.BENCHMARKS, "fake", "tests.test_bench_csv:fake_benchmark")
    CALLS.clear()


def csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def refused(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---- the CSV --------------------------------------------------------------------------------
def test_a_report_becomes_one_measurement_per_number():
    rows = records.measurements(fake_benchmark(4))
    got = {(m.case, m.metric): m for m in rows}
    assert set(got) == {("step", "step_s"), ("step", "tokens_per_s"), ("step", "comm_share_dp"),
                        ("launch", "step_s")}
    assert got["step", "step_s"].ratio == pytest.approx(0.8)
    assert got["step", "tokens_per_s"].ratio == pytest.approx(1.25)
    assert got["step", "comm_share_dp"].reference_value is None
    assert got["step", "comm_share_dp"].ratio is None and got["step", "step_s"].reference == "torch"
    assert got["step", "step_s"].layout == "dp4" and got["launch", "step_s"].layout == "1 rank"
    assert all(m.world_size == 4 and m.benchmark == "fake" for m in rows)


def test_the_command_appends_rows_and_writes_the_header_once(fake, tmp_path, capsys):
    path = tmp_path / "bench.csv"
    for n in (1, 2):
        assert cli.main(["bench", "fake", "-n", str(n), "--csv", str(path)]) == 0
    assert "appended 4 rows" in capsys.readouterr().err
    head, *body = csv_rows(path)
    assert tuple(head) == records.COLUMNS == (
        "date", "git_commit", "machine", "torch_version", "benchmark", "case", "layout",
        "world_size", "metric", "value", "reference", "reference_value", "ratio")
    assert len(body) == 8 and head not in body
    rows = records.read(path)
    assert [r["world_size"] for r in rows] == [1] * 4 + [2] * 4
    first = rows[0]
    assert first["date"][:2] == "20" and first["git_commit"] and first["torch_version"]
    assert "cores" in first["machine"] or "/" in first["machine"]
    assert first["ratio"] == pytest.approx(first["value"] / first["reference_value"])


def test_a_foreign_csv_is_refused_before_the_benchmark_runs(fake, tmp_path, capsys):
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    err = refused(capsys, ["bench", "fake", "--csv", str(path)])
    assert "header" in err and str(path) in err
    assert CALLS == [] and path.read_text() == "a,b\n1,2\n"
    err = refused(capsys, ["bench", "fake", "--csv", str(tmp_path / "no" / "x.csv")])
    assert "does not exist" in err and CALLS == []
    refused(capsys, ["bench", "fake", str(path)])  # a FILE is plot's, not a benchmark's


def test_a_real_quick_benchmark_appends_its_measurements(tmp_path):
    rep = run_pp(2, True, m=2, layers=2, d_model=32, seq=16, rows=1, reps=1, warmup=0)
    path = tmp_path / "pp.csv"
    where = records.context()
    for _ in range(2):
        records.append(path, records.measurements(rep), where)
    rows = records.read(path)
    assert [r["metric"] for r in rows] == ["step_s", "tokens_per_s", "comm_share_pp"] * 2
    assert {(r["benchmark"], r["case"], r["layout"], r["world_size"]) for r in rows} == {
        ("pp", "1f1b", "pp2", 2)}
    step, tokens, share = rows[:3]
    assert tokens["value"] == pytest.approx(2 * 16 / step["value"])  # m * rows * seq tokens
    assert step["ratio"] == pytest.approx(rep["results"][0]["ratio"])
    assert 0 < share["value"] < 1 and share["reference_value"] is None
    assert sum(1 for line in path.read_text().splitlines() if line.startswith("date,")) == 1


# ---- the picture ---------------------------------------------------------------------------
def kept(tmp_path, *reports, name: str = "kept.csv") -> str:
    path = tmp_path / name
    for rep in reports:
        records.append(path, records.measurements(rep))
    return str(path)


def test_plot_draws_only_the_panels_it_has_data_for(tmp_path):
    path = kept(tmp_path, fake_benchmark(1), fake_benchmark(2))
    fig = plot.figure(records.read(path), "kept.csv")
    assert [ax.get_title() for ax in fig.axes] == [plot.TITLES[k] for k in
                                                   ("tokens", "scaling", "comm", "ratio")]
    scaling = fig.axes[1]
    assert "world size" in scaling.get_xlabel() and "tokens/s" in scaling.get_ylabel()
    assert [line.get_xdata().tolist() for line in scaling.lines] == [[1, 2], [1, 2]]
    ratio = fig.axes[3]
    assert any(list(line.get_xdata()) == [1.0, 1.0] for line in ratio.lines)  # the 1.0 line
    assert "%" in fig.axes[2].get_xlabel() and "tokens/s" in fig.axes[0].get_xlabel()

    baseline = {"benchmark": "cp", "world_size": 2, "layout": "cp2", "results": [
        {"name": "cp2 ring", "edu3d_s": 0.2, "reference": "dp2, whole sequences",
         "reference_s": 0.1, "ratio": 2.0, "tokens": 512, "comm_share": {"cp": 0.5}}]}
    only_one_size = kept(tmp_path, fake_benchmark(2), baseline, name="one.csv")
    titles = [ax.get_title() for ax in plot.figure(records.read(only_one_size)).axes]
    assert plot.TITLES["scaling"] not in titles and plot.TITLES["ratio"] in titles
    ratio = plot.figure(records.read(only_one_size)).axes[-1]  # PyTorch's references only
    assert {t.get_text() for t in ratio.get_yticklabels()} == {
        "dp2 · fake · step", "1 rank (2 ranks) · fake · launch"}


def test_plot_command_writes_a_png(tmp_path, capsys):
    path = kept(tmp_path, fake_benchmark(1), fake_benchmark(2))
    out = tmp_path / "out.png"
    assert cli.main(["bench", "plot", path, "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "4 panels" in capsys.readouterr().out


def test_plot_refuses_bad_input_in_one_line(tmp_path, capsys):
    missing = tmp_path / "missing.csv"
    assert "no such file" in refused(capsys, ["bench", "plot", str(missing), "-o", "x.png"])
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert "empty" in refused(capsys, ["bench", "plot", str(empty)])
    foreign = tmp_path / "foreign.csv"
    foreign.write_text("name,seconds\nx,1\n")
    assert "lacks" in refused(capsys, ["bench", "plot", str(foreign)])
    header_only = tmp_path / "header.csv"
    header_only.write_text(",".join(records.COLUMNS) + "\n")
    assert "no rows" in refused(capsys, ["bench", "plot", str(header_only)])
    good = kept(tmp_path, fake_benchmark(2))
    assert ".png" in refused(capsys, ["bench", "plot", good, "-o", str(tmp_path / "x.txt")])
    assert "name the CSV" in refused(capsys, ["bench", "plot"])
    nothing = tmp_path / "nothing.csv"
    records.append(nothing, [records.Measurement("x", "c", "dp2", 2, "other", 1.0)])
    assert "nothing to draw" in refused(capsys, ["bench", "plot", str(nothing)])
    assert not (tmp_path / "x.txt").exists()
