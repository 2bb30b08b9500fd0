"""Checkpoint files are untrusted input (issue 29, items 10-14, 17): a manifest never points
edu3d outside its own folder, every damaged or forged file is one line naming it (exit 2), a
failed write names its file and leaves no temporary, --resume-step picks the step, and a rank
stuck on a slow disk is the one the heartbeat names."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from edu3d.ckpt import format as checkpoint
from edu3d.ckpt.format import CheckpointError, MANIFEST, step_dir
from edu3d.cli import main
from edu3d.launch.api import RankHung, launch
from edu3d.config.layout import Layout
from edu3d.train.loop import run
from edu3d.config.sections import Run
from edu3d.train.preflight import check_args

TINY = dict(model="tiny", layers=2, vocab=250, json=True)


def _train(**kw) -> list[dict]:
    args = Run.of(**{**TINY, **kw})
    check_args(args)
    return run(args, out=io.StringIO())


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """Two checkpoint folders of the same model: ``good`` (seed 0, steps 1 and 2) and
    ``other`` (seed 1, step 2)."""
    root = tmp_path_factory.mktemp("ckpts")
    _train(steps=2, ckpt_dir=str(root / "good"), save_every=1)
    _train(steps=2, ckpt_dir=str(root / "other"), seed=1)
    return root


@pytest.fixture
def ck(made, tmp_path) -> Path:
    """A fresh copy of the good checkpoint folder (tests edit it), beside ``other``."""
    shutil.copytree(made / "good", tmp_path / "ck", symlinks=True)
    shutil.copytree(made / "other", tmp_path / "other", symlinks=True)
    return tmp_path / "ck"


def _edit(ck: Path, change, step: int = 2) -> Path:
    path = step_dir(ck, step) / MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))
    return path


def _entry_for(ck: Path, path: Path) -> dict:
    """``ck``'s manifest entry of rank 0 at step 2, made to vouch for ``path`` (its sha256
    and size)."""
    data = path.read_bytes()
    real = json.loads((step_dir(ck, 2) / MANIFEST).read_text())["files"]["rank-00000.pt"]
    return {**real, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _one_line_refusal(capsys, argv: list[str], *needles: str) -> str:
    """``edu3d ARGV`` exits 2 with one line on stderr holding every needle, no traceback,
    and never torch's advice to load with weights_only=False."""
    capsys.readouterr()  # what came before
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's parser.error (edu3d train)
        code = exit_.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, code, err)
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and "weights_only=False" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def _readers(ck: Path, tmp: Path) -> list[list[str]]:
    """Every command that reads a checkpoint: show, export, generate, train --resume."""
    return [["ckpt", "show", str(ck)],
            ["ckpt", "export", str(ck), str(tmp / "out.pt")],
            ["generate", "--ckpt", str(ck), "--prompt", "3 17 42", "--max-new-tokens", "2"],
            ["train", "--model", "tiny", "--layers", "2", "--vocab", "250", "--steps", "3",
             "--ckpt-dir", str(ck), "--resume"]]


# ---- item 10: only the folder's own files ----------------------------------------------------
@pytest.mark.parametrize("how", ["absolute", "dotdot", "other-folder", "symlink",
                                 "symlinked-step"])
def test_a_manifest_never_points_outside_its_folder(ck, capsys, how):
    """Each forgery carries the right sha256 of the file it points at; before the fix
    export and generate used that file and exited 0."""
    folder, other = step_dir(ck, 2), step_dir(ck.parent / "other", 2) / "rank-00000.pt"
    outside = ck.parent / "elsewhere.pt"
    shutil.copy(other, outside)
    name = {"absolute": str(outside), "dotdot": "../step-000001/rank-00000.pt",
            "other-folder": "../../other/step-000002/rank-00000.pt"}.get(how)
    if name is not None:
        target = outside if how == "absolute" else (folder / name)

        entry = _entry_for(ck, target)
        _edit(ck, lambda m: m.update(files={name: entry}))
        needles = [name, "not a file edu3d writes"]
    elif how == "symlink":
        (folder / "rank-00000.pt").unlink()
        (folder / "rank-00000.pt").symlink_to(other)
        entry = _entry_for(ck, other)
        _edit(ck, lambda m: m["files"].update({"rank-00000.pt": entry}))
        needles = ["rank-00000.pt is a symbolic link"]
    else:  # the step folder itself a link to the other run's
        shutil.rmtree(folder)
        folder.symlink_to(other.parent)
        needles = [f"{folder} is a symbolic link"]
    for argv in _readers(ck, ck.parent):
        _one_line_refusal(capsys, argv, *needles)
    assert not (ck.parent / "out.pt").exists()


def test_read_inside_refuses_a_fifo_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "rank-00000.pt")
    with pytest.raises(CheckpointError, match="not a regular file"):
        checkpoint.read_inside(tmp_path, "rank-00000.pt")


# ---- item 11: damaged and forged files ---------------------------------------------------------
class _Forged:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _damage(ck: Path, how: str) -> list[str]:
    """Damage ``ck``'s step 2 as ``how`` says; returns what the error line must hold."""
    folder = step_dir(ck, 2)
    manifest, shard = folder / MANIFEST, folder / "rank-00000.pt"
    if how == "not-json":
        manifest.write_bytes(b"{\"format\": \"edu3d-checkpoint/1\", \"step\": 2,")
        return [str(manifest), "not valid JSON"]
    if how == "step-as-text":
        _edit(ck, lambda m: m.update(step="2"))
        return [str(manifest), "'step' is \"2\", not a JSON integer"]
    if how == "no-files":
        _edit(ck, lambda m: m.pop("files"))
        return [str(manifest), "no 'files'"]
    if how == "empty-files":
        _edit(ck, lambda m: m.update(files={}))
        return [str(manifest), "lists no file"]
    if how == "box-outside-shape":
        def grow(m):
            m["files"]["rank-00000.pt"]["pieces"][0]["box"][0][1] += 1000
        _edit(ck, grow)
        return [str(manifest), "is not a placement"]
    if how == "will-not-load":
        shard.write_bytes(b"this is not a torch file")
    elif how == "forged-pickle":
        shard.write_bytes(pickle.dumps(_Forged(str(ck.parent / "pwned"))))
    elif how == "corrupted":
        data = bytearray(shard.read_bytes())
        data[200] ^= 1
        shard.write_bytes(bytes(data))
        return [str(shard), "is corrupted"]
    entry = _entry_for(ck, shard)
    _edit(ck, lambda m: m["files"].update({"rank-00000.pt": entry}))
    return [str(shard), "torch.load(weights_only=True) refused it"]


@pytest.mark.parametrize("how", ["not-json", "step-as-text", "no-files", "empty-files",
                                 "box-outside-shape", "will-not-load", "forged-pickle"])
def test_every_damaged_or_forged_file_is_one_line_exit_2(ck, capsys, how):
    needles = _damage(ck, how)
    for argv in _readers(ck, ck.parent):
        if argv[0] == "ckpt" and argv[1] == "show":
            # show lists what it can and names the damaged checkpoint: not "complete"
            assert main(argv) == 2
            out, err = capsys.readouterr()
            assert "Traceback" not in err and "weights_only=False" not in err, err
            assert all(n in err for n in needles), (needles, err)
            assert "complete checkpoints at steps 1 (files verified)" in out, out
            assert "damaged, never loaded: steps 2" in out, out
            continue
        _one_line_refusal(capsys, argv, *needles)
    assert not (ck.parent / "pwned").exists()  # the forged pickle never ran


def test_show_verifies_checksums_or_says_it_did_not(ck, capsys):
    needles = _damage(ck, "corrupted")
    assert main(["ckpt", "show", str(ck)]) == 2
    out, err = capsys.readouterr()
    assert "complete checkpoints at steps 1 (files verified)" in out
    assert "damaged, never loaded: steps 2" in out and all(n in err for n in needles)
    assert main(["ckpt", "show", str(ck), "--no-verify"]) == 0
    assert "steps 1, 2 (files NOT verified (--no-verify))" in capsys.readouterr().out


# ---- items 12 and 14: failed writes, bad paths -------------------------------------------------
def test_a_failed_write_names_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.os, "fsync", disk_full)
    target = tmp_path / "rank-00000.pt"
    with pytest.raises(OSError, match="rank-00000.pt.*No space left") as info:
        checkpoint.write_atomic(target, b"x" * 1000)
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no NAME.tmp, no NAME
    with pytest.raises(OSError, match=f"cannot write checkpoint file .*{tmp_path.name}"):
        _train(steps=1, ckpt_dir=str(tmp_path / "ck"))  # the trainer's save: the same
    assert not list((tmp_path / "ck").rglob("*.tmp"))


def test_an_unwritable_ckpt_dir_is_refused_before_any_process(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    base = ["train", "--model", "tiny", "--layers", "2", "--dp", "2", "--steps", "2"]
    _one_line_refusal(capsys, [*base, "--ckpt-dir", str(blocker / "ck")],
                      f"--ckpt-dir {blocker / 'ck'}", "is not a folder")
    if os.path.isdir("/sys"):  # sysfs refuses new files even to root
        _one_line_refusal(capsys, [*base, "--ckpt-dir", "/sys/edu3d-ckpt"],
                          "--ckpt-dir /sys/edu3d-ckpt: cannot write in its existing parent /sys")


def test_show_and_export_refuse_bad_paths_in_one_line(ck, capsys):
    _one_line_refusal(capsys, ["ckpt", "show", "/nonexistent-edu3d"], "/nonexistent-edu3d",
                      "no such folder")
    blocker = ck.parent / "a-file"
    blocker.write_text("")
    _one_line_refusal(capsys, ["ckpt", "export", str(ck), str(blocker / "out.pt")],
                      f"cannot write {blocker / 'out.pt'}", "is not a folder")
    _one_line_refusal(capsys, ["ckpt", "export", str(ck), str(ck)], "is a folder")
    _one_line_refusal(capsys, ["ckpt", "export", str(ck), "/sys/edu3d.pt"], "/sys/edu3d.pt")


@pytest.mark.parametrize("temperature", ["nan", "inf", "-1"])
def test_generate_refuses_a_temperature_outside_its_range(ck, capsys, temperature):
    _one_line_refusal(capsys, ["generate", "--ckpt", str(ck), "--prompt", "3 17",
                               "--temperature", temperature],
                      f"--temperature {float(temperature):g}", "finite number >= 0")


# ---- item 13: --resume-step ------------------------------------------------------------------
def test_resume_step_continues_an_older_checkpoint_and_the_refusal_says_why(tmp_path, capsys):
    """A folder with steps 2 and 4; a run of 3 steps: --resume is refused as what it is,
    --resume-step 2 continues step 2 with the uninterrupted run's records, and --keep-last
    keeps the checkpoint just written (not the newer one past it)."""
    ck = str(tmp_path / "ck")
    full = _train(steps=3)
    _train(steps=4, ckpt_dir=ck, save_every=2)
    base = ["train", "--model", "tiny", "--layers", "2", "--vocab", "250", "--steps", "3",
            "--ckpt-dir", ck]
    _one_line_refusal(capsys, [*base, "--resume"],
                      f"the newest checkpoint in {ck} is step 4, past --steps 3: pass --steps "
                      "above 4 to continue it, or --resume-step N", "complete: steps 2, 4")
    _one_line_refusal(capsys, [*base, "--resume-step", "3"],
                      "--resume-step 3: no complete checkpoint of step 3", "complete: steps 2, 4")
    _one_line_refusal(capsys, [*base, "--resume-step", "4"], "--resume-step 4 is past --steps 3")
    resumed = _train(steps=3, ckpt_dir=ck, resume_step=2, keep_last=1)
    keys = ("step", "loss", "grad_norm", "lr")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in full]
    assert checkpoint.steps(ck) == [3, 4]  # 3 just written and kept; 4 is past it, untouched


# ---- item 17: a slow disk is no false blame ------------------------------------------------------
def test_a_rank_stuck_in_fsync_is_the_one_named_never_those_waiting_for_it(tmp_path,
                                                                           monkeypatch):
    """Rank 1's fsync sleeps far past the heartbeat during a synchronous save. Rank 0 waits
    for it in the checkpointer's barrier, which the flight recorder now sees: the heartbeat
    names rank 1 alone, in ckpt_write, and rank 0 as waiting. (Before, both looked stalled
    outside any collective and the verdict named either, or both.)"""
    from tests import workers_ckpt

    monkeypatch.setenv("EDU3D_RUNS", str(tmp_path / "runs"))
    beat = 1.5
    with pytest.raises(RankHung) as info:
        launch(workers_ckpt.save_on_a_slow_disk, 2, args=(str(tmp_path / "ck"), 1, 60.0),
               layout=Layout(dp=2), heartbeat=beat, timeout=120, echo=False,
               env={"EDU3D_TIMEOUT": "60"}, name="slow-disk")
    err, text = info.value, str(info.value)
    print(text)
    assert err.rank == 1 and err.ranks == [1], text
    assert "rank 1 is in ckpt_write at step 1" in text, text
    assert "rank 0 waits in barrier(world) at step 1" in text, text
