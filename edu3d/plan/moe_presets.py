"""Published mixtures of experts as the planner counts them: Mixtral 8x7B and DeepSeek-V3.

After reading this file you should know what a published MoE shape fixes for memory and
time: its dense part (layers, width, heads, grouped KV heads, vocabulary), where its MoE
blocks start, how many routed experts each has and how wide, how many a token picks (top-k)
and how many are always on (shared). :data:`MOE_PRESETS` are those shapes, as
:class:`~edu3d.plan.formulas.MoESpec`; :data:`MOE_PUBLISHED` the parameter counts the
papers report (total, active per token), which ``tests/test_planner_5d.py`` holds the count
to. ``edu3d plan --model mixtral-8x7b`` starts from one; a notebook imports them from here.
The dense models' presets are :mod:`edu3d.model.shapes`'.
"""

from __future__ import annotations

from edu3d.plan.formulas import MoESpec


def _moe(name, layers, d, heads, vocab, ff, batch, **moe):
    return MoESpec(name, layers, d, heads, 4096, vocab, d_ff=ff, mlp="swiglu", norm="rmsnorm",
                   bias=False, learned_pos=False, global_batch=batch, **moe)


MOE_PRESETS = {  # published shapes; MOE_PUBLISHED: (total, active) parameters as reported
    # Mixtral 8x7B (Jiang et al. 2024): 8 SwiGLU experts of 14336, top-2, GQA with 8 KV heads
    "mixtral-8x7b": _moe("mixtral-8x7b", 32, 4096, 32, 32000, 14336, 1024, n_kv_heads=8,
                         experts=8, topk=2),
    # DeepSeek-V3 (2024): 3 dense blocks (MLP 18432), then 256 routed experts of 2048, top-8,
    # plus 1 shared; its multi-head latent attention counted as MLA, modelled as standard
    # attention (128 heads x 7168) for activations and FLOPs; 4096-token sequences, 15360 a step
    "deepseek-v3": _moe("deepseek-v3", 61, 7168, 128, 129280, 18432, 15360, experts=256, topk=8,
                        dense_first=3, shared_experts=1, expert_ff=2048,
                        mla=(1536, 512, 128, 64, 128)),
}
MOE_PUBLISHED = {"mixtral-8x7b": (46.7e9, 12.9e9), "deepseek-v3": (671e9, 37e9)}
