"""What only a GPU shows: NCCL, CUDA-event timing, bf16. Skipped cleanly without CUDA."""

import pytest
import torch

from edu3d.distributed import runtime
from edu3d.launch import launch
from edu3d.model.gpt import GPT, config_from
from tests import workers

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_backend_is_nccl_when_each_rank_has_a_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("EDU3D_BACKEND", raising=False)
    assert runtime.choose_backend() == "nccl"


def test_nccl_all_reduce_traced_with_cuda_events():
    n = min(torch.cuda.device_count(), 2)  # NCCL refuses two ranks on one GPU
    res = launch(workers.cuda_all_reduce, n, timeout=300, echo=False)
    assert all(r["backend"] == "nccl" and r["value"] == n * (n + 1) / 2 for r in res.results)
    events = [e for e in res.events() if e["op"] == "all_reduce"]
    assert len(events) == n and all(e["t1"] > e["t0"] >= 0 for e in events)


def test_bf16_forward_close_to_fp32():
    cfg = config_from("tiny")
    model = GPT(cfg, seed=0).cuda()
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), device="cuda")
    _, loss32 = model(idx, idx)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss16 = model(idx, idx)
    assert abs(loss16.item() - loss32.item()) < 2e-2 * loss32.item()
