"""The layout of a run: how many ranks along each axis, and which rank sits where.

After reading this file you should understand:

* a layout ``Layout(dp, tp, pp, vpp, cp, ep)`` cuts ``dp * cp * tp * pp`` ranks into a grid;
* the rank order is Megatron's ``tp-cp-dp-pp``: TP varies fastest, then CP (context
  parallelism: ranks holding parts of the same sequences), then DP, then PP, so
  ``rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))``. Tensor-parallel
  partners (who talk every layer) are neighbours, pipeline partners (who talk least) are
  farthest apart. Without CP this is the same order as
  ``init_device_mesh(..., (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))``;
* **expert parallelism** adds no ranks: it folds inside the ``dp x cp`` ranks (Megatron's and
  torchtitan's rule). Number those ranks ``e = cp_rank + cp * dp_rank``; groups of ``ep``
  consecutive ``e`` share out the experts (``ep`` groups) and the ranks with the same
  ``e % ep`` hold the same experts (``edp``, the expert-data-parallel groups). Dense
  gradients are averaged over ``dpcp`` (all ``dp x cp`` ranks), expert ones over ``edp``;
* a *group* along a dimension is the set of ranks that differ only in that coordinate. With
  tp=dp=pp=2 (8 ranks): TP groups [0,1][2,3][4,5][6,7], DP groups [0,2][1,3][4,6][5,7],
  PP groups [0,4][1,5][2,6][3,7];
* **HSDP** (hybrid sharding, ``--hsdp R``) cuts the dp coordinate in two: ``dp = R x dp/R``,
  the shard coordinate ``dp % (dp/R)`` faster, the replica coordinate ``dp // (dp/R)``
  slower, so the order reads ``tp-cp-dp_shard-dp_replicate-pp``: torchtitan's mesh
  ``(pp, dp_replicate, dp_shard, cp, tp)`` and Megatron's partial distributed optimizer
  (``num_distributed_optimizer_instances``), whose groups are consecutive slices of each
  ``dp-cp`` group. A **shard** group is one slice: ``S = dp·cp/R`` consecutive ``e`` (the
  ``dp/R`` shard ranks times every cp rank, torchtitan's ``dp_shard_cp``), over which ZeRO
  shards; a **replicate** group joins the ranks at the same place of each slice (R of
  them), which hold the same shard and all-reduce it. Experts split their ``edp`` group
  the same way (``eshard``: consecutive slices of ``edp/R``, ``ereplicate`` across them, as
  Megatron's expert groups). With dp=4 (and nothing else): shard groups [0,1][2,3],
  replicate groups [0,2][1,3].

This is arithmetic on integers, with no torch and no process: a layout is checked, and its
groups listed, before any rank starts (the planner weighs a million layouts this way).
:class:`edu3d.distributed.mesh.Mesh` turns a layout into one rank's process groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

DIMS = ("pp", "dp", "cp", "tp")  # slowest to fastest
# the groups a layout can name: the mesh's own dimensions, and the ones derived from them
HSDP_GROUPS = ("shard", "replicate", "eshard", "ereplicate")  # --hsdp R's, see above
GROUP_NAMES = DIMS + ("mp", "embed", "dpcp", "ep", "edp", "world") + HSDP_GROUPS


class LayoutError(ValueError):
    """A layout that cannot work; the message says how to fix it."""


class Coord(NamedTuple):
    """A rank's position in the mesh."""

    pp: int
    dp: int
    tp: int


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, smallest first (the degrees a count can be split into): each
    ``d <= √n`` brings its partner ``n // d``, so a billion takes no time."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class Layout:
    """How ``world_size = dp * cp * tp * pp`` ranks are arranged.

    ``vpp`` is the number of virtual pipeline chunks per rank (interleaved schedules);
    ``cp`` splits each sequence over that many ranks; ``ep`` shares the experts of a mixture
    of experts over groups of that many of the ``dp * cp`` ranks (it adds no ranks).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "vpp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name}={value!r} must be a positive integer")
        if (self.dp * self.cp) % self.ep:
            ok = ", ".join(str(d) for d in divisors(self.dp * self.cp))
            raise LayoutError(f"ep={self.ep} must divide the dp*cp = {self.dp * self.cp} ranks "
                              f"that expert parallelism folds into; choose ep in {ok} (or "
                              f"raise --dp)")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in (pp, dp, tp) order, slowest dimension first ((pp, dp, cp, tp) with
        context parallelism)."""
        return (self.pp, self.dp, self.tp) if self.cp == 1 else (self.pp, self.dp, self.cp,
                                                                  self.tp)

    @property
    def edp(self) -> int:
        """Ranks holding the same experts: the expert-data-parallel degree ``dp*cp/ep``."""
        return self.dp * self.cp // self.ep

    def hsdp_sizes(self, hsdp: int, zero: int = 3) -> tuple[int, int]:
        """``(S, E)``: the ranks of one replica group under ``--hsdp hsdp``, dense (``dp·cp/R``)
        and expert (``edp/R``). Raises :class:`LayoutError` where ``hsdp`` does not divide
        ``dp`` (or, with expert parallelism, ``edp``), or replicas come without ZeRO."""
        if hsdp != 1 and not zero:
            raise LayoutError(f"hsdp={hsdp} shards ZeRO's state in replica groups; add zero 1-3")
        if not isinstance(hsdp, int) or isinstance(hsdp, bool) or hsdp < 1 or self.dp % hsdp:
            ok = ", ".join(str(d) for d in divisors(self.dp))
            raise LayoutError(f"--hsdp {hsdp!r} must divide dp={self.dp} (replica groups of "
                              f"dp/hsdp shard ranks); choose --hsdp in {ok}")
        if self.ep > 1 and self.edp % hsdp:
            ok = ", ".join(str(d) for d in divisors(self.edp) if self.dp % d == 0)
            raise LayoutError(f"--hsdp {hsdp} must divide the {self.edp} ranks holding the same "
                              f"experts (dp*cp/ep), whose ZeRO shards split the same way; "
                              f"choose --hsdp in {ok} (or a smaller --ep)")
        return self.dp * self.cp // hsdp, self.edp // hsdp

    def __str__(self) -> str:
        s = f"dp={self.dp} tp={self.tp} pp={self.pp}"
        s += "".join(f" {k}={v}" for k, v in (("cp", self.cp), ("ep", self.ep)) if v > 1)
        return s + (f" vpp={self.vpp}" if self.vpp > 1 else "")

    # ---- validation -------------------------------------------------------------------
    def validate(self, world_size: int | None = None, config: Any = None,
                 global_batch: int | None = None, microbatches: int | None = None) -> "Layout":
        """Check the layout against a world size, a model config and a batch.

        ``config`` is anything with ``n_layers``, ``n_heads`` and ``d_model`` (a
        :class:`edu3d.model.gpt.GPTConfig`). Raises :class:`LayoutError` with a fix.
        Returns ``self`` so calls chain.
        """
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"vpp={self.vpp} needs pipeline parallelism; set pp >= 2 or vpp=1")
        if world_size is not None and world_size != self.world_size:
            axes = "dp*cp*tp*pp" if self.cp > 1 else "dp*tp*pp"
            sizes = "*".join(str(getattr(self, a)) for a in axes.split("*"))
            raise LayoutError(
                f"{axes} = {sizes} = {self.world_size} ranks, but "
                f"{world_size} were launched; launch {self.world_size} ranks or choose "
                f"{axes.replace('*', ', ')} whose product is {world_size}")
        if config is not None:
            heads, layers = config.n_heads, config.n_layers
            if heads % self.tp:
                ok = ", ".join(str(d) for d in divisors(heads))
                raise LayoutError(f"tp={self.tp} does not divide n_heads={heads}; choose {ok}")
            if self.pp * self.vpp > layers:
                raise LayoutError(
                    f"pp*vpp = {self.pp}*{self.vpp} = {self.pp * self.vpp} stages but the model "
                    f"has only n_layers={layers}; each stage needs at least one layer, so "
                    f"choose pp*vpp <= {layers}")
        if global_batch is not None:
            mb = microbatches or 1
            if global_batch % (self.dp * mb):
                raise LayoutError(
                    f"global batch {global_batch} does not split into dp={self.dp} ranks x "
                    f"{mb} micro-batches; use a global batch that is a multiple of "
                    f"{self.dp * mb}")
        return self

    # ---- rank <-> coordinates ----------------------------------------------------------
    def coords(self, rank: int) -> Coord:
        """Coordinates of ``rank`` (TP fastest, then CP, then DP, then PP); the CP
        coordinate is :meth:`cp_index`."""
        c = self.coords_all(rank)
        return Coord(c["pp"], c["dp"], c["tp"])

    def coords_all(self, rank: int) -> dict:
        """``{"pp", "dp", "cp", "tp"}`` of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside 0..{self.world_size - 1} for {self}")
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return {"pp": pp, "dp": dp, "cp": cp, "tp": tp}

    def cp_index(self, rank: int) -> int:
        """Which part of each sequence ``rank`` holds (0 without context parallelism)."""
        return self.coords_all(rank)["cp"]

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """Inverse of :meth:`coords`."""
        for name, value, size in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp),
                                  ("cp", cp, self.cp)):
            if not 0 <= value < size:
                raise LayoutError(f"{name} coordinate {value} is outside 0..{size - 1} for {self}")
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def groups(self, dim: str, hsdp: int = 1) -> list[list[int]]:
        """All groups along ``dim``: 'tp', 'cp', 'dp', 'pp'; 'mp' (tp x pp: the ranks holding
        distinct pieces of one model replica), 'embed' (the first and last pipeline stage,
        which share a tied embedding), 'dpcp' (dp x cp: every rank of a dense gradient's
        average), 'ep' and 'edp' (expert parallelism's groups, see the module docstring),
        'world', or HSDP's 'shard', 'replicate', 'eshard' and 'ereplicate' under ``hsdp``
        replica groups (module docstring; with ``hsdp=1`` a shard group is a dpcp group).

        Each group lists ranks in increasing order; groups are sorted by their first rank.
        """
        if dim == "world":
            return [list(range(self.world_size))]
        if dim in ("mp", "embed", "dpcp", "ep", "edp") + HSDP_GROUPS:
            s, es = self.hsdp_sizes(hsdp) if dim in HSDP_GROUPS else (1, 1)
            out: dict = {}
            for r in range(self.world_size):
                c = self.coords_all(r)
                e = c["cp"] + self.cp * c["dp"]  # the rank's place among the dp x cp ranks
                pp, tp, x = c["pp"], c["tp"], e // self.ep  # x: its place in its edp group
                key = {"mp": (c["dp"], c["cp"]), "dpcp": (pp, tp),
                       "ep": (pp, tp, e // self.ep), "edp": (pp, tp, e % self.ep),
                       "embed": (c["dp"], c["cp"], tp, pp if 0 < pp < self.pp - 1 else -1),
                       "shard": (pp, tp, e // s), "replicate": (pp, tp, e % s),
                       "eshard": (pp, tp, e % self.ep, x // es),
                       "ereplicate": (pp, tp, e % self.ep, x % es)}[dim]
                out.setdefault(key, []).append(r)
            groups = sorted(out.values())
            if dim == "embed":  # first and last stage only; middle stages hold no copy
                groups = [g for g in groups if self.coords(g[0]).pp in (0, self.pp - 1)]
            return groups
        if dim not in DIMS:
            raise LayoutError(f"unknown mesh dimension {dim!r}; use one of "
                              f"{', '.join(GROUP_NAMES)}")
        out = {}
        for r in range(self.world_size):
            c = self.coords_all(r)
            key = tuple(v for k, v in c.items() if k != dim)
            out.setdefault(key, []).append(r)
        return sorted(out.values())

    def group_of(self, rank: int, dim: str, hsdp: int = 1) -> list[int]:
        """The group along ``dim`` (under ``hsdp`` replica groups) that contains ``rank``."""
        return next(g for g in self.groups(dim, hsdp) if rank in g)
