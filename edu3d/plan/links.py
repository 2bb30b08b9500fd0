"""A collective's time on the links its group spans: latency per step plus bytes over bandwidth.

After reading this file you should be able to time any collective of a layout by hand:

* **alpha-beta** (Hockney's model, the one NCCL's own tuner uses): ``time = alpha x steps +
  bytes x algorithm factor / bus bandwidth``. A ring all-reduce over ``n`` ranks takes
  ``2(n-1)`` steps and sends ``2(n-1)/n`` of the buffer from every rank; reduce-scatter,
  all-gather and all-to-all ``n-1`` steps and ``(n-1)/n``; a send one step and the whole
  message. "Bus bandwidth" is nccl-tests' *busbw*: the rate that makes this formula true, so
  a measured busbw goes straight into it. Latency dominates small messages (a pipeline
  stage's activation at micro-batch 1, TP at small widths), bandwidth large ones;
* **which link**: ranks are numbered tp fastest, then cp, dp, pp (:mod:`edu3d.config.layout`),
  and ``gpus_per_node`` consecutive ranks share a node. A group whose members sit ``stride``
  ranks apart stays on NVLink when ``stride x size <= gpus_per_node``; otherwise it crosses
  nodes, and only its members on each node share that node's network cards: a data-parallel
  group of tp=8 layouts has one GPU per node, so one NIC's share of the node's bandwidth;
* **bandwidth falls with scale**: the inter-node figures are for 2 whole nodes, and lose
  ``inter_falloff`` per doubling (measured on one cluster; another network falls
  differently, which is why it is a profile's constant). What falls is the *ring*: its
  latency grows linearly with the ranks in it (NVIDIA's blog post "Massively Scale Your Deep
  Learning Training with NCCL 2.4", 2019, why NCCL added trees), and the measured series
  had 8 ranks per node. So a ring is charged the falloff of as many ranks on whole nodes: a
  data-parallel ring of one GPU on each of 32 nodes is 32 ranks, what 4 whole nodes hold;
* **all-reduce is not two collectives' worth everywhere**: NVLink SHARP (H100) reduces
  inside the switch, so its all-reduce bus bandwidth exceeds its all-gather's; a profile
  gives both (``bandwidth``, ``gather_bandwidth``).

On a CPU the "link" is gloo on loopback, measured by ``edu3d calibrate`` in the same form, each
kind of collective by itself (:func:`edu3d.plan.cpu.collective`: gloo's reduce-scatter is a
full all-reduce, its latencies differ by kind), plus the host's own seconds around each call
(``collective_overhead``: a rank's Python and copies around it, its wake-up after the wait).
No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from edu3d.config.layout import Layout
from edu3d.plan import cpu
from edu3d.plan.hardware import Profile

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


@dataclass(frozen=True)
class Link:
    """What a group's collectives run over: ``alpha`` s per step and bus bandwidths (B/s)."""

    name: str
    alpha: float
    allreduce: float
    gather: float
    kinds: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # measured per kind
    host: float = 0.0  # a CPU rank's own seconds around each collective (0 on a GPU)


def steps_and_factor(kind: str, n: int) -> tuple[int, float]:
    """Ring steps and the fraction of the buffer each rank sends, for ``n`` ranks."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n
    if kind == "send":
        return 1, 1.0
    raise ValueError(f"collective {kind!r}: choose one of {', '.join(KINDS)}")


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds for one collective of ``nbytes`` (the whole buffer) over ``n`` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps, factor = steps_and_factor(kind, n)
    alpha, bandwidth = link.kinds.get(kind) or (
        link.alpha, link.allreduce if kind == "all_reduce" else link.gather)
    return alpha * steps + nbytes * factor / bandwidth + link.host


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends for one collective (what ``traffic`` adds up)."""
    return 0.0 if n <= 1 else steps_and_factor(kind, n)[1] * nbytes


# ---- where a group's ranks sit -----------------------------------------------------------------
def stride_and_size(layout: Layout, axis: str) -> tuple[int, int]:
    """How far apart a group's consecutive members are, and how many there are."""
    tp, cp, dp, pp, ep = layout.tp, layout.cp, layout.dp, layout.pp, layout.ep
    return {"tp": (1, tp), "cp": (tp, cp), "dp": (tp * cp, dp), "dpcp": (tp, dp * cp),
            "pp": (tp * cp * dp, pp), "ep": (tp, ep), "edp": (tp * ep, dp * cp // ep)}[axis]


def placement(stride: int, size: int, gpus_per_node: int) -> tuple[int, int]:
    """``(nodes, members per node)`` of a group of ``size`` ranks ``stride`` apart."""
    if stride * size <= gpus_per_node:
        return 1, size
    per_node = max(1, gpus_per_node // stride)
    return -(-size // per_node), per_node


def link_for(profile: Profile, nodes: int, per_node: int) -> Link:
    """NVLink inside one node; across ``nodes`` the inter-node figures at that count, scaled
    by the share of each node's NICs the group's ``per_node`` members use."""
    if nodes <= 1:
        return Link("intra-node", profile.intra_alpha, profile.intra_bandwidth,
                    profile.intra_gather_bandwidth, {k: m for k in KINDS if (
                        m := cpu.collective(k, profile))}, profile.collective_overhead)
    share = min(1.0, per_node / profile.gpus_per_node)
    ring = max(2.0, nodes * per_node / profile.gpus_per_node)  # whole nodes of as many ranks
    return Link(f"inter-node ({nodes} nodes)", profile.inter_alpha,
                min(profile.intra_bandwidth, share * profile.inter_bandwidth_at(ring)),
                min(profile.intra_gather_bandwidth,
                    share * profile.inter_bandwidth_at(ring, gather=True)))


def group_link(profile: Profile, layout: Layout, axis: str) -> tuple[Link, int]:
    """The link a group along ``axis`` uses, and the group's size."""
    stride, size = stride_and_size(layout, axis)
    nodes, per_node = placement(stride, size, profile.gpus_per_node)
    return link_for(profile, nodes, per_node), size


def zero_links(profile: Profile, layout: Layout, axis: str,
               hsdp: int = 1) -> tuple[Link, int, Link | None]:
    """ZeRO's group along ``axis`` (``dpcp`` or ``edp``): its link and size, and under HSDP
    (``hsdp`` replica groups) the replica group's (``size/hsdp`` consecutive members) and the
    link of the all-reduce across the groups (``hsdp`` members, a replica group apart)."""
    link, n = group_link(profile, layout, axis)
    if hsdp == 1:
        return link, n, None
    stride, shard = stride_and_size(layout, axis)[0], n // hsdp
    inside = link_for(profile, *placement(stride, shard, profile.gpus_per_node))
    return inside, shard, link_for(profile, *placement(stride * shard, hsdp,
                                                       profile.gpus_per_node))


def pp_link(profile: Profile, layout: Layout) -> Link:
    """The link between neighbouring pipeline stages: across nodes when the ranks of one
    stage fill a node or more (every boundary crosses), else inside one (the common case
    of a small layout, where only some boundaries cross; the model takes the slower)."""
    stride = layout.tp * layout.cp * layout.dp
    crosses = stride * layout.pp > profile.gpus_per_node
    return link_for(profile, 2 if crosses else 1, 1)
