"""The serial reference GPT: the model every parallel layout is compared against.

After reading this file you should understand:

* a GPT is an embedding, a stack of identical pre-LayerNorm blocks (attention then MLP, each
  added back onto the residual stream) and a head that turns the stream into logits;
* the forward pass is split into ``embed``, the blocks and ``head`` so that a pipeline stage
  can run just its piece, and tensor parallelism can cut the same ``nn.Linear`` weights;
* the initial weights depend only on ``(config, seed)``: they are drawn from a private
  ``torch.Generator`` in ``named_parameters()`` order, never from the global RNG. That is what
  lets a parallel run cut its shards out of exactly the weights the serial run starts from;
* how many parameters the model has and how many FLOPs one training token costs;
* how several documents share one packed sequence (``--batching pack``): ``doc`` gives each
  token its document, and :func:`document_mask` lets a token attend only to earlier tokens
  *of its own document* (a block-diagonal causal mask) while :func:`document_positions`
  restarts the positions at each document's first token. Without ``doc`` nothing changes:
  the plain causal kernel, positions ``0..T-1``.

There is no parallel code here, and no dropout (parity tests need determinism). The model's
description (:class:`GPTConfig`, the presets, :func:`config_from`) lives in
:mod:`edu3d.model.config_schema`, without torch, and is importable from here too.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from edu3d.model.config_schema import PRESETS, GPTConfig, config_from  # noqa: F401 (re-exported)
from edu3d.model.moe import MoE, active_params


class CausalSelfAttention(nn.Module):
    """Multi-head attention where each token sees only itself and earlier tokens.

    ``qkv`` is one fused ``Linear(d, 3d)`` whose output is laid out ``[q | k | v]``, each ``d``
    wide with the heads contiguous inside it (head ``i`` is columns ``i*hd:(i+1)*hd``). Tensor
    parallelism relies on this layout: giving each rank whole heads means cutting the same
    head range out of q, k and v.
    """

    kind = "sdpa"  # or "explicit" (:func:`set_attention`)

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        # [B, T, heads * hd] -> [B, heads, T, hd]: the heads attend independently.
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v) if mask is None else self.core(q, k, v, mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """The attention core, ``softmax(QK^T / sqrt(hd) + causal mask) V`` per head, on
        ``[B, heads, T, hd]`` tensors: the only part of the layer whose work grows with
        ``T^2``. It is a method of its own so that selective recomputation
        (:mod:`edu3d.parallel.recompute`) can recompute exactly this in backward.

        PyTorch's fused kernel (flash or memory-efficient attention on a GPU) never
        materialises the ``T x T`` scores: it keeps q, k, v, its output and one log-sum-exp
        per head and token for backward. ``kind == "explicit"`` computes the same numbers the
        textbook way (:func:`explicit_attention`). ``mask`` (``[B, 1, T, T]``, True where a
        query may see a key, :func:`document_mask`) replaces the causal mask for packed
        documents."""
        if self.kind == "explicit":
            return explicit_attention(q, k, v, mask)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(QK^T / sqrt(hd) + causal mask) V`` written out: the ``[B, heads, T, T]``
    scores exist as a tensor (a chapter can show them), the softmax in fp32. Equal to
    ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` (tests/test_fast_path.py);
    ``mask`` (True: may attend) replaces the causal one."""
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    hidden = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1) if mask is None \
        else ~mask
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1, dtype=torch.float32)
    return probs.to(v.dtype) @ v


def document_mask(doc: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` document ids -> ``[B, 1, T, T]`` booleans, True where query ``i`` may attend
    to key ``j``: ``j <= i`` and both in the same document. Block-diagonal and causal, so no
    token sees another document (every row keeps at least its own diagonal: no empty
    softmax, even for padding, which is a document of its own)."""
    T = doc.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def document_positions(doc: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` document ids -> ``[B, T]`` positions that restart at 0 where a document
    starts: a packed document sees the positions it would alone."""
    B, T = doc.shape
    index = torch.arange(T, device=doc.device).expand(B, T)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


ATTENTION = ("sdpa", "explicit")


def set_attention(model: nn.Module, kind: str) -> None:
    """Every attention layer of ``model`` computes its core with ``kind``: ``"sdpa"`` (the
    fused kernel, the default) or ``"explicit"`` (the scores as a tensor). The weights and
    the numbers do not change, only how they are computed."""
    if kind not in ATTENTION:
        raise ValueError(f"attention {kind!r}: choose one of {', '.join(ATTENTION)}")
    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            m.kind = kind


class MLP(nn.Module):
    """Position-wise feed-forward: ``proj(GELU(fc(x)))``, widening ``d -> 4d -> d``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(config.d_ff, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.gelu(self.fc(x)))


class Block(nn.Module):
    """One transformer layer, pre-LayerNorm: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    In a mixture-of-experts model (``config.n_experts > 0``) block ``layer``'s ``mlp`` is a
    :class:`~edu3d.model.moe.MoE` when ``config.is_moe_layer(layer)``; it keeps the name
    ``mlp`` so everything that walks the blocks finds it where the dense MLP was."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MoE(config, MLP) if config.is_moe_layer(layer) else MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + (self.attn(self.ln1(x)) if mask is None else self.attn(self.ln1(x), mask))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer whose initial weights depend only on ``(config, seed)``."""

    def __init__(self, config: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.padded_vocab, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 initialisation drawn from a private generator, in ``named_parameters()`` order.

        Weights ~ N(0, 0.02); the two projections that write into the residual stream
        (``attn.proj``, ``mlp.proj``) get std ``0.02 / sqrt(2 * n_layers)`` so the stream's
        variance does not grow with depth (GPT-2 paper, section 2.3); so do the experts' and
        shared experts' ``proj`` in an MoE layer, whose router is N(0, 0.02) like any other
        weight. Biases 0, LayerNorm gains 1. A tied ``lm_head.weight`` is the embedding,
        which ``named_parameters`` yields once. A dense model draws exactly what it drew
        before MoE existed (it has no new parameters, so the same names in the same order).
        A padded vocabulary draws the real rows of its tables exactly as the unpadded model
        does and sets the padding rows to 0: the same model, whatever ``vocab_pad``.
        """
        g = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        vocab = self.config.vocab_size
        for name, p in self.named_parameters():
            if name in ("tok_emb.weight", "lm_head.weight"):
                p.zero_()
                p[:vocab].normal_(0.0, 0.02, generator=g)
            elif name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # LayerNorm gain
                p.fill_(1.0)
            elif name.endswith(("attn.proj.weight", "mlp.proj.weight")) or (
                    name.endswith("proj.weight") and (".experts." in name or ".shared." in name)):
                p.normal_(0.0, residual_std, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)

    def embed(self, idx: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids ``[B, T]`` -> residual stream ``[B, T, d]`` (token + position embedding;
        with ``doc``, positions restart at each document, :func:`document_positions`)."""
        T = idx.shape[1]
        if T > self.config.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len="
                             f"{self.config.seq_len}; crop it or build the model with seq={T}")
        pos = torch.arange(T, device=idx.device) if doc is None else document_positions(doc)
        return self.tok_emb(idx) + self.pos_emb(pos)

    def attention_mask(self, doc: torch.Tensor) -> torch.Tensor:
        """What every block's attention core takes for packed documents ``doc [B, T]``:
        :func:`document_mask`. Context parallelism replaces it on its instance (its cores
        read the document ids themselves, :mod:`edu3d.parallel.cp.sequence`)."""
        return document_mask(doc)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Residual stream ``[B, T, d]`` -> logits ``[B, T, padded_vocab]``; the padding
        columns (``vocab_pad`` > 1) are -inf, so they never win an argmax or a sample and add
        nothing to the softmax: the loss and the gradients are the unpadded model's, and the
        padding rows of ``lm_head`` get no gradient. (Under tensor parallelism each rank's
        logits are its columns; the vocabulary-parallel loss masks the same columns.)"""
        logits = self.lm_head(self.ln_f(x))
        if logits.shape[-1] == self.config.padded_vocab > self.config.vocab_size:
            logits = logits.masked_fill(self.padding_columns(logits.device), float("-inf"))
        return logits

    def padding_columns(self, device) -> torch.Tensor:
        """``[padded_vocab]`` booleans, True for the columns that are no token."""
        return torch.arange(self.config.padded_vocab, device=device) >= self.config.vocab_size

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the tokens whose target is not -100.

        Tensor parallelism replaces this method on its model with the vocabulary-parallel
        cross entropy (each rank then holds only some of the vocabulary's logits)."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                doc: torch.Tensor | None = None):
        """Returns ``(logits, loss)``; ``loss`` is the mean cross-entropy over all tokens
        (targets equal to -100 are ignored), or ``None`` without targets. ``doc`` (``[B, T]``
        document ids) packs several documents per row: none sees another."""
        x = self.embed(idx, doc)
        mask = None if doc is None else self.attention_mask(doc)
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        logits = self.head(x)
        if targets is None:
            return logits, None
        return logits, self.loss(logits, targets)


def num_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Parameter count (shared tensors counted once).

    With ``exclude_embeddings`` the token and position tables are left out, as in the scaling
    law papers: a lookup costs no FLOPs. A tied ``lm_head`` is the token table, so it goes too.
    """
    n = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        n -= model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
    return n


def flops_per_token(config: GPTConfig) -> int:
    """Training FLOPs per token: ``6N + 12·L·h·s`` (Chowdhery et al. 2022, PaLM, appendix B).

    ``N`` is the non-embedding parameter count: each weight does one multiply-add (2 FLOPs)
    per token forward and twice that backward, hence 6N. Attention adds ``QK^T`` and ``AV``,
    ``2·2·h·s`` FLOPs per token and layer forward, times 3 for forward + backward. ``N`` is
    computed from the config, so this is cheap even for gpt2-small. For a mixture of experts
    ``N`` is the *active* parameters (:func:`edu3d.model.moe.active_params`): a token runs
    the router, its top-k experts and the shared ones, not all E experts.
    """
    n = active_params(config, exclude_embeddings=True)
    return 6 * n + 12 * config.n_layers * config.d_model * config.seq_len
