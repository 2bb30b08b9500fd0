"""Expert parallelism: each rank of an expert-parallel group keeps E/ep of every MoE layer's
experts, and tokens travel to them (:mod:`edu3d.parallel.ep.dispatch`).

After reading this file you should understand:

* that expert parallelism shards *parameters* but not work: every rank still routes its own
  tokens (router, shared experts and the balancing bias stay replicated), then sends each
  row to the rank holding its expert;
* that the serial names survive: ``blocks.i.mlp.experts.5.fc.weight`` is still called that,
  it just exists on one rank of the group only, so checkpoints and parity tests line up;
* that the layer's token statistics span other ranks too (:func:`apply_token_groups`): the
  context-parallel ranks of the same sequences always, every data rank of the step under
  ``--aux-scope global`` (:mod:`edu3d.model.balance`);
* the gradient rule. Rank r's loss ``L_r`` is its own tokens' loss, and the trainer's loss is
  the mean over the D data-parallel (x context-parallel) ranks, ``L = (1/D) Σ_r L_r``:

  - an expert's gradient on its owner already holds ``Σ_{r in EP group} ∂L_r/∂θ_e`` (the
    all-to-all's backward brought every group member's contribution home). Sum it over the
    *expert-data-parallel* group (the ranks holding the same expert in the other EP groups,
    D/ep of them) and divide by **D**, the same divisor as the dense gradients;
  - the router, the shared experts, the bias buffer and everything outside the MoE layers
    hold ``∂L_r/∂θ`` of this rank's tokens only: sum over all D ranks, divide by D, as dense.

  :func:`expert_param_names` tells the gradient synchroniser which is which.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from edu3d.distributed import comm
from edu3d.model.moe import MoE, TokenGroups
from edu3d.parallel.cp.zigzag import positions
from edu3d.parallel.ep.dispatch import ExpertDispatcher


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def apply_ep(model: nn.Module, group, ep_rank: int, ep: int) -> nn.Module:
    """In place: every MoE layer keeps only experts ``[ep_rank·E/ep, (ep_rank+1)·E/ep)`` and
    exchanges tokens over ``group`` (whose rank ``ep_rank`` this process is)."""
    for name, layer in moe_layers(model):
        E = layer.n_experts
        if E % ep:
            raise ValueError(f"{name}: {E} experts do not split evenly over ep={ep} ranks; "
                             f"choose ep among {[d for d in range(1, E + 1) if E % d == 0]}")
        mine = range(ep_rank * E // ep, (ep_rank + 1) * E // ep)
        for e in range(E):
            if e not in mine and str(e) in layer.experts:
                del layer.experts[str(e)]
        layer.dispatcher = ExpertDispatcher(group, ep_rank, ep, E)
    return model


def token_groups(mesh, seq_len: int, split: str = "zigzag") -> TokenGroups:
    """The ranks a mixture-of-experts layer's token statistics span on ``mesh``: the
    context-parallel group, with this rank's positions in a ``seq_len`` sequence cut by
    ``split``, and every dp x cp rank of the step (``--aux-scope global``)."""
    seq = TokenGroups()
    if mesh.layout.cp > 1:
        cp_rank = mesh.index("cp")
        seq = TokenGroups(mesh.group("cp"), mesh.layout.cp, cp_rank,
                          torch.tensor(positions(seq_len, mesh.layout.cp, cp_rank, split)))
    return dataclasses.replace(seq, data=mesh.group("dpcp"), data_size=mesh.size("dpcp"))


def apply_token_groups(model: nn.Module, groups: TokenGroups) -> nn.Module:
    """In place: every MoE layer counts its tokens over ``groups`` (the context-parallel
    group a micro-batch's sequences are cut over, and every data rank of the step for
    ``--aux-scope global``); its collectives are :mod:`edu3d.distributed.comm`'s, traced."""
    for _, layer in moe_layers(model):
        layer.use_groups(dataclasses.replace(groups, collectives=comm))
    return model


def expert_param_names(model: nn.Module) -> set[str]:
    """Serial names of the routed experts' parameters this model holds: reduce these over the
    expert-data-parallel group (divided by the full data-parallel size), the rest as dense."""
    return {f"{name}.experts.{p}" for name, layer in moe_layers(model)
            for p, _ in layer.experts.named_parameters()}
