"""Expert parallelism (GShard, Switch; Megatron's and torchtitan's EP), applied to the serial
mixture-of-experts layer of :mod:`edu3d.model.moe`.

Read in this order: :mod:`~edu3d.parallel.ep.dispatch` (the two all-to-alls and the reorders
around the experts), :mod:`~edu3d.parallel.ep.placement` (which rank keeps which experts, and
which gradients are reduced over which group, which ranks a layer's token statistics span).
"""

from edu3d.parallel.ep.dispatch import ExpertDispatcher, Route, combine, dispatch
from edu3d.parallel.ep.placement import (apply_ep, apply_token_groups, expert_param_names,
                                         moe_layers)

__all__ = ["ExpertDispatcher", "Route", "apply_ep", "apply_token_groups", "combine",
           "dispatch", "expert_param_names", "moe_layers"]
