"""``Zero`` saves and resumes like a real tool, at stages 1, 2 and 3.

* two AdamW steps, ``model.state_dict()`` and ``zero.state_dict()`` (sharded, and
  ``full=True``) through ``torch.save``/``torch.load``, a fresh model and ``Zero``,
  ``model.load_state_dict`` + ``zero.load_state_dict``, two more steps: bitwise equal to four
  uninterrupted steps, and to one process within the library test's tolerance;
* the full form has FSDP2's format (``get_optimizer_state_dict(..., full_state_dict=True)``
  of the one-process reference: same names, shapes, dtypes, param groups, values);
* saved at world 2, it resumes at world 1 in plain torch AdamW and in a 1-rank ``Zero``; a
  sharded state refuses another world size, naming the full form;
* ZeRO-3's ``load_state_dict`` keeps ``strict`` and shape checks, ``strict=False`` keeps the
  keys it lacks, offload's host copy follows, nothing stays gathered;
* ZeRO-3 with ``find_unused_parameters=True`` while the used modules change from step to
  step (a skipped block, a head unit whose last module does not run), with and without
  prefetch: nothing stays gathered after a forward or a step, and the result equals one process.
"""

import functools

import pytest

from edu3d.launch import launch
from tests.workers_zero_resume import partial_use_worker, resume_worker, world_one_worker

TOL = 1e-12  # as tests/test_library_zero.py (measured 0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zero-resume") / "zero3-world2.pt")


@functools.lru_cache(maxsize=None)
def world2(path):
    return launch(resume_worker, 2, args=(path,), timeout=240, name="zero-resume",
                  echo=False).results


@functools.lru_cache(maxsize=None)
def world1(path):
    world2(path)  # writes the checkpoint
    return launch(world_one_worker, 1, args=(path,), timeout=240, name="zero-resume-1",
                  echo=False).results[0]


@functools.lru_cache(maxsize=None)
def partial():
    return launch(partial_use_worker, 2, timeout=240, name="zero-partial", echo=False).results


def test_resume_is_bitwise_the_uninterrupted_run(ckpt):
    for rank, res in enumerate(world2(ckpt)):
        resumed = {k: v for k, v in res.items() if k.endswith("resumed_vs_straight")}
        assert len(resumed) == 3 * 2 + 1, sorted(resumed)
        print(f"rank {rank}: resumed vs straight {resumed}")
        assert all(v == 0.0 for v in resumed.values()), resumed  # bitwise
        loaded = {k: v for k, v in res.items() if k.endswith("loaded_vs_saved")}
        assert len(loaded) == 6 and all(v == 0.0 for v in loaded.values()), loaded
        for stage in (1, 2, 3):
            assert res[f"zero{stage}/straight_vs_one_process"] < TOL
        assert res["zero3/sharded/freed_after_load"] and res["zero3/full/freed_after_load"]


def test_full_form_is_fsdp2s_and_resumes_at_world_one(ckpt):
    for res in world2(ckpt):
        for stage in (1, 2, 3):
            assert res[f"zero{stage}/full_vs_fsdp_format"] < TOL
            assert res[f"zero{stage}/groups_as_fsdp"]
    one = world1(ckpt)
    print(one)
    assert one["plain_torch/resumed_vs_one_process"] < TOL
    assert one["zero3_world1/resumed_vs_one_process"] < TOL
    assert "full=True" in one["sharded_wrong_world"], one["sharded_wrong_world"]


def test_zero3_load_keeps_torch_checks_and_frees(ckpt):
    for res in world2(ckpt):
        assert "Missing key(s)" in res["zero3/missing_key"] and "out.bias" in res["zero3/missing_key"]
        assert "size mismatch for inp.weight" in res["zero3/size_mismatch"]
        assert res["zero3/freed_after_error"]
        assert res["zero3/partial_kept"] == 0.0 and res["zero3/partial_loaded"] == 0.0
        assert res["zero3/offload_host_matches"] == 0.0


def test_zero3_partial_use_frees_and_matches_one_process():
    for res in partial():
        for prefetch in (False, True):
            r = res[f"prefetch={prefetch}"]
            print(prefetch, r)
            assert r["after_forward"] == [[]] * 4 and r["after_step"] == [[]] * 4, r
            assert r["after_eval"] == [], r
            assert r["vs_one_process"] < TOL
            assert r["skip_moved"] > 1e-3  # used on even steps, so it trains
