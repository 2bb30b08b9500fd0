"""Causal attention over a sequence split across ranks: ring, all-gather and Ulysses.

After reading this file you should understand:

* attention is the one layer where a token needs the other tokens: each rank holds the
  queries, keys and values of its own tokens (:mod:`~edu3d.parallel.cp.zigzag`), and its
  queries must meet every earlier key, wherever it lives. The causal mask compares *global*
  positions (``key_pos <= query_pos``), so no reordering is ever needed;
* softmax can be computed block by block: a block of keys gives a partial output and a
  log-sum-exp per query (:func:`block_attention`), and two partial results combine exactly by
  :func:`merge` (``lse = log(e^lse_a + e^lse_b)``, ``out = e^(lse_a-lse) out_a +
  e^(lse_b-lse) out_b``, in fp32). That is flash attention's trick, and ring attention's;
* **ring attention** (Liu et al. 2023; ring-flash-attention's ``zigzag_ring_flash_attn``):
  K and V travel round the ring of ``cp`` ranks in ``cp - 1`` steps, each rank merging one
  block per step while the next block is in flight; blocks the causal mask hides entirely
  are skipped (:func:`last_work` counts what was computed). Backward recomputes each block's
  probabilities from the saved output and log-sum-exp (``dS = P * (dP - rowsum(dO * O))``),
  and dK, dV travel round the ring with K and V, arriving home after one more step;
* **all-gather attention** (Llama 3): gather every rank's K and V once, attend locally;
  backward reduce-scatters dK and dV. Simple, and the traffic of one ring, but all of K and
  V sit in memory at once;
* **Ulysses** (DeepSpeed): two all-to-alls turn "my tokens, all heads" into "all tokens, my
  heads"; attention runs unsplit on ``H / cp`` heads, and two all-to-alls turn it back. The
  degree cannot exceed the (local) head count;
* **packed documents** (``--batching pack``) add one rule to the mask: a query sees a key
  only if it is earlier *and in the same document* (:func:`visible`). Each impl takes the
  whole sequence's document ids ``docs [B, T]`` (every rank holds them, as it holds the
  whole global batch: they are data, not activations) and reads a token's document at its
  global position: ``docs[:, pos]``. So the mask crosses the ring with the key positions
  that already travel (the keys' documents are ``docs[:, k_pos]``, no extra byte on the
  wire); all-gather and Ulysses read the documents of every gathered key the same way. A
  block may now hide *every* key from some query rows (a document that starts after the
  block ends): those rows get ``lse = -inf`` and :func:`merge` gives them weight 0, and
  every row keeps at least its own key (the diagonal) somewhere, so the final softmax is
  never empty.

The math is fp32 inside whatever the input dtype; outputs are cast back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edu3d.distributed import comm

IMPLS = ("ring", "allgather", "ulysses")

_WORK = {"computed": 0, "skipped": 0}


def last_work() -> dict[str, int]:
    """Score entries (per batch row and head) the last ring forward on this rank computed,
    and the ones it skipped because the causal mask hid their whole block."""
    return dict(_WORK)


# ---------------------------------------------------------------- one block and the merge

def visible(q_pos, k_pos, q_doc=None, k_doc=None) -> torch.Tensor:
    """True where a query may see a key: ``k_pos <= q_pos`` (global positions), ``[Tq, Tk]``;
    with packed documents (``q_doc [B, Tq]``, ``k_doc [B, Tk]``, each token's document) also
    only within one document: ``[B, 1, Tq, Tk]``, the serial
    :func:`~edu3d.model.gpt.document_mask` restricted to these queries and keys."""
    causal = k_pos.view(1, -1) <= q_pos.view(-1, 1)
    if q_doc is None:
        return causal
    return causal & (q_doc[:, None, :, None] == k_doc[:, None, None, :])


def block_attention(q, k, v, q_pos, k_pos, scale: float, q_doc=None, k_doc=None):
    """Attention of queries ``q [B,H,Tq,hd]`` on one block of keys/values ``[B,H,Tk,hd]``,
    masked by global positions (``k_pos <= q_pos``) and, with ``q_doc``/``k_doc``, documents
    (:func:`visible`). Returns ``(out, lse)`` in fp32: ``out [B,H,Tq,hd]`` normalised over
    this block only, ``lse [B,H,Tq]`` its log-sum-exp. A query that sees no key here gets
    ``out = 0`` and ``lse = -inf``. Differentiable."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~visible(q_pos, k_pos, q_doc, k_doc), float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()  # the shift cancels: no gradient through it
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)  # hidden entries: exp(-inf) = 0
    denom = p.sum(dim=-1, keepdim=True)
    out = (p @ v.float()) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out, (m + torch.log(denom)).squeeze(-1)


def merge(out_a, lse_a, out_b, lse_b):
    """Two partial results for the same queries over disjoint key blocks -> the result over
    both, exactly (fp32). Safe when a query saw nothing in either block (both ``-inf``)."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa, wb = torch.exp(lse_a - ref), torch.exp(lse_b - ref)
    return wa.unsqueeze(-1) * out_a.float() + wb.unsqueeze(-1) * out_b.float(), lse


def _halves(pos: list[int]) -> list[tuple[slice, int, int]]:
    """A rank's tokens cut in two halves (zigzag: its two chunks), each with its lowest and
    highest position: the blocks the causal mask may hide whole. Both splits are cut the same
    way, so plain and zigzag compute blocks of one size and only their number differs."""
    n = len(pos)
    cuts = [slice(0, n // 2), slice(n // 2, n)] if n > 1 and n % 2 == 0 else [slice(0, n)]
    return [(c, min(pos[c]), max(pos[c])) for c in cuts]


def _blocks(q_pos: torch.Tensor, k_pos: torch.Tensor, count: bool = True):
    """The (query range, key range) pairs not entirely hidden by the causal mask; with
    ``count``, adds the score entries computed and skipped to :func:`last_work`'s tally.
    (Packed documents may hide more blocks whole; those are computed and masked, since which
    ones depends on the batch: flash attention's varlen kernels skip them too.)"""
    for qs, _, q_last in _halves(q_pos.tolist()):
        for ks, k_first, _ in _halves(k_pos.tolist()):
            entries = (qs.stop - qs.start) * (ks.stop - ks.start)
            hidden = k_first > q_last
            if count:
                _WORK["skipped" if hidden else "computed"] += entries
            if not hidden:
                yield qs, ks


# ---------------------------------------------------------------- ring attention

def _ring(group) -> tuple[int, int, int]:
    """(size, global rank of the next rank, global rank of the previous one)."""
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    n = len(ranks)
    return n, ranks[(me + 1) % n], ranks[(me - 1) % n]


def _post(tensors, nxt: int, prv: int, group):
    """Send ``tensors`` to the next rank and receive the previous rank's into new buffers,
    both posted at once (so no rank blocks in a send while its peer blocks in one too)."""
    bufs = [torch.empty_like(t) for t in tensors]
    handles = []
    for t, b in zip(tensors, bufs):
        handles.append(comm.recv(b, prv, group, async_op=True))
        handles.append(comm.send(t.contiguous(), nxt, group, async_op=True))
    return bufs, handles


def _wait(pending):
    bufs, handles = pending
    for h in handles:
        h.wait()
    return bufs


def _docs_at(docs, pos):
    """The documents of the tokens at global positions ``pos``: ``docs[:, pos]`` (or
    ``None`` when nothing is packed)."""
    return None if docs is None else docs[:, pos]


class RingAttention(torch.autograd.Function):
    """``RingAttention.apply(q, k, v, positions, group, docs)``: see :func:`ring_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, pos, group, docs=None):
        n, nxt, prv = _ring(group)
        scale = q.shape[-1] ** -0.5
        qf, q_doc = q.float(), _docs_at(docs, pos)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv, k_pos = torch.stack([k, v]), pos
        _WORK.update(computed=0, skipped=0)
        for step in range(n):
            pending = _post([kv, k_pos], nxt, prv, group) if step < n - 1 else None
            k_doc = _docs_at(docs, k_pos)  # derived from the positions that travel
            for qs, ks in _blocks(pos, k_pos):  # overlaps the exchange in flight
                o, l = block_attention(qf[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :],
                                       pos[qs], k_pos[ks], scale,
                                       *(() if docs is None else (q_doc[:, qs], k_doc[:, ks])))
                out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o, l)
            if pending:
                kv, k_pos = _wait(pending)
        ctx.save_for_backward(q, k, v, pos, out, lse, docs)
        ctx.group = group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, pos, out, lse, docs = ctx.saved_tensors
        n, nxt, prv = _ring(ctx.group)
        scale = q.shape[-1] ** -0.5
        qf, do, q_doc = q.float(), dout.float(), _docs_at(docs, pos)
        delta = (do * out).sum(dim=-1)  # rowsum(dO * O), one per query
        dq = torch.zeros_like(qf)
        kv, k_pos = torch.stack([k, v]), pos
        dkv, pending_d = torch.zeros(kv.shape, dtype=torch.float32, device=q.device), None
        for step in range(n):
            pending = _post([kv, k_pos], nxt, prv, ctx.group) if step < n - 1 else None
            if pending_d:  # the dK, dV of the block now held, summed by the ranks before
                (dkv,) = _wait(pending_d)
            kf, k_doc = kv.float(), _docs_at(docs, k_pos)
            for qs, ks in _blocks(pos, k_pos, count=False):
                kb, vb = kf[0][..., ks, :], kf[1][..., ks, :]
                s = (qf[..., qs, :] @ kb.transpose(-1, -2)) * scale
                seen = visible(pos[qs], k_pos[ks], *(() if docs is None
                                                      else (q_doc[:, qs], k_doc[:, ks])))
                # lse is the row's final one (finite: every row sees its own key somewhere),
                # so a row this block hides whole gets p = 0 here and no gradient from it
                p = torch.where(seen, torch.exp(s - lse[..., qs].unsqueeze(-1)),
                                torch.zeros_like(s))
                dv_b = p.transpose(-1, -2) @ do[..., qs, :]
                ds = p * (do[..., qs, :] @ vb.transpose(-1, -2) - delta[..., qs].unsqueeze(-1))
                dq[..., qs, :] += (ds @ kb) * scale
                dkv[0][..., ks, :] += (ds.transpose(-1, -2) @ qf[..., qs, :]) * scale
                dkv[1][..., ks, :] += dv_b
            if n > 1:  # pass the sums on with the block; the last pass brings ours home
                pending_d = _post([dkv], nxt, prv, ctx.group)
            if pending:
                kv, k_pos = _wait(pending)
        if pending_d:
            (dkv,) = _wait(pending_d)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, positions: torch.Tensor, group,
                   docs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's ``q, k, v [B,H,T,hd]`` (tokens at global
    ``positions [T]``) over the whole sequence, K and V passed round the ring; with
    ``docs`` (the whole sequence's document ids ``[B, seq_len]``), only within documents."""
    return RingAttention.apply(q, k, v, positions, group, docs)


# ---------------------------------------------------------------- all-gather attention

class GatherSequence(torch.autograd.Function):
    """``GatherSequence.apply(t, group, dim)``: every rank's ``t`` concatenated along
    ``dim`` in rank order; backward sums the gradient over ranks and keeps this rank's slice
    (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, t, group, dim):
        ctx.group, ctx.dim = group, dim
        x = t.movedim(dim, 0).contiguous()
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        comm.all_gather(out, x, group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        g = grad.movedim(ctx.dim, 0).contiguous()
        out = g.new_empty((g.shape[0] // dist.get_world_size(ctx.group), *g.shape[1:]))
        comm.reduce_scatter(out, g, ctx.group)
        return out.movedim(0, ctx.dim), None, None


def gather_positions(positions: torch.Tensor, group) -> torch.Tensor:
    """Every rank's positions, concatenated in rank order (the order gathered tokens come in)."""
    out = positions.new_empty(dist.get_world_size(group) * positions.numel())
    comm.all_gather(out, positions.contiguous(), group)
    return out


def _attend(q, k, v, q_pos, k_pos, docs=None) -> torch.Tensor:
    out, _ = block_attention(q, k, v, q_pos, k_pos, q.shape[-1] ** -0.5,
                             _docs_at(docs, q_pos), _docs_at(docs, k_pos))
    return out.to(q.dtype)


def allgather_attention(q, k, v, positions: torch.Tensor, group,
                        all_positions: torch.Tensor | None = None,
                        docs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention with every rank's K and V gathered here first (Llama 3's CP).
    ``all_positions``: :func:`gather_positions`'s result, if already known; ``docs``: the
    whole sequence's document ids ``[B, seq_len]`` (packed documents see only themselves)."""
    if all_positions is None:
        all_positions = gather_positions(positions, group)
    kv = GatherSequence.apply(torch.stack([k, v]), group, 3)
    return _attend(q, kv[0], kv[1], positions, all_positions, docs)


# ---------------------------------------------------------------- Ulysses

def _heads_to_front(t, n: int):
    """``[B, H, T, hd]`` -> ``[n, B, H/n, T, hd]``: row block j goes to rank j."""
    B, H, T, hd = t.shape
    return t.reshape(B, n, H // n, T, hd).movedim(1, 0)


def ulysses_attention(q, k, v, positions: torch.Tensor, group,
                      all_positions: torch.Tensor | None = None,
                      docs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention after an all-to-all from "my tokens, all H heads" to "all tokens,
    H/cp heads", and back. ``cp`` must divide ``H`` (the local head count under TP). With
    ``docs`` (``[B, seq_len]``) the whole sequence's document mask applies, as serially."""
    n, H = dist.get_world_size(group), q.shape[1]
    if H % n:
        ok = ", ".join(str(d) for d in range(1, H + 1) if H % d == 0)
        raise ValueError(f"Ulysses gives each of cp={n} ranks H/cp of the H={H} heads, and "
                         f"{n} does not divide {H}; choose cp in {ok} (or ring/allgather)")
    if all_positions is None:
        all_positions = gather_positions(positions, group)
    # One all-to-all for q, k and v together: [3, B, H, T, hd] -> [n, 3, B, H/n, T, hd].
    qkv = _heads_to_front(torch.stack([q, k, v]).flatten(0, 1), n)
    qkv = comm.AllToAll.apply(qkv.contiguous(), group, None, None)  # row j: rank j's tokens
    B, T, hd = q.shape[0], q.shape[2], q.shape[3]
    qkv = qkv.reshape(n, 3, B, H // n, T, hd).permute(1, 2, 3, 0, 4, 5)
    qkv = qkv.reshape(3, B, H // n, n * T, hd)  # all tokens, in rank order
    y = _attend(qkv[0], qkv[1], qkv[2], all_positions, all_positions, docs)
    y = y.reshape(B, H // n, n, T, hd).permute(2, 0, 1, 3, 4)  # row j: rank j's tokens
    y = comm.AllToAll.apply(y.contiguous(), group, None, None)  # row j: heads of rank j
    return y.movedim(0, 1).reshape(B, H, T, hd)


# ---------------------------------------------------------------- the core a block uses

def cp_core(impl: str, group, positions):
    """A drop-in ``attn.core(q, k, v, docs=None)`` for a block whose tokens sit at
    ``positions`` (this rank's global positions, a list or LongTensor) of a sequence split
    over ``group``. Where the serial core takes a ``[B, 1, T, T]`` document mask, this one
    takes the whole sequence's document ids ``docs [B, T]`` (what
    :func:`~edu3d.parallel.cp.sequence.apply_cp` makes the model pass): no rank ever builds
    a ``T x T`` mask, and each block's piece of it is read off the ids."""
    if impl not in IMPLS:
        raise ValueError(f"unknown CP attention {impl!r}; choose one of {', '.join(IMPLS)}")
    pos = torch.as_tensor(positions, dtype=torch.long)
    cache: dict = {}

    def core(q, k, v, docs=None):
        p = cache.setdefault(("pos", q.device), pos.to(q.device))
        if impl == "ring":
            return ring_attention(q, k, v, p, group, docs)
        key = ("all", q.device)
        if key not in cache:
            cache[key] = gather_positions(p, group)
        attend = allgather_attention if impl == "allgather" else ulysses_attention
        return attend(q, k, v, p, group, all_positions=cache[key], docs=docs)

    core.impl = impl
    return core
