"""The three most likely wrong answers of every exercise module (tests/test_wrong_answers.py).

Each is the reference solution with one definition appended that overrides a function with a
mistake a learner is likely to make, and a word of the title of a check it must fail.
"""

# module -> three (why it is wrong, the code appended to the solution, a word of the check
# title that must fail)
WRONG = {
    "ranks": [
        ("coordinates in (tp, dp, pp) order", """
def coords_of(rank, dp, tp, pp):
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)
""", "coords_of"),
        ("dp_rank without the modulo", """
def coords_of(rank, dp, tp, pp):
    return rank // (tp * dp), rank // tp, rank % tp
""", "coords_of matches"),
        ("groups numbered dp-fastest", """
def group_members(rank, dim, dp, tp, pp):
    p, d, t = coords_of(rank, dp, tp, pp)
    c = {"pp": p, "dp": d, "tp": t}
    size = {"pp": pp, "dp": dp, "tp": tp}[dim]
    return sorted(({**c, dim: i}["dp"] + dp * ({**c, dim: i}["tp"] + tp * ({**c, dim: i}["pp"]))
                   for i in range(size)))
""", "groups"),
        ("tensor parallelism over the whole job: every tp group crosses nodes", """
def layout_for(job):
    return {"a": (1, 16, 1), "b": (1, 32, 1)}[job]
""", "design, job a"),
    ],
    "ring_allreduce": [
        ("the all-gather adds instead of copying", """
def ring_all_reduce(t):
    n, i = dist.get_world_size(), dist.get_rank()
    chunks = torch.tensor_split(t.view(-1), n)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(i - s - 2) % n])
        exchange(chunks[(i - s - 1) % n], (i + 1) % n, incoming, (i - 1) % n)
        chunks[(i - s - 2) % n].add_(incoming)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(i - s - 1) % n])
        exchange(chunks[(i - s) % n], (i + 1) % n, incoming, (i - 1) % n)
        chunks[(i - s - 1) % n].add_(incoming)
    return t
""", "ring_all_reduce equals"),
        ("one reduce-scatter step short", """
def ring_all_reduce(t):
    n, i = dist.get_world_size(), dist.get_rank()
    chunks = torch.tensor_split(t.view(-1), n)
    for s in range(n - 2):
        incoming = torch.empty_like(chunks[(i - s - 2) % n])
        exchange(chunks[(i - s - 1) % n], (i + 1) % n, incoming, (i - 1) % n)
        chunks[(i - s - 2) % n].add_(incoming)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(i - s - 1) % n])
        exchange(chunks[(i - s) % n], (i + 1) % n, incoming, (i - 1) % n)
        chunks[(i - s - 1) % n].copy_(incoming)
    return t
""", "ring_all_reduce equals"),
        ("the library's all-reduce instead of a ring (right sum, no sends)", """
def ring_all_reduce(t):
    dist.all_reduce(t)
    return t
""", "bytes"),
        ("the receive buffer made in the default dtype (fp32), not the buffer's", """
def ring_all_reduce(t):
    n, i = dist.get_world_size(), dist.get_rank()
    chunks = torch.tensor_split(t.view(-1), n)
    for s in range(n - 1):
        incoming = torch.empty(chunks[(i - s - 2) % n].numel())
        exchange(chunks[(i - s - 1) % n], (i + 1) % n, incoming, (i - 1) % n)
        chunks[(i - s - 2) % n].add_(incoming)
    for s in range(n - 1):
        incoming = torch.empty(chunks[(i - s - 1) % n].numel())
        exchange(chunks[(i - s) % n], (i + 1) % n, incoming, (i - 1) % n)
        chunks[(i - s - 1) % n].copy_(incoming)
    return t
""", "1003 bf16"),
    ],
    "bucketed_ddp": [
        ("sums the gradients without dividing by N", """
def sync_gradients(model, group=None):
    for p in model.parameters():
        comm.all_reduce(p.grad, group)
""", "sync_gradients"),
        ("buckets filled from the first parameter", """
def make_buckets(params, bucket_mb):
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_mb * 2**20:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
""", "make_buckets"),
        ("every bucket launched in finish(): no overlap", """
class BucketedDDP(BucketedDDP):
    def _on_grad(self, p):
        self.grads_seen += 1

    def finish(self):
        for i, b in enumerate(self.buckets):
            flat = torch.cat([q.grad.reshape(-1) for q in b])
            self.pending.append((i, flat, comm.all_reduce(flat, self.group, async_op=True)))
            self.launched_at.append(self.grads_seen)
        super().finish()
""", "before backward has finished"),
        ("finish() keeps the step's counts: the next step launches nothing", """
class BucketedDDP(BucketedDDP):
    def finish(self):
        for i, flat, handle in self.pending:
            handle.wait()
            flat /= self.n
            off = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
        self.pending = []
""", "two steps in a row"),
    ],
    "zero1": [
        ("slices of numel // n, no padding", """
def shard_range(numel, n, rank):
    k = numel // n
    return rank * k, (rank + 1) * k, numel
""", "shard_range"),
        ("the reduce-scattered gradient not divided by N", """
_right = zero1_sgd_step
def zero1_sgd_step(params, lr, group=None):
    _right(params, lr * dist.get_world_size(group), group)
""", "equals one serial SGD step"),
        ("an all-reduce, then each rank slices (right step, twice ZeRO's traffic shape)", """
@torch.no_grad()
def zero1_sgd_step(params, lr, group=None):
    n = dist.get_world_size(group)
    for p in params:
        comm.all_reduce(p.grad, group)
        p -= lr * p.grad / n
""", "exactly one reduce-scatter"),
        ("a whole extra row of padding when N already divides the buffer", """
def shard_range(numel, n, rank):
    padded = numel + n - numel % n
    k = padded // n
    return rank * k, (rank + 1) * k, padded
""", "no padding where 8 divides"),
    ],
    "tp_layers": [
        ("f's backward does not all-reduce", """
class IdentityAllReduce(IdentityAllReduce):
    @staticmethod
    def backward(ctx, grad):
        return grad, None
""", "f = IdentityAllReduce"),
        ("the row layer's bias added on every rank before the sum", """
def row_parallel_linear(x_shard, weight_shard, bias, group):
    return AllReduceIdentity.apply(F.linear(x_shard, weight_shard, bias), group)
""", "row_parallel_linear"),
        ("padding columns not masked in the loss", """
class VocabParallelCrossEntropy(VocabParallelCrossEntropy):
    @staticmethod
    def forward(ctx, logits, target, group, start, vocab_size, ignore_index):
        return VocabParallelCrossEntropy.__base__.forward(ctx, logits, target, group, start,
                                                          10**9, ignore_index)
""", "vocab-parallel cross entropy"),
        ("the loss without the maximum subtracted: e^z overflows for confident tokens", """
class VocabParallelCrossEntropy(VocabParallelCrossEntropy):
    @staticmethod
    def forward(ctx, logits, target, group, start, vocab_size, ignore_index):
        cols = start + torch.arange(logits.shape[-1])
        z = logits.masked_fill(cols >= vocab_size, float("-inf"))  # no maximum subtracted
        ignored = target == ignore_index
        mine = (target >= start) & (target < start + logits.shape[-1]) & ~ignored
        local = (target - start).masked_fill(~mine, 0)
        z_target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = z.exp()
        both = torch.stack([exp.sum(dim=-1), z_target])
        comm.all_reduce(both, group)
        sum_exp, z_target = both[0], both[1]
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine, ignored)
        return (sum_exp.log() - z_target).masked_fill(ignored, 0.0)
""", "logits near 100"),
    ],
    "pp_schedule": [
        ("pp - r warm-up forwards instead of pp - r - 1", """
def one_f_one_b(pp, m):
    out = []
    for r in range(pp):
        w = min(pp - r, m)
        ops = [f"{r}F{i}" for i in range(w)]
        for i in range(m - w):
            ops += [f"{r}F{w + i}", f"{r}B{i}"]
        ops += [f"{r}B{i}" for i in range(m - w, m)]
        out.append(ops)
    return out
""", "Megatron"),
        ("every micro-batch back-propagates its whole mean loss", """
def microbatch_loss(loss, m):
    return loss
""", "your micro-batch loss"),
        ("the ratio of squared norms", """
def gradient_scale(pipeline_grads, serial_grads):
    sq = lambda g: float(sum(t.double().norm() ** 2 for t in g.values()))
    return sq(pipeline_grads) / sq(serial_grads)
""", "measures the missing 1/m"),
        ("the backward split, but each W run at once: 1F1B's bubble again", """
def faster_schedule(pp, m):
    return [[x for op in ops for x in ((op.replace("B", "I"), op.replace("B", "W"))
                                       if "B" in op else (op,))]
            for ops in one_f_one_b(pp, m)]
""", "design"),
    ],
    "grad_norm_3d": [
        ("replicated tensors counted on every tp rank (the given bug)", """
global_grad_norm = buggy_global_grad_norm
""", "global_grad_norm"),
        ("the tied copy counted twice", """
def global_grad_norm(pieces, tp_index, group=None):
    sq = torch.zeros(1, dtype=torch.float64)
    for name, grad, replicated, tied_copy in pieces:
        if replicated and tp_index != 0:
            continue
        sq += grad.detach().double().pow(2).sum()
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    return sq.sqrt().float()[0]
""", "global_grad_norm"),
        ("the tied halves averaged instead of summed", """
@torch.no_grad()
def sum_tied_embedding_grads(grad, group=None):
    dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
    grad /= 2
""", "sum_tied_embedding_grads"),
        ("the squares summed over the whole world, not the model-parallel group", """
def global_grad_norm(pieces, tp_index, group=None):
    sq = torch.zeros(1, dtype=torch.float64)
    for name, grad, replicated, tied_copy in pieces:
        if (replicated and tp_index != 0) or tied_copy:
            continue
        sq += grad.detach().double().pow(2).sum()
    dist.all_reduce(sq, op=dist.ReduceOp.SUM)
    return sq.sqrt().float()[0]
""", "dp2-tp2"),
    ],
    "rank_memory": [
        ("the vocabulary split as vocab // tp, no padding", """
_right = rank_params
def rank_params(n_layers, d_model, vocab, seq, tp, pp, pp_rank, tied=False):
    return _right(n_layers, d_model, vocab // tp * tp, seq, tp, pp, pp_rank, tied)
""", "rank_params"),
        ("ZeRO-2 leaves the gradients whole", """
def state_bytes(n_params, dp, zero):
    return {"params": 4 * n_params / (dp if zero >= 3 else 1),
            "grads": 4 * n_params / (dp if zero >= 3 else 1),
            "optimizer": 8 * n_params / (dp if zero >= 1 else 1)}
""", "state_bytes"),
        ("1F1B keeps pp micro-batches on every rank", """
def in_flight(schedule, pp, m, pp_rank):
    return m if schedule == "gpipe" else min(m, pp)
""", "in_flight"),
        ("the least memory first: ZeRO-3 and recompute, the whole batch at once", """
def memory_plan(job):
    return {"zero": 3, "micro_batch": 32, "recompute": True}
""", "design, job a"),
    ],
    "reshard": [
        ("a ZeRO piece written from the start of its box", """
def full_tensor(pieces):
    full = torch.zeros(pieces[0][0]["shape"], dtype=pieces[0][1].dtype)
    for place, data in pieces:
        block = full[_box(place)]
        flat = block.reshape(-1).clone()
        flat[: data.numel()] = data
        block.copy_(flat.view(block.shape))
    return full
""", "mid-row"),
        ("no check for a missing shard", """
def full_tensor(pieces):
    full = torch.zeros(pieces[0][0]["shape"], dtype=pieces[0][1].dtype)
    for place, data in pieces:
        lo, hi = place["flat"]
        block = full[_box(place)]
        flat = block.reshape(-1).clone()
        flat[lo:hi] = data
        block.copy_(flat.view(block.shape))
    return full
""", "missing"),
        ("the whole box loaded, its flat range ignored", """
def piece_for(full, placement):
    return full[_box(placement)].reshape(-1).clone()
""", "piece_for"),
        ("the full tensor made in the default dtype (fp32), not the pieces'", """
_right = full_tensor
def full_tensor(pieces):
    return _right([(place, data.float()) for place, data in pieces])
""", "bf16 tensor"),
        ("a checkpoint every step, asynchronously", """
def checkpoint_plan(job):
    return {"every": 1, "async": True}
""", "design, job a"),
    ],
    "moe_routing": [
        ("shares of tokens (N), not of assignments (N*k)", """
def load_balancing_loss(probs, expert_idx, n_experts):
    n, k = expert_idx.shape
    f = torch.bincount(expert_idx.flatten(), minlength=n_experts).to(probs.dtype) / n
    return n_experts * (f * probs.mean(0)).sum()
""", "load_balancing_loss: equals"),
        ("the capacity rounded down", """
_right = capacity_keep
def capacity_keep(gates, expert_idx, n_experts, capacity_factor):
    n, k = gates.shape
    exact = n * k / n_experts * capacity_factor
    return _right(gates, expert_idx, n_experts, math.floor(exact) * n_experts / (n * k))
""", "capacity_keep"),
        ("equal gates: the higher token index kept", """
def capacity_keep(gates, expert_idx, n_experts, capacity_factor):
    n, k = gates.shape
    capacity = math.ceil(n * k / n_experts * capacity_factor)
    keep = torch.zeros(n, k, dtype=torch.bool)
    for e in range(n_experts):
        rows, cols = (expert_idx == e).nonzero(as_tuple=True)
        order = sorted(range(len(rows)), key=lambda i: (-float(gates[rows[i], cols[i]]),
                                                        -int(rows[i])))
        for i in order[:capacity]:
            keep[rows[i], cols[i]] = True
    return keep
""", "capacity_keep"),
        ("the usual defaults, C = 1.25 and the most ep: the busiest experts drop 8.5 %", """
def moe_plan(job):
    return {"capacity_factor": 1.25, "ep": 8}
""", "design, job a"),
    ],
    "cp_merge": [
        ("the two outputs averaged", """
def merge(out_a, lse_a, out_b, lse_b):
    return (out_a.float() + out_b.float()) / 2, torch.logaddexp(lse_a.float(), lse_b.float())
""", "merge: random"),
        ("no guard for a row that saw nothing (nan)", """
def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    wa = torch.exp(lse_a.float() - lse).unsqueeze(-1)
    wb = torch.exp(lse_b.float() - lse).unsqueeze(-1)
    return wa * out_a.float() + wb * out_b.float(), lse
""", "merge is safe"),
        ("chunks r and cp + r, not mirrored", """
def zigzag_positions(seq_len, cp, rank):
    size = seq_len // (2 * cp)
    return [p for c in (rank, cp + rank) for p in range(c * size, (c + 1) * size)]
""", "zigzag_positions"),
        ("no cast to fp32: right while an fp32 lse promotes the arithmetic, off by 1e-2 "
         "when everything is bf16", """
def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a - ref).unsqueeze(-1)
    wb = torch.exp(lse_b - ref).unsqueeze(-1)
    return (wa * out_a + wb * out_b).float(), lse.float()
""", "all-bf16"),
        ("the most cp there is, to be safe: every rank's work shrinks with its tokens", """
def cp_plan(job):
    return {"cp": 8, "cp_impl": "ring", "recompute": "full"}
""", "design, job a"),
        ("the implementation left at the ring, the default, on both jobs: the right degree "
         "and recomputation, but across job b's slow link the ring's sends are exposed", """
def cp_plan(job):
    return {"cp": {"a": 4, "b": 8}[job], "cp_impl": "ring", "recompute": "full"}
""", "design, job b"),
    ],
    "torch_wrap": [
        ("the blocks sharded, the root forgotten (embeddings and head whole, never averaged)", """
def fsdp2(model, mesh, zero=3):
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=zero == 3)
    return model
""", "every parameter"),
        ("only the root sharded: the whole model is one unit", """
def fsdp2(model, mesh, zero=3):
    fully_shard(model, mesh=mesh, reshard_after_forward=zero == 3)
    return model
""", "one unit per block"),
        ("DDP with a plain AdamW: every rank keeps all of the state", """
def ddp_zero1(model, group, groups, **adamw):
    return DistributedDataParallel(model, process_group=group), torch.optim.AdamW(groups, **adamw)
""", "state is split"),
        ("the least memory: one block a unit, resharded", """
def fsdp_plan(job):
    return {"blocks_per_unit": 1, "reshard": True}
""", "design, job a"),
    ],
    "trace_overlap": [
        ("a nested span shortens the merged one", """
def merge(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [tuple(s) for s in out]
""", "merge"),
        ("total lengths subtracted, not intervals", """
def exposed_time(comm, compute):
    length = lambda s: sum(b - a for a, b in merge(s))
    return max(0.0, length(comm) - length(compute))
""", "exposed_time"),
        ("the peak of one GPU only", """
def mfu(step_seconds, tokens, flops_per_token, peak_flops, gpus):
    return tokens * flops_per_token / (step_seconds * peak_flops)
""", "mfu"),
        ("one bucket a gradient: the latency paid 13 times", """
def bucket_plan(job):
    return [1] * 13
""", "design, job a"),
    ],
    "layout_choice": [
        ("plain data parallelism everywhere (does not fit)", """
def choose(job):
    return {"dp": {"a": 8, "b": 16, "c": 32}[job], "tp": 1, "pp": 1, "zero": 0,
            "micro_batch": 1, "recompute": "none"}
""", "job a"),
        ("tensor parallelism across every GPU, nodes included (too slow)", """
def choose(job):
    return {"dp": 1, "tp": {"a": 8, "b": 16, "c": 32}[job], "pp": 1, "zero": 0,
            "micro_batch": 1, "recompute": "none"}
""", "job b"),
        ("full recomputation to be safe (a third more compute)", """
def choose(job):
    return {**LAYOUTS[job], "recompute": "full"}
""", "job c"),
        ("selective recomputation and one sequence a micro-batch, safe on every job", """
def micro_plan(job):
    return {"micro_batch": 1, "recompute": "selective"}
""", "tuning a"),
    ],
}
