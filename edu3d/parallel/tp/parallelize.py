"""``parallelize``: the serial GPT turned into its tensor-parallel form, and its training step.

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
* with **sequence parallelism** the residual stream between the parallel regions is split
  along the sequence: LayerNorms run on ``s/t`` tokens, the position embedding is split in
  (``SplitAllGather``), and each column region (attention, MLP, LM head) starts with an
  all-gather of the tokens (``AllGatherReduceScatter``), set as forward hooks. The LayerNorm
  gains and biases and the row layers' biases then see only their rank's tokens, so their
  gradients are *partial* and are all-reduced over tp;
* a training step under ``dp x tp``: each dp rank takes its rows of the global batch, the
  gradients are summed over dp and divided by dp, the global gradient norm adds the squared
  norms of the shards across tp (replicated tensors counted once), and clipping, learning rate
  and the optimizer are exactly the serial loop's (:mod:`edu3d.train`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from edu3d import comm, trace
from edu3d.data import shard_rows
from edu3d.mesh import Layout, LayoutError, Mesh
from edu3d.parallel.tp import ops
from edu3d.parallel.tp.layers import (ColumnParallelLinear, RowParallelLinear,
                                      VocabParallelEmbedding, padded_size,
                                      vocab_parallel_cross_entropy, unshard)


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


class TensorParallelGPT(nn.Module):
    """A :class:`~edu3d.model.GPT` whose layers were swapped by :func:`parallelize`.

    ``forward(idx, targets)`` returns ``(local_logits, loss)``: the logits are this rank's
    vocabulary columns (``[B, T, V_padded/t]``), the loss the mean cross entropy, equal on
    every tp rank. ``specs`` maps each serial parameter name to how it is sharded.
    """

    def __init__(self, gpt: nn.Module, group, sequence_parallel: bool, specs: dict):
        super().__init__()
        self.gpt, self.group, self.specs = gpt, group, specs
        self.sequence_parallel = sequence_parallel
        self.config = gpt.config

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.gpt.embed(idx)
        for block in self.gpt.blocks:
            x = block(x)
        logits = self.gpt.head(x)
        if targets is None:
            return logits, None
        return logits, vocab_parallel_cross_entropy(logits, targets, self.group,
                                                    vocab_size=self.config.vocab_size)

    def serial_named_parameters(self):
        """``(serial name, local parameter)``, names as in the serial GPT."""
        for name, p in self.gpt.named_parameters():
            yield name, p

    def partial_grad_params(self) -> list[nn.Parameter]:
        """Replicated parameters whose gradient covers only this rank's tokens (SP only)."""
        if not self.sequence_parallel:
            return []
        return [p for name, p in self.serial_named_parameters() if self.specs[name] is None
                and not name.startswith("pos_emb")]

    def sync_sequence_parallel_grads(self) -> None:
        """Sum the partial gradients of :meth:`partial_grad_params` over tp (one all-reduce)."""
        params = [p for p in self.partial_grad_params() if p.grad is not None]
        if params and ops.group_size(self.group) > 1:
            flat = torch.cat([p.grad.flatten() for p in params])
            comm.all_reduce(flat, self.group)
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(g.view_as(p))

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm: shards' squares summed over tp, replicated ones once."""
        device = next(self.parameters()).device  # NCCL reduces only GPU tensors
        sharded = torch.zeros((), dtype=torch.float64, device=device)
        replicated = torch.zeros((), dtype=torch.float64, device=device)
        for name, p in self.serial_named_parameters():
            if p.grad is None:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if self.specs[name] is None:
                replicated += sq
            else:
                sharded += sq
        if ops.group_size(self.group) > 1:
            comm.all_reduce(sharded, self.group)
        return (sharded + replicated).sqrt().float()

    @torch.no_grad()
    def gather(self, what: str = "param") -> dict[str, torch.Tensor]:
        """Full tensors (``"param"`` or ``"grad"``) under serial names, on every rank.

        For inspection and tests (it uses ``dist.all_gather`` directly, so this traffic,
        which is not part of training, stays out of the trace)."""
        n, out = ops.group_size(self.group), {}
        for name, p in self.serial_named_parameters():
            t = p if what == "param" else p.grad
            if t is None:
                continue
            spec = self.specs[name]
            if spec is None or n == 1:
                full = t.detach().clone()
                if spec is not None and spec[2] is not None:
                    full = full.narrow(spec[0], 0, spec[2])
            else:
                parts = [torch.empty_like(t) for _ in range(n)]
                dist.all_gather(parts, t.detach().contiguous(), group=self.group)
                full = unshard(parts, *spec)
            out[name] = full
        return out


def _tp_group(target):
    if isinstance(target, Mesh):
        return target.tp
    if isinstance(target, Layout):
        return Mesh.build(target).tp
    return target  # a ProcessGroup


def parallelize(model: nn.Module, mesh, *, sequence_parallel: bool = False,
                overlap: bool = False) -> TensorParallelGPT:
    """Turn the serial ``model`` into its tensor-parallel form over ``mesh``'s tp group.

    ``mesh`` is a :class:`~edu3d.mesh.Mesh`, a :class:`~edu3d.mesh.Layout` (its mesh is
    built; every rank must call) or a tp ``ProcessGroup``. ``model`` is changed in place: keep
    the serial one by passing a copy.
    """
    group = _tp_group(mesh)
    t, cfg = ops.group_size(group), model.config
    check_layout(Layout(tp=t), cfg, sequence_parallel)
    sp = dict(sequence_parallel=sequence_parallel)
    vocab, vpad = cfg.vocab_size, padded_size(cfg.vocab_size, t)
    specs = {name: None for name, _ in model.named_parameters()}

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
        mlp.fc = ColumnParallelLinear.from_linear(mlp.fc, group, overlap=overlap, **sp)
        mlp.proj = RowParallelLinear.from_linear(mlp.proj, group, **sp)
        if sequence_parallel:
            _gather_sequence_before(attn, group)
            _gather_sequence_before(mlp, group)
        p = f"blocks.{i}."
        specs.update({p + "attn.qkv.weight": (0, 3, None), p + "attn.qkv.bias": (0, 3, None),
                      p + "attn.proj.weight": (1, 1, None), p + "mlp.fc.weight": (0, 1, None),
                      p + "mlp.fc.bias": (0, 1, None), p + "mlp.proj.weight": (1, 1, None)})
    return TensorParallelGPT(model, group, sequence_parallel, specs)


class TPTrainer:
    """One ``dp x tp`` training step that reproduces :func:`edu3d.train.train_step`.

    ``step(x, y, step)`` takes the *global* batch and returns ``{"loss", "grad_norm"}``: the
    global-batch mean loss and the total gradient norm before clipping, as the serial run.
    """

    def __init__(self, model: nn.Module, mesh: Mesh, args):
        from edu3d.train import make_optimizer

        self.mesh, self.args = mesh, args
        self.sp = bool(getattr(args, "sp", False))
        check_layout(mesh.layout, model.config, self.sp)
        self.model = parallelize(model, mesh, sequence_parallel=self.sp,
                                 overlap=bool(getattr(args, "tp_overlap", False)))
        self.optimizer = make_optimizer(self.model, args)
        self.dp = mesh.size("dp")

    def _sync_dp(self, loss: torch.Tensor) -> torch.Tensor:
        """Average gradients and loss over dp: one all-reduce of one flat buffer (SUM / dp)."""
        if self.dp == 1:
            return loss.detach()
        params = [p for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.flatten() for p in params] + [loss.detach().view(1)])
        comm.all_reduce(flat, self.mesh.dp)
        flat /= self.dp
        for p, g in zip(params, flat.split([p.numel() for p in params] + [1])):
            p.grad.copy_(g.view_as(p))
        return flat[-1]

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> dict:
        from edu3d.train import clip_and_step

        i = self.mesh.index("dp")
        xs, ys = shard_rows(x, i, self.dp), shard_rows(y, i, self.dp)
        self.optimizer.zero_grad(set_to_none=True)
        rec = trace.current()  # compute spans, so a timeline shows the collectives inside them
        with rec.context(step=step):
            with rec.span("compute", "forward"):
                _, loss = self.model(xs, ys)
            with rec.span("compute", "backward"):
                loss.backward()
                self.model.sync_sequence_parallel_grads()
                loss = self._sync_dp(loss)
            with rec.span("compute", "optimizer"):
                norm = self.model.grad_norm()
                clip_and_step(self.optimizer, list(self.model.parameters()), norm, step,
                              self.args)
        return {"loss": loss.item(), "grad_norm": norm.item()}


def build_trainer(model: nn.Module, mesh: Mesh, args) -> TPTrainer:
    """The trainer ``edu3d train --tp N [--sp] [--dp M]`` runs on every rank (pp must be 1)."""
    if mesh.layout.pp != 1:
        raise LayoutError(f"the tensor-parallel trainer runs pp=1 layouts, not {mesh.layout}")
    return TPTrainer(model, mesh, args)
