"""A mixture of experts' statistics after a step: what its routers did, summed over ranks.

After reading this file you should understand what ``edu3d train`` records of a mixture of
experts, and why adding it up is one collective: each MoE layer counts, during the step,
the tokens its router sent to each expert, the assignments the capacity limit dropped and
its balancing losses (:meth:`edu3d.model.moe.MoE.take_stats`); after the step every rank
lays its counts into one flat tensor and one all-reduce sums them (:func:`router_stats`).
Some ranks must add nothing, or a number would be counted twice:

* a tensor-parallel group routes the same tokens on every tp rank: only tp index 0 adds;
* a context-parallel group's load-balancing loss is the same on every cp rank: only cp
  index 0 adds it (the counts and the z-loss are each cp rank's own tokens': all add);
* a layer lives on one pipeline stage: the ranks of the others add zeros.

The global counts also drive DeepSeek-V3's auxiliary-loss-free balancing
(``--balance bias``): each layer moves its experts' routing bias by the step's counts,
the same on every rank, so the replicas stay equal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def router_stats(moe: dict, moe_layers: list[int], config, mesh) -> dict:
    """After a step: the routers' statistics summed over every rank (collective), for the
    record, and DeepSeek-V3's bias update from the step's global counts.

    ``moe``: this rank's MoE layers by serial layer number; ``moe_layers``: the serial
    model's MoE layer numbers; ``config``: the model's config; ``mesh``: this rank's mesh.

    ``tokens_per_expert``: the first MoE layer's assignments to each expert, before any
    capacity limit, over all ranks and micro-batches (they add up to tokens x topk);
    ``dropped``: that layer's assignments the capacity limit dropped; ``aux_loss`` and
    ``z_loss``: means over layers and micro-batches (the load-balancing loss is 1 at
    perfect balance, E/k when every token picks the same k experts); ``ep_tokens``: under
    expert parallelism, tokens each rank of the first expert-parallel group sent to each
    (row: sender, column: receiver), for the first MoE layer."""
    n, experts = len(moe_layers), config.n_experts
    ep = mesh.layout.ep
    tp0 = mesh.index("tp") == 0
    cp0 = mesh.layout.cp == 1 or mesh.index("cp") == 0
    first_group = ep > 1 and mesh.index("dpcp") < ep
    counts = torch.zeros(n, experts, dtype=torch.float64)
    dropped = torch.zeros(n, dtype=torch.float64)
    sums = torch.zeros(4, dtype=torch.float64)  # aux sum, aux count, z sum, z count
    matrix = torch.zeros(ep, ep, dtype=torch.float64)
    for j, layer in enumerate(moe_layers):
        if layer not in moe:
            continue
        st = moe[layer].take_stats()
        if not tp0 or not st["forwards"]:
            continue
        counts[j] += st["counts"].double()
        dropped[j] += st["dropped"]
        if cp0:  # the group's aux loss is the same on every cp rank
            sums[0] += st["aux"]
            sums[1] += st["forwards"]
        sums[2] += st["z"]
        sums[3] += st["forwards"]
        if j == 0 and first_group and st.get("matrix") is not None:
            matrix += st["matrix"].double()  # this rank's row; the others are 0
    flat = torch.cat([counts.view(-1), dropped, sums, matrix.view(-1)])
    if mesh.layout.world_size > 1:  # bookkeeping: left out of the trace
        dist.all_reduce(flat)
    counts = flat[:n * experts].view(n, experts)
    dropped, sums = flat[n * experts:n * experts + n], flat[n * experts + n:][:4]
    if config.balance == "bias":
        for j, layer in enumerate(moe_layers):
            if layer in moe:
                moe[layer].update_bias(counts[j].to(moe[layer].expert_bias.device))
    out = {"aux_loss": float(sums[0] / max(sums[1], 1)),
           "z_loss": float(sums[2] / max(sums[3], 1)),
           "tokens_per_expert": [int(c) for c in counts[0].tolist()],
           "dropped": int(dropped[0])}
    if ep > 1:
        out["ep_tokens"] = [[int(v) for v in row]
                            for row in flat[-ep * ep:].view(ep, ep).tolist()]
    return out
