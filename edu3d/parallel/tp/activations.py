"""Activation memory of one transformer layer under TP and SP, measured and predicted.

After reading this file you should understand:

* what "activation memory" is: the tensors autograd keeps from the forward pass for the
  backward pass. :func:`saved_activation_bytes` counts exactly those, by hooking every save
  (``torch.autograd.graph.saved_tensors_hooks``), each storage once, parameters excluded;
* Korthikanti et al. (2022) count, per layer, in 16-bit: ``sbh(34 + 5as/h)`` serial,
  ``sbh(10 + 24/t + 5as/(ht))`` with TP (LayerNorm inputs, the QKV and MLP inputs stay
  whole on every rank: the ``10``), and ``sbh/t(34 + 5as/h)`` with TP+SP (everything split);
* how that formula maps onto this course's model
  (:func:`edu3d.plan.formulas.layer_activation_bytes`; the paper's is
  :func:`edu3d.plan.formulas.activation_bytes_per_layer`): 4-byte
  fp32 values instead of 2-byte ones (x2), no dropout (its two ``sbh`` masks and the
  ``as²b`` mask go), and fused attention, which keeps no ``s x s`` score matrix (the
  ``5as/h`` term) but one log-sum-exp per head and token. What remains is the paper's term
  list, value for value, plus the LayerNorms' per-token mean and 1/std;
* the collectives one layer issues (:func:`block_collectives`): without SP two all-reduces
  forward and two backward; with SP an all-gather and a reduce-scatter in each direction per
  sub-layer, plus the all-gathers that re-build the sharded input for the weight gradient.
"""

from __future__ import annotations

from collections import Counter

import torch

from edu3d.distributed import trace
from edu3d.distributed.meter import measure_activations
from edu3d.model.gpt import GPT, GPTConfig
from edu3d.parallel.tp.apply import apply_tp


def saved_activation_bytes(module: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes autograd saves while ``module(x)`` runs (each storage once, parameters not
    counted), and the output."""
    out = {}

    def forward():
        out["y"] = module(x)

    return measure_activations(forward, exclude=module.parameters()), out["y"]


def tp_block(config: GPTConfig, mesh, sp: bool, seed: int):
    """Block 0 of the GPT of ``config`` and ``seed``, tensor-parallel over ``mesh``."""
    model = GPT(config, seed)
    apply_tp(model, mesh, sequence_parallel=sp)
    return model.blocks[0]


def block_input(config: GPTConfig, batch: int, mesh, sp: bool, seed: int = 0) -> torch.Tensor:
    """A deterministic residual-stream input ``[b, s, h]`` (this rank's tokens under SP)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, config.seq_len, config.d_model, generator=g)
    if sp:
        t = mesh.size("tp")
        x = x.chunk(t, dim=1)[mesh.index("tp")]
    return x.contiguous().requires_grad_()


def measure_layer(mesh, config: GPTConfig, batch: int, sp: bool, seed: int = 0) -> dict:
    """Run one TP(+SP) layer on every rank: the bytes it saved for backward (the formulas to
    hold them against are :mod:`edu3d.plan.formulas`')."""
    block = tp_block(config, mesh, sp, seed)
    measured, _ = saved_activation_bytes(block, block_input(config, batch, mesh, sp, seed))
    return {"tp": mesh.size("tp"), "sp": sp, "measured": measured}


def block_collectives(mesh, config: GPTConfig, batch: int, sp: bool, seed: int = 0) -> dict:
    """The tp collectives of one layer's forward and backward, counted from the trace."""
    block = tp_block(config, mesh, sp, seed)
    x = block_input(config, batch, mesh, sp, seed)
    counts = {}
    with trace.use(trace.Recorder(mesh.rank)) as rec:
        y = block(x)
        counts["forward"] = Counter(e["op"] for e in rec.events if e["lane"] == "comm")
        rec.events.clear()
        y.backward(torch.ones_like(y))
        counts["backward"] = Counter(e["op"] for e in rec.events if e["lane"] == "comm")
    return {phase: dict(sorted(c.items())) for phase, c in counts.items()}
