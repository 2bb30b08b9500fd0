"""A training step's memory as a timeline (issue 26 item 4): the recorder against edu3d
train's own record and the planner, what each knob does to the peak, the recorder off, the
``--memory-timeline`` option, and the CUDA allocator's snapshot read from a fixture.

One launch of 2 ranks records every setting the tests look at (tiny model, dp=2, gloo)."""

from __future__ import annotations

import json

import pytest
import torch

from edu3d.commands import train as train_command
from edu3d.course import ch07_memory_timeline as timeline
from edu3d.distributed import trace
from edu3d.launch import launch
from edu3d.model.gpt import GPT
from edu3d.train import cuda_memory, memory_recorder
from edu3d.train.data import SyntheticCorpus
from edu3d.train.loop import run
from edu3d.train.memory_recorder import KINDS, MemoryRecorder
from edu3d.config.sections import Run
from edu3d.train.preflight import model_config
from edu3d.train.trainer import Trainer

SETTINGS = {
    "dp": dict(zero=0, microbatches=1, recompute="none"),
    "dp_m2": dict(zero=0, microbatches=2, recompute="none"),
    "dp_full": dict(zero=0, microbatches=1, recompute="full"),
    "zero1": dict(zero=1, microbatches=1, recompute="none"),
    "zero3": dict(zero=3, microbatches=1, recompute="none"),
    "zero2_per_mb": dict(zero=2, microbatches=4, recompute="none", grad_reduce="per-microbatch"),
    "zero2_per_step": dict(zero=2, microbatches=4, recompute="none", grad_reduce="per-step"),
}


@pytest.fixture(scope="module")
def docs():
    argvs = [timeline.argv_of(s) for s in SETTINGS.values()]
    out = launch(timeline.record_many, 2, args=(argvs,), timeout=300, echo=False).results[0]
    return dict(zip(SETTINGS, out))


def test_the_peak_is_what_edu3d_train_records_where_the_state_stays(docs):
    """Plain DP (any micro-batches) and ZeRO-1 keep their gradient buffers through the step,
    so the moment of the activations' peak holds everything at rest too: the timeline's
    peak equals Trainer.stats' mem_bytes total, to the byte."""
    for name in ("dp", "dp_m2", "zero1"):
        doc = docs[name]
        top = timeline.fullest(doc)
        assert top["peak"]["total"] == doc["stats"]["total"], name
        assert top["peak_of"]["activations"] == doc["stats"]["activations"], name
        assert top["peak"]["phase"] == "forward", name


def test_the_kinds_add_up_and_the_step_ends_where_the_record_says(docs):
    for name, doc in docs.items():
        for tl in doc["ranks"]:
            p = tl["peak"]
            assert p["total"] == sum(p[k] for k in KINDS), name
            totals = [sum(s[k] for k in KINDS) for s in tl["samples"]]
            assert max(totals) == p["total"] and totals.index(p["total"]) == p["index"]
            end = tl["samples"][-1]
            assert end["op"] == "step" and end["edge"] == "end"
            assert end["activations"] == 0 and end["comm"] == 0, name  # all released
            assert tl["activations_peak_between_samples"] == tl["peak_of"]["activations"]
        if name in ("dp", "dp_m2", "zero1"):  # both ranks hold the same: the record's rank
            end = timeline.fullest(doc)["samples"][-1]
            assert {k: end[k] for k in ("params", "grads", "optimizer")} == {
                k: doc["stats"][k] for k in ("params", "grads", "optimizer")}, name


def test_activations_match_the_planner_and_recomputation_lowers_them(docs):
    peaks = {n: timeline.fullest(d)["peak_of"]["activations"] for n, d in docs.items()}
    for name, doc in docs.items():
        plan = timeline.planned_peak(doc)["activations"]
        assert abs(peaks[name] / plan - 1) < 1e-3, (name, peaks[name], plan)
    assert peaks["dp_full"] < 0.2 * peaks["dp"]
    assert peaks["dp_m2"] < 0.6 * peaks["dp"]  # half the rows per forward
    assert timeline.fullest(docs["dp_full"])["peak"]["total"] < \
        timeline.fullest(docs["dp"])["peak"]["total"]


def test_zero3_holds_a_shard_of_the_weights_and_gathers_one_unit_at_a_time(docs):
    dp = timeline.fullest(docs["dp"])
    z3 = timeline.fullest(docs["zero3"])
    full = dp["samples"][0]["params"]
    rest = z3["samples"][0]["params"]  # the step starts with shards only
    assert rest < 0.55 * full
    assert z3["peak_of"]["params"] < full  # never every unit at once
    assert z3["peak"]["total"] < dp["peak"]["total"]
    gathers = [s for s in z3["samples"] if s["op"] == "all_gather"]
    assert gathers, "ZeRO-3's gathers are events of the timeline"
    # ZeRO-1 and ZeRO-3 shard the optimizer state: half of DP's on 2 ranks (+ padding)
    for name in ("zero1", "zero3"):
        opt = timeline.fullest(docs[name])["samples"][0]["optimizer"]
        assert abs(opt / dp["samples"][0]["optimizer"] - 0.5) < 0.01


def test_reducing_per_microbatch_keeps_zero2_gradients_sharded(docs):
    """--grad-reduce per-step keeps the full gradients from the first backward to the end
    of the step; per-microbatch reduce-scatters after every backward and keeps the shard."""
    step = timeline.fullest(docs["zero2_per_step"])
    per_mb = timeline.fullest(docs["zero2_per_mb"])
    full = timeline.fullest(docs["dp"])["samples"][0]["grads"]
    assert step["peak_of"]["grads"] >= full  # every gradient, plus the shard
    assert per_mb["peak_of"]["grads"] < 0.75 * step["peak_of"]["grads"]
    assert per_mb["peak"]["total"] < step["peak"]["total"]
    scatters = [len([s for s in t["samples"] if s["op"] == "reduce_scatter"
                     and s["edge"] == "begin"]) for t in (per_mb, step)]
    assert scatters[0] == 4 * scatters[1]  # one reduce-scatter per unit and micro-batch


def test_the_planner_peak_is_drawn_and_the_caption_uses_the_run(docs):
    from edu3d.widgets.memory_timeline import peaks_figure, step_memory_figure

    doc = docs["zero1"]
    fig = step_memory_figure(doc)
    plan = timeline.planned_peak(doc)["total"]
    names = [t.name for t in fig.data]
    assert any(n.startswith("planner's peak") for n in names)
    assert any(n.startswith("measured peak") for n in names)
    text = timeline.caption(doc)
    assert timeline.size(plan) in text and timeline.size(doc["stats"]["total"]) in text
    assert timeline.size(timeline.fullest(doc)["peak"]["total"]) in text
    rows = timeline.peaks(docs)
    assert len(peaks_figure(rows).data) >= 4
    lines = timeline.describe_moves({timeline.key_of(s): docs[n] for n, s in SETTINGS.items()})
    assert any(line.startswith("recomputation") for line in lines)


def _hooks(trainer) -> tuple:
    mods = sum(len(m._forward_hooks) for m in trainer.par.module.modules())
    grads = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
                for p in trainer.par.module.parameters())
    return mods, grads, torch._C._autograd._top_saved_tensors_default_hooks(False)


def test_the_recorder_off_costs_nothing_and_leaves_nothing_behind(monkeypatch):
    args = Run.of(steps=2)
    config = model_config(args)
    trainer = Trainer(GPT(config, seed=0), None, args)
    corpus = SyntheticCorpus(config.vocab_size, config.seq_len, seed=0)
    before = _hooks(trainer)
    assert before[2] is None
    trainer.step(*corpus.batch(1, 8), 1)
    rec = MemoryRecorder(trainer)
    with rec.watch(2):
        during = _hooks(trainer)
        assert trace.current() is rec
        trainer.step(*corpus.batch(2, 8), 2)
    assert during[0] > before[0] and during[1] > before[1] and during[2] is not None
    assert _hooks(trainer) == before and not isinstance(trace.current(), MemoryRecorder)
    assert len(rec.samples) > 10
    # a run without --memory-timeline never builds a recorder
    monkeypatch.setattr(memory_recorder, "MemoryRecorder", lambda *a: pytest.fail("built"))
    assert len(run(Run.of(steps=2, log_every=2), out=open("/dev/null", "w"))) == 1


def test_memory_timeline_option_writes_the_document(tmp_path, capsys):
    path = tmp_path / "step.json"
    out = open(tmp_path / "out.txt", "w")
    run(Run.of(steps=2, microbatches=2, memory_timeline=str(path)), out=out)
    out.close()
    doc = json.loads(path.read_text())
    assert doc["kind"] == "edu3d memory timeline" and doc["step"] == 2
    assert len(doc["ranks"]) == 1 and doc["stats"]["total"] == doc["ranks"][0]["peak"]["total"]
    assert doc["planner"]["peak"]["total_bytes"] >= doc["ranks"][0]["peak"]["total"]
    assert f"memory timeline of step 2 in {path}" in (tmp_path / "out.txt").read_text()


@pytest.mark.parametrize("flags, words", [
    (["--steps", "1"], "use --steps 2 or more"),
    (["--steps", "3", "--impl", "torch"], "drop --impl torch"),
])
def test_memory_timeline_refuses_before_any_process(tmp_path, flags, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_command.main(["--memory-timeline", str(tmp_path / "t.json"), *flags])
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def test_memory_timeline_names_a_missing_folder(capsys):
    with pytest.raises(SystemExit) as exit_:
        train_command.main(["--steps", "2", "--memory-timeline", "/no/such/folder/t.json"])
    assert exit_.value.code == 2
    assert "the folder /no/such/folder does not exist" in capsys.readouterr().err


# ---- the CUDA allocator's snapshot -----------------------------------------------------------
MB = 1 << 20
# torch.cuda.memory._snapshot()'s structure (documented in that function): a 2 MiB segment
# cut for three tensors, the middle one freed (a hole between live blocks), then a 20 MiB
# segment for one large tensor, freed and returned by empty_cache
SNAPSHOT = {
    "segments": [
        {"device": 0, "address": 0x7F0000000000, "total_size": 2 * MB, "stream": 0,
         "segment_type": "large", "allocated_size": 3 * MB // 2, "active_size": 3 * MB // 2,
         "blocks": [
             {"address": 0x7F0000000000, "size": MB, "requested_size": MB,
              "state": "active_allocated", "frames": []},
             {"address": 0x7F0000100000, "size": MB // 2, "requested_size": MB // 2,
              "state": "inactive", "frames": []},
             {"address": 0x7F0000180000, "size": MB // 2, "requested_size": 500_000,
              "state": "active_allocated", "frames": []}]}],
    "device_traces": [[
        {"action": "segment_alloc", "addr": 0x7F0000000000, "size": 2 * MB, "stream": 0,
         "time_us": 100, "frames": []},
        {"action": "alloc", "addr": 0x7F0000000000, "size": MB, "stream": 0, "time_us": 101,
         "frames": [{"filename": "gpt.py", "line": 1, "name": "forward"}]},
        {"action": "alloc", "addr": 0x7F0000100000, "size": MB // 2, "stream": 0,
         "time_us": 102, "frames": []},
        {"action": "alloc", "addr": 0x7F0000180000, "size": MB // 2, "stream": 0,
         "time_us": 103, "frames": []},
        {"action": "free_requested", "addr": 0x7F0000100000, "size": MB // 2, "stream": 0,
         "time_us": 104, "frames": []},
        {"action": "free_completed", "addr": 0x7F0000100000, "size": MB // 2, "stream": 0,
         "time_us": 105, "frames": []},
        {"action": "segment_alloc", "addr": 0x7F1000000000, "size": 20 * MB, "stream": 0,
         "time_us": 106, "frames": []},
        {"action": "alloc", "addr": 0x7F1000000000, "size": 20 * MB, "stream": 0,
         "time_us": 107, "frames": []},
        {"action": "free_requested", "addr": 0x7F1000000000, "size": 20 * MB, "stream": 0,
         "time_us": 108, "frames": []},
        {"action": "free_completed", "addr": 0x7F1000000000, "size": 20 * MB, "stream": 0,
         "time_us": 109, "frames": []},
        {"action": "segment_free", "addr": 0x7F1000000000, "size": 20 * MB, "stream": 0,
         "time_us": 110, "frames": []},
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": 111,
         "frames": []}]],
}


def test_the_allocator_history_replays_into_allocated_and_reserved():
    rows = cuda_memory.allocator_timeline(SNAPSHOT)
    assert [r["action"] for r in rows][:2] == ["segment_alloc", "alloc"]
    assert len(rows) == 9  # the two free_requested and the snapshot change nothing
    peak = max(rows, key=lambda r: r["allocated"])
    assert peak["allocated"] == MB + MB // 2 + 20 * MB and peak["reserved"] == 22 * MB
    assert rows[-1]["allocated"] == 3 * MB // 2 and rows[-1]["reserved"] == 2 * MB
    assert [r["t"] for r in rows] == sorted(r["t"] for r in rows)
    assert all(r["reserved"] >= r["allocated"] for r in rows)


def test_fragmentation_is_the_free_blocks_inside_used_segments():
    f = cuda_memory.fragmentation(SNAPSHOT)
    assert f == {"reserved": 2 * MB, "allocated": 3 * MB // 2, "cached": MB // 2,
                 "inactive_split": MB // 2, "largest_free": MB // 2, "segments": 1,
                 "blocks": 3}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the caching allocator is CUDA's")
def test_the_pool_on_a_gpu():
    rows = timeline.pool_compare(preset="tiny", steps=4, lengths=(32, 16))
    for r in rows:
        assert r["reserved_peak"] >= r["allocated_peak"] > 0
    with cuda_memory.history() as h:
        torch.ones(1 << 20, device="cuda").sum()
    rows = cuda_memory.allocator_timeline(h["snapshot"])
    assert any(r["action"] == "alloc" and r["size"] >= 4 << 20 for r in rows)
    assert cuda_memory.fragmentation(h["snapshot"])["reserved"] > 0


def test_the_panel_picks_from_the_sweep_and_names_what_it_lacks(docs):
    from edu3d.widgets.panels.ch07_memory import timeline_controls

    by_key = {timeline.key_of(SETTINGS[n]): d for n, d in docs.items()}
    ctl = timeline_controls(by_key)
    assert ctl.figure is not None and "rank" in ctl.message
    assert ctl.widget is not None and ctl._knobs["rank"].label == "fullest"  # never a blank
    first = ctl.figure.layout.title.text
    ctl.redraw(zero=3)
    assert ctl.figure is not None and ctl.figure.layout.title.text != first
    ctl.redraw(x="event", rank=1)
    assert ctl.figure.layout.xaxis.title.text.startswith("event")
    ctl.redraw(zero=1, microbatches=4)
    assert ctl.figure is None and "not in the sweep" in ctl.message
    assert ctl.widget is not None and "grad_reduce" in ctl._knobs
