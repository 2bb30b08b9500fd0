"""Real text (``--data stdlib`` or ``text:PATH``): byte tokens, the prepared and memory-mapped
token file, batches that do not depend on the layout, the refusals before any rank starts,
one parity case on text (dp x cp against the serial run) and ``edu3d generate`` printing text."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

from edu3d import cli
from edu3d.config.sections import Run
from edu3d.course import ch00_launching_ranks_text as chapter
from edu3d.train import text
from edu3d.train.loop import run as train
from edu3d.train.preflight import check_args, model_config

PYTHONISH = "def add(a, b):\n    \"\"\"Return a + b: déjà vu.\"\"\"\n    return a + b\n\n" * 40


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "code.py"
    path.write_text(PYTHONISH, encoding="utf-8")
    return path


def test_bytes_are_the_tokens():
    assert text.encode("déf") == [100, 195, 169, 102]
    assert text.decode(text.encode("déjà vu ✓")) == "déjà vu ✓"
    assert text.decode([100, 195]) == "d\ufffd"  # a character cut in half


def test_a_folder_is_its_files_in_name_order_hidden_ones_left_out(tmp_path):
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.txt").write_text("ay")
    (tmp_path / ".secret").write_text("no")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("no")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("sea")
    prepared = text.prepare(f"text:{tmp_path}")
    assert prepared.path.read_bytes() == b"ay\n\nbee\n\nsea"
    assert (prepared.tokens, prepared.files, prepared.skipped) == (12, 3, 0)


def test_prepared_once_then_mapped(corpus_file):
    first = text.prepare(f"text:{corpus_file}")
    stamp = first.path.stat().st_mtime_ns
    again = text.prepare(f"text:{corpus_file}")
    assert again.path == first.path and again.path.stat().st_mtime_ns == stamp  # a cache hit
    assert first.path.read_bytes() == corpus_file.read_bytes()
    corpus_file.write_text(PYTHONISH + "x = 1\n")  # the source changed: prepared again
    assert text.prepare(f"text:{corpus_file}").path != first.path
    corpus = text.TextCorpus(f"text:{corpus_file}", seq_len=16)
    assert isinstance(corpus.tokens, __import__("numpy").memmap)


def test_utf8_is_checked_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "CHUNK", 3)
    ok = tmp_path / "ok.txt"
    ok.write_text("aé€b" * 5)  # 2- and 3-byte characters across every boundary
    assert text.prepare(f"text:{ok}").path.read_bytes() == ok.read_bytes()
    bad = tmp_path / "bad.txt"
    bad.write_bytes("abcdé".encode() + b"\xff" + b"xyz")
    with pytest.raises(ValueError, match=r"bad.txt is not UTF-8 text \(byte 0xff at offset 6\)"):
        text.prepare(f"text:{bad}")
    cut = tmp_path / "cut.txt"
    cut.write_bytes("abé".encode()[:-1])
    with pytest.raises(ValueError, match="ends inside a character"):
        text.prepare(f"text:{cut}")
    assert not list(text.cache_dir().glob("*.tmp"))  # no half-written file left behind


@pytest.mark.parametrize("data, flags, message", [
    ("text:{bad}", {}, r"is not UTF-8 text \(byte 0xff at offset 2\): convert it"),
    ("text:{short}", {}, "holds 5 tokens \\(bytes\\), fewer than one sequence of 33"),
    ("text:{missing}", {}, "no such file or folder"),
    ("shakespeare", {}, "choose synthetic, stdlib .* or text:PATH"),
    ("text:{good}", {"vocab": 512}, "a vocabulary of 256: drop --vocab 512"),
    ("text:{good}", {"batching": "pad"}, "use --batching fixed, not pad"),
])
def test_bad_text_is_refused_before_any_rank_starts(tmp_path, data, flags, message):
    (tmp_path / "bad.txt").write_bytes(b"ok\xffno")
    (tmp_path / "short.txt").write_text("short")
    (tmp_path / "good.txt").write_text(PYTHONISH)
    paths = {k: tmp_path / f"{k}.txt" for k in ("bad", "short", "missing", "good")}
    with pytest.raises(ValueError, match=message):
        check_args(Run.of(data=data.format(**paths), dp=2, **flags))


def test_the_python_standard_library_is_a_corpus_every_machine_has():
    root, files = text.sources(text.STDLIB)
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any(part in ("test", "site-packages") for f in files
                   for part in f.relative_to(root).parts)
    assert model_config(Run.of(data="stdlib", model="small")).vocab_size == 256


def test_batches_depend_on_the_step_not_the_layout(corpus_file):
    corpus = text.TextCorpus(f"text:{corpus_file}", seq_len=16, seed=3)
    x, y = corpus.batch(5, 8)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(text.TextCorpus(f"text:{corpus_file}", 16, seed=3).batch(5, 8)[0], x)
    assert not torch.equal(corpus.batch(6, 8)[0], x)
    window = text.decode(torch.cat([x[0], y[0, -1:]]))
    assert window in PYTHONISH + PYTHONISH[:17]


def test_text_trains_the_same_on_dp_x_cp_as_serially_and_generates_text(corpus_file,
                                                                          tmp_path, capsys):
    """One parity case on text (dp 2 x cp 2, 4 ranks, against the serial loop: losses and
    gradient norms of 3 steps, 1e-5), then edu3d generate from the serial run's checkpoint."""
    flags = dict(data=f"text:{corpus_file}", layers=2, d_model=32, heads=4, seq=16,
                 global_batch=4, steps=3)
    serial = train(Run.of(ckpt_dir=str(tmp_path / "ck"), **flags), out=io.StringIO())
    parallel = train(Run.of(dp=2, cp=2, **flags), out=io.StringIO())
    for a, b in zip(parallel, serial, strict=True):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-5, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] < 1e-5, (a, b)
    assert serial[0]["loss"] == pytest.approx(5.55, abs=0.1)  # ln(256): bytes, untrained
    capsys.readouterr()
    assert cli.main(["generate", "--ckpt", str(tmp_path / "ck"), "--prompt", "def ",
                     "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def ") and len(printed.encode()) >= len("def ") + 1
    assert cli.main(["generate", "--ckpt", str(tmp_path / "ck"), "--prompt", "déf",
                     "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt"] == text.encode("déf") and len(out["tokens"]) == 4
    assert out["text"] == text.decode(out["tokens"])
    assert os.environ["EDU3D_DATA"] in str(text.cache_dir())  # tests keep the cache in tmp


def test_chapter_00_trains_the_tiny_model_on_text_with_progress_and_samples_text(corpus_file):
    """Chapter 00's last section, cut to 3 steps on a small file: the progress lines, a first
    loss of ln 256, a seeded sample that continues the prompt, a takeaway about what the
    model wrote (the prompt left out)."""
    lines = []
    got = chapter.train_on_text(seconds=0, min_steps=3, every=0, out=lines.append,
                                data=f"text:{corpus_file}", layers=2, d_model=32, heads=4,
                                seq=16, global_batch=4)
    assert len(got["losses"]) == 3 and got["tokens"] == 3 * 4 * 16
    assert got["losses"][0] == pytest.approx(5.55, abs=0.1)
    assert "ln 256 = 5.55" in lines[0] and lines[-1].startswith("3 steps, 192 tokens")
    assert [line.split()[3] for line in lines[1:-1]] == ["1", "2", "3"]  # "T s  step N  loss"
    written = chapter.sample(got["model"], "def ", new_tokens=8)
    assert written.startswith("def ") and len(written.encode()) >= 12
    assert chapter.sample(got["model"], "def ", new_tokens=8) == written  # seeded
    said = chapter.sample_takeaway("def f(self): return x", prompt="def ")
    assert "return" in said and "self" in said and "def" not in said.split(": ")[-1]


def test_chapter_00_trains_for_a_minute_unless_told(monkeypatch):
    monkeypatch.delenv("EDU3D_TEXT_SECONDS", raising=False)
    assert chapter.text_seconds() == 60.0
    monkeypatch.setenv("EDU3D_TEXT_SECONDS", "15")
    assert chapter.text_seconds() == 15.0
    for bad in ("0", "-3", "soon", "nan", "7200"):
        monkeypatch.setenv("EDU3D_TEXT_SECONDS", bad)
        with pytest.raises(ValueError, match=f"EDU3D_TEXT_SECONDS={bad!r}: give the seconds"):
            chapter.text_seconds()
