"""What a :class:`~edu3d.model.gpt.GPTConfig` may hold, and what it implies, without a model.

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

import math

INT_RANGES = {"n_layers": (1, 4096), "n_heads": (1, 2**20), "d_model": (1, 2**20),
              "seq_len": (1, 2**21), "vocab_size": (1, 2**24), "vocab_pad": (1, 2**16),
              "n_experts": (0, 4096), "topk": (1, 4096), "moe_every": (1, 4096),
              "shared_experts": (0, 4096)}
FLOAT_RANGES = {"capacity_factor": 1e6, "aux_loss_coef": 1e6, "z_loss_coef": 1e6,
                "bias_rate": 1e6}  # each in 0..this, finite
BOOLS = ("tie_weights", "norm_topk")
MAX_TENSORS = 2**16  # n_layers * (1 + n_experts + shared_experts): the parameter tensors
MAX_SHOWN = 16  # divisors listed in an error; more are elided


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
