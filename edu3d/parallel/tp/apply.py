"""``apply_tp``: the serial GPT turned into its tensor-parallel form.

After reading this file you should understand:

* tensor parallelism is *applied to* the unchanged reference model (torchtitan's
  ``apply_tp``): each ``nn.Linear`` / ``nn.Embedding`` is swapped for its parallel version,
  built from a shard of the serial weights. No block, attention or MLP is rewritten: the
  serial ``forward`` code runs as is, on smaller matrices;
* the plan, per block: ``qkv`` column parallel split on head boundaries (rank i gets heads
  ``i*a/t .. (i+1)*a/t - 1`` of q, k and v) and ``proj`` row parallel; MLP ``fc`` column,
  ``proj`` row; the token embedding and the LM head vocabulary-parallel (tied when the serial
  model ties them: the *same* shard parameter), and the loss is the vocabulary-parallel
  cross entropy, so no rank ever holds ``[tokens, vocab]`` logits;
* a mixture-of-experts layer (:mod:`edu3d.model.moe`) is left whole on every tp rank: the
  tokens it routes are the same on all of them, so each computes the same experts (expert
  parallelism, not TP, shares its weights out);
* with **sequence parallelism** the residual stream between the parallel regions is split
  along the sequence: LayerNorms run on ``s/t`` tokens, the position embedding is split in
  (``SplitAllGather``), and each column region (attention, MLP, LM head) starts with an
  all-gather of the tokens (``AllGatherReduceScatter``), set as forward hooks. The LayerNorm
  gains and biases and the row layers' biases then see only their rank's tokens, so their
  gradients are *partial* and are all-reduced over tp;
* what the training step must do about it lives elsewhere: the partial gradients are summed
  over tp and the global norm counts replicated tensors once in
  :mod:`edu3d.parallel.grads`; :func:`edu3d.parallel.parallelize.parallelize` composes this
  with the pipeline cut and data parallelism.
"""

from __future__ import annotations

import functools

import torch.nn as nn

from edu3d.config.layout import Layout, LayoutError
from edu3d.distributed.mesh import Mesh
from edu3d.model.shapes import padded_size
from edu3d.parallel.tp import ops
from edu3d.parallel.tp.layers import (ColumnParallelLinear, RowParallelLinear,
                                      VocabParallelEmbedding, vocab_parallel_cross_entropy)


def check_layout(layout: Layout, config, sequence_parallel: bool = False,
                 world_size: int | None = None) -> Layout:
    """Fail early, with the valid choices, if ``config`` cannot be split ``layout.tp`` ways."""
    layout.validate(world_size=world_size, config=config)
    if sequence_parallel and config.seq_len % layout.tp:
        ok = ", ".join(str(t) for t in range(1, config.n_heads + 1)
                       if config.n_heads % t == 0 and config.seq_len % t == 0)
        raise LayoutError(f"sequence parallelism splits seq_len={config.seq_len} over tp="
                          f"{layout.tp} ranks, which does not divide it; choose tp in {ok}")
    return layout


def _gather_sequence_before(module: nn.Module, group) -> None:
    """Enter a column region under SP: all-gather the tokens (backward: reduce-scatter)."""
    module.register_forward_pre_hook(
        lambda m, args: (ops.all_gather_reduce_scatter(args[0], group, 1), *args[1:]))


def _split_sequence_after(module: nn.Module, group) -> None:
    """Keep this rank's tokens of ``module``'s ``[T, d]`` output (backward: all-gather)."""
    module.register_forward_hook(lambda m, args, out: ops.split_all_gather(out, group, 0))


def _tp_group(target):
    if isinstance(target, Mesh):
        return target.tp
    if isinstance(target, Layout):
        return Mesh.build(target).tp
    return target  # a ProcessGroup


def apply_tp(model: nn.Module, mesh, *, sequence_parallel: bool = False,
             overlap: bool = False) -> dict:
    """Turn the serial ``model`` into its tensor-parallel form over ``mesh``'s tp group.

    ``mesh`` is a :class:`~edu3d.distributed.mesh.Mesh`, a :class:`~edu3d.config.layout.Layout` (its mesh is
    built; every rank must call) or a tp ``ProcessGroup``. ``model`` is changed in place (keep
    the serial one by passing a copy): its layers become their parallel versions, its
    ``loss`` the vocabulary-parallel cross entropy, and ``model(idx, targets)`` now returns
    ``(this rank's vocabulary columns of the logits, the loss)``, the loss equal on every tp
    rank. Returns ``specs``: for each serial parameter name how it is sharded
    (``(dim, parts, true size)``, see :func:`~edu3d.parallel.tp.layers.shard`), or ``None``
    for a tensor every tp rank holds whole.
    """
    group = _tp_group(mesh)
    t, cfg = ops.group_size(group), model.config
    check_layout(Layout(tp=t), cfg, sequence_parallel)
    sp = dict(sequence_parallel=sequence_parallel)
    vocab, vpad = cfg.vocab_size, padded_size(cfg.vocab_size, t)
    specs = {name: None for name, _ in model.named_parameters()}
    model.loss = functools.partial(vocab_parallel_cross_entropy, group=group, vocab_size=vocab)

    tok = VocabParallelEmbedding.from_embedding(model.tok_emb, group, **sp)
    head = ColumnParallelLinear.from_linear(model.lm_head, group, pad_to=vpad, overlap=overlap,
                                            **sp)
    if cfg.tie_weights:
        head.weight = tok.weight  # one shard parameter, both uses' gradients add up in it
    model.tok_emb, model.lm_head = tok, head
    specs["tok_emb.weight"] = (0, 1, vocab)
    if not cfg.tie_weights:
        specs["lm_head.weight"] = (0, 1, vocab)
    if sequence_parallel:  # forward hooks, so the serial modules' code and names stay
        _split_sequence_after(model.pos_emb, group)
        _gather_sequence_before(model.lm_head, group)

    for i, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, group, parts=3, overlap=overlap, **sp)
        attn.proj = RowParallelLinear.from_linear(attn.proj, group, **sp)
        attn.n_heads = cfg.n_heads // t
        p = f"blocks.{i}."
        specs.update({p + "attn.qkv.weight": (0, 3, None), p + "attn.qkv.bias": (0, 3, None),
                      p + "attn.proj.weight": (1, 1, None)})
        if sequence_parallel:
            _gather_sequence_before(attn, group)
        if not hasattr(mlp, "fc"):
            continue  # a mixture of experts: whole on every tp rank (its tokens are the same)
        mlp.fc = ColumnParallelLinear.from_linear(mlp.fc, group, overlap=overlap, **sp)
        mlp.proj = RowParallelLinear.from_linear(mlp.proj, group, **sp)
        if sequence_parallel:
            _gather_sequence_before(mlp, group)
        specs.update({p + "mlp.fc.weight": (0, 1, None), p + "mlp.fc.bias": (0, 1, None),
                      p + "mlp.proj.weight": (1, 1, None)})
    return specs


def partial_grad_names(specs: dict, sequence_parallel: bool) -> list[str]:
    """Serial names of the replicated parameters whose gradient, under sequence parallelism,
    covers only this rank's tokens (LayerNorms, row layers' biases): they must be summed over
    tp. The position embedding is not among them: its output is split *after* the lookup,
    whose backward all-gathers, so its gradient is already complete."""
    if not sequence_parallel:
        return []
    return [n for n, spec in specs.items() if spec is None and not n.startswith("pos_emb")]
