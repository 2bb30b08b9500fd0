"""The device mesh: a layout seen from one rank, with its process groups.

After reading this file you should understand how a :class:`~edu3d.config.layout.Layout`
(the degrees and the rank order, pure arithmetic) becomes the process groups one rank talks
over: every rank creates every group, in the same order (``new_group`` is a collective
call), and keeps its own in a :class:`Mesh` that is handed around explicitly: there is no
hidden global state.

Nothing in this module imports torch until a :class:`Mesh` is built (imports inside
functions), so the launcher and the ``edu3d`` command start without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edu3d.config.layout import HSDP_GROUPS, Coord, Layout


@dataclass
class Mesh:
    """A layout seen from one rank, with its process groups.

    Build it with :meth:`Mesh.build` after ``dist.init_process_group`` (see
    :func:`edu3d.distributed.runtime.init`). ``mesh.tp``, ``mesh.dp``, ``mesh.pp`` and ``mesh.mp`` are
    this rank's ``ProcessGroup`` objects; ``mesh.coord`` its coordinates; ``mesh.ranks(dim)``
    the global ranks of its group along ``dim``. Under HSDP (``hsdp`` replica groups,
    :meth:`add_hsdp`) ``mesh.group("shard")`` and ``mesh.group("replicate")`` too.
    """

    layout: Layout
    rank: int
    groups: dict = field(default_factory=dict, repr=False)
    hsdp: int = 1  # replica groups the "shard"/"replicate" groups were built for

    @classmethod
    def build(cls, layout: Layout, rank: int | None = None, hsdp: int = 1) -> "Mesh":
        import torch.distributed as dist

        world = dist.get_world_size()
        layout.validate(world_size=world)
        rank = dist.get_rank() if rank is None else rank
        mine = {"world": dist.group.WORLD}
        dims = ["tp", "dp", "pp", "mp"]
        if layout.cp > 1 or layout.ep > 1:
            dims += ["cp", "dpcp", "ep", "edp"]
        for dim in dims:
            # new_group is collective: every rank creates every group, in the same order.
            # group_desc names the group in traces ("dp", "tp", ...).
            for ranks in layout.groups(dim):
                pg = dist.new_group(ranks, group_desc=dim)
                if rank in ranks:
                    mine[dim] = pg
        if len(dims) == 4:  # no cp, no ep: the dense and expert averages are dp's
            mine["dpcp"] = mine["edp"] = mine["dp"]
        mesh = cls(layout, rank, mine)
        mesh.add_hsdp(hsdp)
        return mesh

    @property
    def coord(self) -> Coord:
        return self.layout.coords(self.rank)

    def ranks(self, dim: str) -> list[int]:
        return self.layout.group_of(self.rank, dim, self.hsdp)

    def size(self, dim: str) -> int:
        return len(self.ranks(dim))

    def index(self, dim: str) -> int:
        """This rank's position inside its group along ``dim``."""
        return self.ranks(dim).index(self.rank)

    def group(self, dim: str):
        return self.groups[dim]

    def add_groups(self, dim: str) -> None:
        """Create the process groups along ``dim`` (every rank must call, in the same order);
        this rank's becomes ``mesh.group(dim)``, ``None`` where it is in none of them."""
        import torch.distributed as dist

        if dim in self.groups:
            return
        self.groups[dim] = None
        for ranks in self.layout.groups(dim, self.hsdp):
            pg = dist.new_group(list(ranks), group_desc=dim)
            if self.rank in ranks:
                self.groups[dim] = pg

    def add_hsdp(self, replicas: int) -> None:
        """HSDP's groups for ``replicas`` replica groups (every rank must call, in the same
        order): ``shard`` (the ``dp·cp/replicas`` ranks one ZeRO shards over) and
        ``replicate`` (the ranks holding the same shard), and the experts' ``eshard`` and
        ``ereplicate`` under expert parallelism (:meth:`Layout.groups
        <edu3d.config.layout.Layout.groups>`). With one replica group there is nothing to
        build: ZeRO shards over ``dpcp``. Built again when ``replicas`` changes."""
        if replicas == 1 or (replicas == self.hsdp and "shard" in self.groups):
            return
        self.layout.hsdp_sizes(replicas)  # a LayoutError before any group is made
        self.hsdp = replicas
        for dim in HSDP_GROUPS[:2] + (HSDP_GROUPS[2:] if self.layout.ep > 1 else ()):
            self.groups.pop(dim, None)
            self.add_groups(dim)

    def release(self) -> None:
        """Drop the process groups (before ``destroy_process_group``): a group object that
        outlives it is destroyed during interpreter exit, which can abort gloo."""
        self.groups.clear()

    tp = property(lambda self: self.groups["tp"])
    dp = property(lambda self: self.groups["dp"])
    pp = property(lambda self: self.groups["pp"])
    mp = property(lambda self: self.groups["mp"])
