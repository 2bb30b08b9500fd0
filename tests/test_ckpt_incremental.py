"""``--incremental``: content-addressed checkpoints. A save writes only the tensor pieces whose
bytes changed (nothing is reused when every parameter trains; frozen ones are never written
again), manifests refer to the blobs earlier saves wrote, ``--keep-last`` removes only blobs
no kept manifest names, resume and reshard read through the references bit for bit, a
reference can never leave the checkpoint, and a rank killed while writing blobs leaves no
checkpoint and nothing that is ever loaded."""

from __future__ import annotations

import io
import json
import os
import signal
import time

import pytest

from edu3d.ckpt import format as ckfmt
from edu3d.ckpt.checkpointer import reuse
from edu3d.commands.train import parse
from edu3d.config.layout import Layout
from edu3d.launch import launch
from edu3d.launch.api import LaunchError
from edu3d.model.gpt import config_from
from edu3d.model.shapes import num_params_from_config
from edu3d.train.loop import run
from edu3d.train.preflight import check_args
from tests import workers_ckpt, workers_incremental

BASE = ["--layers", "2", "--json"]
EMB = ["--freeze", "tok_emb.*,pos_emb.*"]
PARAMS_L2 = num_params_from_config(config_from("tiny", layers=2))  # 134,912
EMB_NUMEL = 256 * 64 + 32 * 64


def _run(ck, *argv, steps=4):
    return run(parse([*BASE, "--steps", str(steps), "--ckpt-dir", str(ck), *argv]),
               out=io.StringIO())


def _manifest(ck, step):
    return json.loads((ckfmt.step_dir(ck, step) / ckfmt.MANIFEST).read_text())


def _numbers(records):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


def test_frozen_embeddings_are_written_once_and_resume_is_bitwise(tmp_path):
    ck = tmp_path / "ck"
    full = _run(ck, "--incremental", "--save-every", "1", "--async-save", *EMB)
    first, later = _manifest(ck, 1)["incremental"], [_manifest(ck, s)["incremental"]
                                                     for s in (2, 3, 4)]
    trainable = PARAMS_L2 - EMB_NUMEL
    assert first["reused"] == 0
    for inc in later:  # every trainable weight and both moments: written; embeddings: reused
        assert inc["written"] == 3 * 4 * trainable
        assert inc["reused"] >= 4 * EMB_NUMEL
        assert inc == reuse(_manifest(ck, 2)) or inc["bytes"] == later[0]["bytes"]
    # resuming from step 2 reads through the references (step 2 wrote no embedding blob)
    again = _run(ck, "--incremental", "--save-every", "1", "--resume-step", "2", *EMB)
    assert _numbers(again) == _numbers(full)  # == on floats: bit for bit
    ref = _run(tmp_path / "plain", "--save-every", "1", *EMB)  # the per-rank-file format
    assert _numbers(ref) == _numbers(full)


def test_every_parameter_training_reuses_nothing(tmp_path):
    """An optimizer step changes every byte of every trainable weight and of both AdamW
    moments: an incremental save then writes all of it (only the unchanged random state is
    reused)."""
    ck = tmp_path / "ck"
    _run(ck, "--incremental", "--save-every", "1", steps=3)
    for step in (2, 3):
        inc = _manifest(ck, step)["incremental"]
        assert inc["written"] == 3 * 4 * PARAMS_L2
        assert inc["reused"] < 0.01 * inc["bytes"]  # the random state at most


def test_keep_last_removes_only_blobs_no_kept_manifest_names(tmp_path):
    ck = tmp_path / "ck"
    _run(ck, "--incremental", "--save-every", "1", "--keep-last", "2", *EMB, steps=3)
    debris = ck / "blobs" / ".deadbeef.1.99.tmp"  # what a rank killed mid-blob leaves
    debris.write_bytes(b"half")
    _run(ck, "--incremental", "--save-every", "1", "--keep-last", "2", "--resume", *EMB, steps=5)
    assert ckfmt.steps(ck) == [4, 5]
    named = {r["sha256"] for s in (4, 5) for info in _manifest(ck, s)["files"].values()
             for r in [*info["blobs"], *info["rng"].values()]}
    on_disk = {p.name for p in (ck / "blobs").iterdir()}
    assert on_disk == named  # nothing else (step 1-3's moments, the debris) and nothing less
    emb = [info["blobs"][i]["sha256"] for info in _manifest(ck, 5)["files"].values()
           for i, p in enumerate(info["pieces"]) if p["name"] == "tok_emb.weight"]
    assert emb and all((ck / "blobs" / s).is_file() for s in emb)  # written by step 1, kept


def test_blobs_stay_when_a_manifest_cannot_be_read(saved):
    """What a damaged manifest refers to is unknown: the garbage collection removes nothing
    (it would otherwise delete the blobs a repaired manifest needs)."""
    before = sorted(p.name for p in (saved / "blobs").iterdir())
    (ckfmt.step_dir(saved, 1) / ckfmt.MANIFEST).write_text("{not json")
    (saved / "blobs" / ("0" * 64)).write_bytes(b"orphan")
    assert ckfmt.collect_blobs(saved) is None
    assert sorted(p.name for p in (saved / "blobs").iterdir()) == sorted(before + ["0" * 64])


def test_ckpt_show_prints_the_references(saved, capsys):
    code, out = _show(saved, capsys)
    assert code == 0 and "complete checkpoints at steps 1, 2 (files verified)" in out.out
    assert "incremental: refers to" in out.out and "were already there" in out.out
    assert "step-000002/rank-00000" in out.out and "written by this save" in out.out


def _edit(ck, step, fn):
    path = ckfmt.step_dir(ck, step) / ckfmt.MANIFEST
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


@pytest.fixture()
def saved(tmp_path):
    ck = tmp_path / "ck"
    _run(ck, "--incremental", "--save-every", "1", *EMB, steps=2)
    return ck


def _show(ck, capsys):
    from edu3d.commands.ckpt import show_command

    class A:
        dir, step, verify = str(ck), None, True
    code = show_command(A)
    return code, capsys.readouterr()


def test_a_reference_never_leaves_the_checkpoint(saved, capsys):
    for evil in ("../../../etc/passwd", "/etc/passwd", "a" * 63 + "/"):
        _edit(saved, 2, lambda m: m["files"]["rank-00000"]["blobs"][0].update(sha256=evil))
        with pytest.raises(ckfmt.CheckpointError, match="not {rank, pieces, blobs"):
            ckfmt.read_manifest(saved, 2)
    code, out = _show(saved, capsys)
    assert code == 2 and "damaged" in out.out and "Traceback" not in out.err


def test_a_missing_or_corrupted_blob_is_one_line_naming_it(saved, capsys):
    m = _manifest(saved, 2)
    ref = m["files"]["rank-00000"]["blobs"][0]
    name = m["files"]["rank-00000"]["pieces"][0]["name"]
    blob = saved / "blobs" / ref["sha256"]
    data = blob.read_bytes()
    blob.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(ckfmt.CheckpointError) as err:
        ckfmt.verify(saved, 2)
    assert "is corrupted" in str(err.value) and ref["sha256"][:12] in str(err.value)
    assert name in str(err.value) and "\n" not in str(err.value)
    blob.unlink()
    with pytest.raises(ckfmt.CheckpointError, match=f"{ref['sha256']} is missing") as err:
        ckfmt.verify(saved, 2)
    assert name in str(err.value)
    os.symlink("/etc/hostname", blob)
    with pytest.raises(ckfmt.CheckpointError, match="symbolic link"):
        ckfmt.verify(saved, 2)
    args = parse([*BASE, "--steps", "3", "--ckpt-dir", str(saved), "--resume", *EMB])
    config, _ = check_args(args)
    with pytest.raises(ckfmt.CheckpointError, match="symbolic link"):  # before any process
        ckfmt.check_resume(args, config)
    code, out = _show(saved, capsys)  # one line per checkpoint naming the shared blob
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 2 and all(ref["sha256"] in ln for ln in lines)
    assert "steps 1, 2" in out.out


def test_incremental_needs_a_ckpt_dir(capsys):
    from edu3d import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--incremental"])
    assert exit_.value.code == 2 and "add --ckpt-dir" in capsys.readouterr().err


def test_a_process_killed_while_writing_a_blob_leaves_no_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    argv = [*BASE, "--steps", "3", "--ckpt-dir", str(ck), "--save-every", "1",
            "--incremental", *EMB]
    pid = os.fork()
    if pid == 0:
        try:
            workers_incremental.die_while_writing_blobs(2)
            run(parse(argv), out=io.StringIO())
        finally:
            os._exit(1)
    deadline = time.monotonic() + 120
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("not killed within 120 s")
        time.sleep(0.05)
    assert ckfmt.steps(ck) == [1]  # the half-written save of step 2 is no checkpoint
    assert any(p.name.endswith(".tmp") for p in (ck / "blobs").iterdir())
    records = run(parse([*argv, "--resume"]), out=io.StringIO())
    uninterrupted = _run(tmp_path / "ref", *EMB, steps=3)
    assert _numbers(records) == _numbers(uninterrupted)
    assert ckfmt.steps(ck) == [1, 2, 3]
    assert not any(p.name.endswith(".tmp") for p in (ck / "blobs").iterdir())  # collected


def test_dp2_rank_killed_mid_blob_then_resume_and_reshard_through_references(tmp_path):
    """dp2 ZeRO-1 with frozen embeddings: rank 1 dies inside a blob of step 2's save; step 1
    is still the newest checkpoint, the run resumes from it onto the uninterrupted records
    (bitwise), and its step 3 loads into one process and into tp2 through the references."""
    ck = tmp_path / "ck"
    argv = [*BASE, "--steps", "3", "--save-every", "1", "--incremental", "--dp", "2",
            "--zero", "1", *EMB]
    uninterrupted = run(parse([*argv, "--ckpt-dir", str(tmp_path / "ref")]), out=io.StringIO())
    args = parse([*argv, "--ckpt-dir", str(ck)])
    _, layout = check_args(args)
    with pytest.raises(LaunchError):
        launch(workers_incremental.killed_while_writing_blobs, 2, layout=layout,
               args=(args.flat(), 2, 1), timeout=300, name="blobkill", echo=False)
    assert ckfmt.steps(ck) == [1]
    resumed = run(parse([*argv, "--ckpt-dir", str(ck), "--resume"]), out=io.StringIO())
    assert _numbers(resumed) == _numbers(uninterrupted)  # bit for bit
    out = launch(workers_ckpt.reshard_into, 2, layout=Layout(tp=2),
                 args=(str(ck), 3, [[*BASE, "--incremental", *EMB],
                                    [*BASE, "--tp", "2", "--incremental", *EMB]]),
                 timeout=300, name="blobreshard", echo=False).results[0]
    assert len(out) == 2 and all(r["param_err"] == 0 and r["kept"] == 3 for r in out)


def test_the_panel_draws_written_and_reused_bars_and_names_a_bad_glob():
    from edu3d.widgets.panels.ch08_checkpoints import incremental_controls

    def case(written, reused, frozen):
        return {"saves": [{"step": 1, "written": written + reused, "reused": 0},
                          {"step": 2, "written": written, "reused": reused}],
                "frozen_params": frozen, "params": 100}
    ctl = incremental_controls({"every parameter trains": case(300, 0, 0),
                                "embeddings frozen": case(150, 50, 50)})
    assert [t.name for t in ctl.bytes_fig.data][:2] == ["written by this save",
                                                       "reused (written by an earlier save)"]
    assert "embeddings frozen: 50%" in ctl.bytes_fig.layout.title.text
    ctl.redraw(globs="nope.*")
    assert ctl.run() is None and "--freeze 'nope.*' matches no parameter" in ctl.message
