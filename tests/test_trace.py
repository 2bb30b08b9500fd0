import json

import pytest

from edu3d.distributed import trace
from edu3d.launch import launch
from tests import workers


def test_recorder_span_context_and_file(tmp_path):
    rec = trace.Recorder(rank=2, path=trace.rank_file(tmp_path, 2))
    rec.align()
    with rec.context(step=1, mb=3):
        with rec.span("compute", "F", stage=0) as ev:
            sum(range(1000))
        rec.mark_memory("after F", params=100, activations=50)
    with pytest.raises(ValueError, match="lane 'gpu' must be one of"):
        rec.record("gpu", "x", 0, 1)
    assert ev["t1"] >= ev["t0"] >= 0
    rec.flush()
    lines = [json.loads(line) for line in trace.rank_file(tmp_path, 2).read_text().splitlines()]
    assert lines[0] == {**ev, "rank": 2, "lane": "compute", "op": "F", "step": 1, "mb": 3,
                        "stage": 0}
    assert lines[1]["mem"] == {"params": 100, "activations": 50} and lines[1]["lane"] == "mem"
    assert set(lines[0]) <= set(trace.FIELDS)


def test_merge_and_chrome_export(tmp_path):
    for r, t in ((1, 5.0), (0, 7.0)):
        rec = trace.Recorder(rank=r, path=trace.rank_file(tmp_path, r))
        rec.record("comm", "all_reduce", t, t + 2, group="dp", n=2, bytes=64)
        rec.record("compute", "F", t, t + 1, mb=0, sim=True)
        rec.flush()
    events = trace.load(tmp_path)
    assert [(e["rank"], e["t0"]) for e in events] == [(1, 5.0), (1, 5.0), (0, 7.0), (0, 7.0)]
    doc = trace.to_chrome(events, tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == doc
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in spans} == {"all_reduce", "F mb0"}
    sim = [e for e in spans if e["name"] == "F mb0"]
    assert all(e["pid"] >= 10_000 for e in sim)  # theory in its own process per rank
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1", "theory rank 0", "theory rank 1"}


def test_wire_bytes_follow_the_ring_formulas():
    s = 1200
    assert trace.wire_bytes({"op": "all_reduce", "bytes": s, "n": 4}) == 2 * 3 / 4 * s
    assert trace.wire_bytes({"op": "all_gather", "bytes": s, "n": 4}) == 3 / 4 * s
    assert trace.wire_bytes({"op": "reduce_scatter", "bytes": s, "n": 3}) == 2 / 3 * s
    assert trace.wire_bytes({"op": "send", "bytes": s}) == s
    assert trace.wire_bytes({"op": "recv", "bytes": s}) == 0


def test_null_recorder_records_nothing():
    rec = trace.current()
    assert not rec.enabled and rec.record("comm", "x", 0, 1) == {}


def test_every_collective_is_correct_and_traced():
    n = 3
    res = launch(workers.comm_ops, n, timeout=240, echo=False)
    for r, out in enumerate(res.results):
        assert out["gathered"] == [float(i + 10 * k) for k in range(n) for i in range(4)]
        assert out["scattered"] == [n * (n + 1) / 2] * 2
        assert out["broadcast"] == [float(n - 1)] * 3
        assert out["received"] == float((r - 1) % n)
    ev = {(e["rank"], e["op"]): e for e in res.events()}
    for r in range(n):
        assert ev[r, "all_gather"]["bytes"] == 4 * n * 4  # the gathered output
        assert ev[r, "reduce_scatter"]["bytes"] == 2 * n * 4  # the full input
        assert ev[r, "broadcast"]["peer"] == n - 1
        assert ev[r, "send"]["peer"] == (r + 1) % n and ev[r, "send"]["bytes"] == 40
        assert ev[r, "recv"]["peer"] == (r - 1) % n
        assert ev[r, "all_reduce"]["t1"] >= ev[r, "all_reduce"]["t0"]  # async: ends at wait
        assert all(e["group"] == "world" and e["n"] == n
                   for (rank, op), e in ev.items() if rank == r and op != "send")
