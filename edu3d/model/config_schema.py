"""The course GPT's description (:class:`GPTConfig`, its presets), what it may hold, and what
it implies, without a model (no torch: a refused command line never waits for torch).

After reading this file you should understand why a model's description is checked like any
other input before a single multiplication is done with it, and what it fixes:

* **every field has a range** (:func:`check_ranges`), checked before any arithmetic: a
  config read from a file (a checkpoint's manifest) may say ``d_model=1000000007`` or
  ``vocab_size=10**9``, and the arithmetic that follows (a divisor list, a table of
  ``vocab x d_model`` numbers) would run for minutes or ask for terabytes. The ranges are
  generous beyond any model edu3d describes (GPT-3's ``d_model`` is 12,288, the largest
  vocabularies about 256,000; ``edu3d train``'s options stop within them); the number of
  parameter tensors is bounded too (a layer of ``E`` experts has ``E`` of each expert's
  tensors);
* **the advice when the heads do not divide the width** (:func:`divisors_of`): the
  divisors of ``n`` come in pairs ``(d, n // d)`` with ``d <= √n``, so listing them takes
  ``√n`` divisions, not ``n``, and the list shown is capped;
* **every parameter's name and shape** (:func:`param_shapes`): what ``GPT(config)``'s
  ``named_parameters()`` gives, computed from the config alone, so a reader can check that a
  checkpoint's pieces describe *this* model before it allocates a tensor of theirs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

INT_RANGES = {"n_layers": (1, 4096), "n_heads": (1, 2**20), "d_model": (1, 2**20),
              "seq_len": (1, 2**21), "vocab_size": (1, 2**24), "vocab_pad": (1, 2**16),
              "n_experts": (0, 4096), "topk": (1, 4096), "moe_every": (1, 4096),
              "shared_experts": (0, 4096)}
FLOAT_RANGES = {"capacity_factor": 1e6, "aux_loss_coef": 1e6, "z_loss_coef": 1e6,
                "bias_rate": 1e6}  # each in 0..this, finite
BOOLS = ("tie_weights", "norm_topk")
MAX_TENSORS = 2**16  # n_layers * (1 + n_experts + shared_experts): the parameter tensors
MAX_SHOWN = 16  # divisors listed in an error; more are elided
SCOPES = ("microbatch", "sequence", "global")  # the tokens the aux loss counts (model/balance)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:20]}...({len(text)} characters)"


def check_ranges(config) -> None:
    """Raise ``ValueError`` (one line naming the field and its range) unless every field of
    ``config`` has its type and lies in its range; only comparisons, no arithmetic, until
    each field is known to be in range."""
    for name, (low, high) in INT_RANGES.items():
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            what = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise ValueError(f"{name}={_short(value)} must be {what}")
        if value > high:
            raise ValueError(f"{name}={_short(value)} must be at most {high:,} (the most "
                             "edu3d describes)")
    for name, high in FLOAT_RANGES.items():
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not (math.isfinite(value) and 0 <= value <= high):
            raise ValueError(f"{name}={_short(value)} must be a finite number in 0..{high:g}")
    for name in BOOLS:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name}={_short(getattr(config, name))} must be true or false")
    tensors = config.n_layers * (1 + config.n_experts + config.shared_experts)
    if tensors > MAX_TENSORS:
        raise ValueError(f"n_layers * (1 + n_experts + shared_experts) = {tensors:,} is above "
                         f"{MAX_TENSORS:,}: fewer layers or experts")


def divisors_of(n: int) -> list[int]:
    """The divisors of ``n >= 1``, smallest first, in ``√n`` divisions: each ``d <= √n``
    brings its partner ``n // d``."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def divisor_advice(n: int) -> str:
    """``"1, 2, 4, 8"``: the divisors of ``n``, at most :data:`MAX_SHOWN` of them (the
    smallest and the largest, the middle elided)."""
    found = divisors_of(n)
    if len(found) > MAX_SHOWN:
        half = MAX_SHOWN // 2
        return (", ".join(map(str, found[:half])) + f", ... ({len(found) - MAX_SHOWN} more), "
                + ", ".join(map(str, found[-half:])))
    return ", ".join(map(str, found))


def param_shapes(config) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every parameter of ``GPT(config)``, in ``named_parameters()``
    order (a tied head is the embedding: listed once), from a config that passed
    :func:`check_ranges`."""
    d, ff, vocab = config.d_model, config.d_ff, config.padded_vocab

    def linear(prefix: str, n_in: int, n_out: int, bias: bool = True) -> dict:
        return {f"{prefix}.weight": (n_out, n_in), **({f"{prefix}.bias": (n_out,)} if bias
                                                       else {})}

    def mlp(prefix: str) -> dict:
        return {**linear(f"{prefix}.fc", d, ff), **linear(f"{prefix}.proj", ff, d)}

    shapes = {"tok_emb.weight": (vocab, d), "pos_emb.weight": (config.seq_len, d)}
    for i in range(config.n_layers):
        b = f"blocks.{i}"
        shapes.update({f"{b}.ln1.weight": (d,), f"{b}.ln1.bias": (d,),
                       **linear(f"{b}.attn.qkv", d, 3 * d), **linear(f"{b}.attn.proj", d, d),
                       f"{b}.ln2.weight": (d,), f"{b}.ln2.bias": (d,)})
        if config.is_moe_layer(i):
            shapes.update(linear(f"{b}.mlp.router", d, config.n_experts, bias=False))
            for e in range(config.n_experts):
                shapes.update(mlp(f"{b}.mlp.experts.{e}"))
            for s in range(config.shared_experts):
                shapes.update(mlp(f"{b}.mlp.shared.{s}"))
        else:
            shapes.update(mlp(f"{b}.mlp"))
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    if not config.tie_weights:
        shapes["lm_head.weight"] = (vocab, d)
    return shapes


@dataclass
class GPTConfig:
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 64
    seq_len: int = 32
    vocab_size: int = 256
    tie_weights: bool = False  # lm_head reuses the token embedding matrix (GPT-2 does)
    vocab_pad: int = 1  # the tables get padded_vocab rows, a multiple of this (64: GPU tiles)
    # Mixture of experts (edu3d.model.moe); n_experts = 0 keeps every block's dense MLP.
    n_experts: int = 0          # routed experts per MoE layer
    topk: int = 2               # experts each token is sent to
    moe_every: int = 1          # block i is MoE iff i % moe_every == 0 (Megatron's moe_layer_freq)
    shared_experts: int = 0     # always-on experts every token also goes through (DeepSeek)
    capacity_factor: float = 0.0  # 0: dropless; C > 0: each expert takes ceil(N*k/E*C)
    aux_loss_coef: float = 1e-2   # Switch/GShard load-balancing loss weight
    aux_scope: str = "microbatch"  # the tokens it counts: "microbatch", "sequence", "global"
    z_loss_coef: float = 0.0      # ST-MoE router z-loss weight
    balance: str = "aux"        # "aux" (loss only) or "bias" (DeepSeek-V3 selection bias)
    bias_rate: float = 1e-3     # step of the "bias" balancer's update
    norm_topk: bool = True      # renormalise the k gates to sum to 1 (when k > 1)
    router_dtype: str = "fp32"  # "fp32" or "fp64" (parity tests: near-ties do not flip)

    def __post_init__(self):
        check_ranges(self)  # every field in its range before any arithmetic on it
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                             f"choose one of {divisor_advice(self.d_model)}")
        self.check_moe()

    def check_moe(self) -> None:
        """The mixture-of-experts fields that ranges alone do not settle (those are in
        :func:`~edu3d.model.config_schema.check_ranges`), with what to change."""
        if self.n_experts and self.topk > self.n_experts:
            raise ValueError(f"topk={self.topk} is more than n_experts={self.n_experts}: a "
                             f"token cannot pick more experts than there are")
        if self.balance not in ("aux", "bias"):
            raise ValueError(f"balance={self.balance!r}: choose 'aux' (the loss alone) or "
                             f"'bias' (DeepSeek-V3's selection bias)")
        if self.aux_scope not in SCOPES:
            raise ValueError(f"aux_scope={self.aux_scope!r}: choose one of {', '.join(SCOPES)}")
        if self.router_dtype not in ("fp32", "fp64"):
            raise ValueError(f"router_dtype={self.router_dtype!r}: choose 'fp32' or 'fp64'")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` has a mixture of experts instead of the dense MLP."""
        return self.n_experts > 0 and layer % self.moe_every == 0

    @property
    def padded_vocab(self) -> int:
        """Rows of the token embedding and the LM head: ``vocab_size`` rounded up to a
        multiple of ``vocab_pad`` (nanoGPT's 50,257 -> 50,304). The extra rows are never a
        token: their logits are -inf (:meth:`GPT.head`), so they never win and the loss is
        the unpadded model's."""
        return -(-self.vocab_size // self.vocab_pad) * self.vocab_pad

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def block_params(self) -> int:
        """Parameters of one block: qkv ``3d²+3d``, proj ``d²+d``, fc ``4d²+4d``, its proj
        ``4d²+d``, two LayerNorms ``4d``."""
        d = self.d_model
        return 12 * d * d + 13 * d


PRESETS = {
    "tiny": GPTConfig(n_layers=4, n_heads=4, d_model=64, seq_len=32, vocab_size=256),
    "small": GPTConfig(n_layers=6, n_heads=8, d_model=256, seq_len=128, vocab_size=1024),
    "medium": GPTConfig(n_layers=8, n_heads=8, d_model=512, seq_len=256, vocab_size=4096),
    "gpt2-small": GPTConfig(n_layers=12, n_heads=12, d_model=768, seq_len=1024,
                            vocab_size=50257, tie_weights=True),
}


def config_from(preset: str = "tiny", *, layers: int | None = None, heads: int | None = None,
                d_model: int | None = None, seq: int | None = None, vocab: int | None = None,
                tie: bool | None = None, vocab_pad: int | None = None) -> GPTConfig:
    """A preset with some fields overridden (``None`` keeps the preset's value)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    overrides = {"n_layers": layers, "n_heads": heads, "d_model": d_model, "seq_len": seq,
                 "vocab_size": vocab, "tie_weights": tie, "vocab_pad": vocab_pad}
    return dataclasses.replace(PRESETS[preset],
                               **{k: v for k, v in overrides.items() if v is not None})
