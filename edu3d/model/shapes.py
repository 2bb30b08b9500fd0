"""Model shapes: the course's GPTs and real models, as published, counted without torch.

After reading this file you should understand what fixes a transformer's memory: its layers,
width, heads (and grouped KV heads), MLP width and kind (GELU's two matrices, SwiGLU's
three), norms, biases, vocabulary, and whether the head is tied to the embedding. The real
models' shapes are the published ones (GPT-2 small/medium/large/XL, LLaMA-2 7B/13B/70B,
GPT-3 175B) and their parameter counts match the papers' within 1% (tests/test_planner.py);
the course's presets are :data:`edu3d.model.config_schema.PRESETS`, counted exactly (that
module has no torch: ``edu3d plan`` and ``edu3d train``'s checks before launch start without
it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from edu3d.model.config_schema import PRESETS as COURSE_CONFIGS


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's published shape (enough to count every byte)."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
    d_ff: int | None = None  # default 4 * d_model
    n_kv_heads: int | None = None  # grouped-query attention (LLaMA-2 70B: 8)
    mlp: str = "gelu"  # or "swiglu" (three matrices)
    norm: str = "layernorm"  # or "rmsnorm" (a gain, no bias)
    bias: bool = True
    tied: bool = False
    learned_pos: bool = True  # a position table (GPT); RoPE has none
    course: bool = False  # edu3d's own GPT: the exact fp32 activation count applies
    global_batch: int = 8  # sequences per step (the published batch for real models)

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def layer_tensors(self, t: int = 1) -> list[tuple[str, int, bool]]:
        """``(name, elements on one tp rank, is a matrix)`` of one layer, in module order."""
        h, f, hd = self.d_model, self.ff, self.d_model // self.n_heads
        qkv = h + 2 * self.kv_heads * hd  # output features of the fused q|k|v
        norm = [("w", h, False)] + ([("b", h, False)] if self.norm == "layernorm" else [])
        bias = self.bias
        out = [(f"ln1.{n}", k, m) for n, k, m in norm]
        out += [("qkv.w", qkv * h // t, True)] + ([("qkv.b", qkv // t, False)] if bias else [])
        out += [("proj.w", h * h // t, True)] + ([("proj.b", h, False)] if bias else [])
        out += [(f"ln2.{n}", k, m) for n, k, m in norm]
        if self.mlp == "swiglu":
            out += [("gate.w", f * h // t, True), ("up.w", f * h // t, True),
                    ("down.w", h * f // t, True)]
        else:
            out += [("fc.w", f * h // t, True)] + ([("fc.b", f // t, False)] if bias else [])
            out += [("fc2.w", h * f // t, True)] + ([("fc2.b", h, False)] if bias else [])
        return out

    def vocab_rows(self, t: int = 1) -> int:
        """Vocabulary rows on one tp rank (padded to a multiple of tp, as Megatron does)."""
        return math.ceil(self.vocab_size / t)

    def num_params(self) -> int:
        """Parameters of the whole model (a tied head counted once)."""
        layer = sum(n for _, n, _ in self.layer_tensors())
        norm = self.d_model * (2 if self.norm == "layernorm" else 1)
        emb = self.vocab_size * self.d_model + (self.seq_len * self.d_model
                                                if self.learned_pos else 0)
        return self.n_layers * layer + norm + emb + (0 if self.tied else
                                                     self.vocab_size * self.d_model)


def _course(name: str, tie: bool | None = None) -> ModelSpec:
    spec = spec_from_config(COURSE_CONFIGS[name], name)
    return spec if tie is None else dataclasses.replace(spec, tied=tie)


def spec_from_config(config, name: str = "course") -> ModelSpec:
    """The shape of one of this course's :class:`~edu3d.model.gpt.GPTConfig` (any overrides)."""
    return ModelSpec(name, config.n_layers, config.d_model, config.n_heads, config.seq_len,
                     config.padded_vocab, tied=config.tie_weights, course=True)


def num_params_from_config(config) -> int:
    """The parameter count of :class:`~edu3d.model.gpt.GPT` from its config, no model built."""
    return spec_from_config(config).num_params()


def padded_size(size: int, tp: int) -> int:
    """``size`` rounded up to a multiple of ``tp`` (Megatron pads the vocabulary this way)."""
    return -(-size // tp) * tp


def _gpt2(name, layers, d, heads):
    return ModelSpec(name, layers, d, heads, 1024, 50257, tied=True, global_batch=512)


def _llama2(name, layers, d, heads, ff, kv=None):
    return ModelSpec(name, layers, d, heads, 4096, 32000, d_ff=ff, n_kv_heads=kv, mlp="swiglu",
                     norm="rmsnorm", bias=False, learned_pos=False, global_batch=1024)


COURSE_PRESETS = ("tiny", "small", "medium", "gpt2-small")
REAL = {  # published shapes; PUBLISHED_PARAMS is what the papers report
    "gpt2": _gpt2("gpt2", 12, 768, 12), "gpt2-medium": _gpt2("gpt2-medium", 24, 1024, 16),
    "gpt2-large": _gpt2("gpt2-large", 36, 1280, 20), "gpt2-xl": _gpt2("gpt2-xl", 48, 1600, 25),
    "llama2-7b": _llama2("llama2-7b", 32, 4096, 32, 11008),
    "llama2-13b": _llama2("llama2-13b", 40, 5120, 40, 13824),
    "llama2-70b": _llama2("llama2-70b", 80, 8192, 64, 28672, kv=8),
    "gpt3-175b": ModelSpec("gpt3-175b", 96, 12288, 96, 2048, 50257, tied=True,
                           global_batch=1536),
}
PUBLISHED_PARAMS = {"gpt2": 124e6, "gpt2-medium": 355e6, "gpt2-large": 774e6,
                    "gpt2-xl": 1.56e9, "llama2-7b": 6.74e9, "llama2-13b": 13.0e9,
                    "llama2-70b": 69.0e9, "gpt3-175b": 175e9}
PRESETS = (*COURSE_PRESETS, *REAL)


def spec_from(preset: str, **overrides) -> ModelSpec:
    """A preset with fields overridden (``None`` keeps the preset's value): ``n_layers``,
    ``n_heads``, ``d_model``, ``seq_len``, ``vocab_size``, ``tied``, ``n_kv_heads``, ``d_ff``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model {preset!r}; choose one of {', '.join(PRESETS)}")
    spec = _course(preset) if preset in COURSE_PRESETS else REAL[preset]
    spec = dataclasses.replace(spec, **{k: v for k, v in overrides.items() if v is not None})
    if spec.d_model % spec.n_heads or spec.n_heads % spec.kv_heads:
        raise ValueError(f"n_heads={spec.n_heads} must divide d_model={spec.d_model} and be a "
                         f"multiple of n_kv_heads={spec.kv_heads}")
    return spec


def spec_for_params(n: float, seq: int = 2048, vocab: int = 50257) -> ModelSpec:
    """A GPT-3-shaped model of about ``n`` parameters: ``12·L·h²`` with ``h ≈ 128·L``
    (GPT-3's width per layer), heads of 128 dimensions, ``h`` rounded so that the heads
    split 8 ways (a multiple of 1024; of 128 below that), the layers then fitted to ``n``."""
    if n < 1e8:
        raise ValueError(f"--params {n:g}: give at least 1e8 parameters (e.g. 7e9); below "
                         "that the vocabulary's tables dominate: use --model with overrides")
    ideal = (n * 128 / 12) ** (1 / 3)
    step = 1024 if ideal >= 1024 else 128
    h = max(128, round(ideal / step) * step)
    layers = max(1, round((n - 2 * vocab * h) / (12 * h * h)))
    return ModelSpec(f"{n / 1e9:.3g}B", layers, h, h // 128, seq, vocab, global_batch=1024)
