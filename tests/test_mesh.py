import pytest
import torch

from edu3d.launch import launch
from edu3d.config.layout import Layout, LayoutError
from edu3d.model.gpt import config_from
from tests import workers


def test_design_example_groups():
    lay = Layout(dp=2, tp=2, pp=2)
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert lay.groups("world") == [list(range(8))]


@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 1), (2, 1, 1), (1, 4, 1), (3, 2, 2), (2, 3, 4)])
def test_coords_roundtrip_and_tp_fastest(dp, tp, pp):
    lay = Layout(dp=dp, tp=tp, pp=pp)
    for r in range(lay.world_size):
        c = lay.coords(r)
        assert lay.rank(*c) == r
        assert r == c.tp + tp * (c.dp + dp * c.pp)
    for dim in ("tp", "dp", "pp", "mp"):
        groups = lay.groups(dim)
        assert sorted(sum(groups, [])) == list(range(lay.world_size))  # a partition


def test_validation_messages_say_how_to_fix():
    cfg = config_from("tiny")  # 4 heads, 4 layers
    with pytest.raises(LayoutError, match=r"tp=3 does not divide n_heads=4; choose 1, 2, 4"):
        Layout(tp=3).validate(config=cfg)
    with pytest.raises(LayoutError, match=r"choose pp\*vpp <= 4"):
        Layout(pp=4, vpp=2).validate(config=cfg)
    with pytest.raises(LayoutError, match=r"8 ranks, but 4 were launched"):
        Layout(dp=2, tp=2, pp=2).validate(world_size=4)
    with pytest.raises(LayoutError, match=r"multiple of 6"):
        Layout(dp=3).validate(global_batch=8, microbatches=2)
    with pytest.raises(LayoutError, match=r"vpp=2 needs pipeline parallelism"):
        Layout(vpp=2).validate()  # as data, one rank may hold 2 chunks (chapter 05)
    with pytest.raises(LayoutError, match=r"dp=0 must be a positive integer"):
        Layout(dp=0)
    with pytest.raises(LayoutError, match=r"outside 0..7"):
        Layout(dp=8).coords(8)


def test_live_groups_match_layout_and_device_mesh():
    """8 real ranks: the groups the ranks build (proven by all-gathers) are the layout's, and
    they equal torch's init_device_mesh with dims (pp, dp, tp)."""
    lay = Layout(dp=2, tp=2, pp=2)
    live = launch(workers.group_members, 8, layout=lay, timeout=240, echo=False).results
    torch_groups = launch(workers.device_mesh_groups, 8, layout=lay, timeout=240,
                          echo=False).results
    for rank in range(8):
        for dim in ("tp", "dp", "pp", "mp"):
            assert live[rank][dim] == lay.group_of(rank, dim), (rank, dim)
        for dim in ("tp", "dp", "pp"):
            assert torch_groups[rank][dim] == lay.group_of(rank, dim), (rank, dim)


@pytest.mark.parametrize("lay,r", [(Layout(dp=4, cp=2, tp=2, pp=2), 2), (Layout(dp=4, tp=2), 4),
                                   (Layout(dp=8, cp=2, ep=4), 2),
                                   (Layout(dp=6, cp=2, ep=2, tp=2), 3)])
def test_hsdp_groups_are_torchtitans_mesh_and_megatrons_slices(lay, r):
    """``--hsdp r``: the shard groups are torchtitan's ``dp_shard x cp`` of the mesh
    ``(pp, dp_replicate, dp_shard, cp, tp)`` and Megatron's consecutive slices of each dp x cp
    group (its partial distributed optimizer); the replicate groups join the same places of
    the slices. Experts split their edp groups the same way (Megatron's expert groups)."""
    s = lay.dp // r * lay.cp
    grid = torch.arange(lay.world_size).reshape(lay.pp, r, lay.dp // r, lay.cp, lay.tp)
    assert lay.groups("shard", r) == sorted(grid.permute(0, 1, 4, 2, 3).reshape(-1, s).tolist())
    assert lay.groups("replicate", r) == sorted(grid.permute(0, 2, 3, 4, 1).reshape(-1, r)
                                                .tolist())
    assert lay.groups("shard", r) == sorted(g[i * s:(i + 1) * s] for g in lay.groups("dpcp")
                                            for i in range(r))
    e = lay.edp // r
    assert lay.groups("eshard", r) == sorted(g[i * e:(i + 1) * e] for g in lay.groups("edp")
                                             for i in range(r))
    assert lay.groups("ereplicate", r) == sorted(g[i::e] for g in lay.groups("edp")
                                                 for i in range(e))
    assert lay.groups("shard") == lay.groups("dpcp")  # one replica group: plain ZeRO
    for dim in ("shard", "replicate", "eshard", "ereplicate"):
        assert sorted(sum(lay.groups(dim, r), [])) == list(range(lay.world_size))


def test_hsdp_groups_of_the_docstring_and_their_refusals():
    lay = Layout(dp=4)
    assert lay.groups("shard", 2) == [[0, 1], [2, 3]]
    assert lay.groups("replicate", 2) == [[0, 2], [1, 3]]
    assert lay.group_of(3, "replicate", 2) == [1, 3]
    with pytest.raises(LayoutError, match=r"--hsdp 3 must divide dp=4 .* choose --hsdp in 1, 2, 4"):
        lay.groups("shard", 3)
    with pytest.raises(LayoutError, match=r"--hsdp 2 must divide the 1 ranks holding the same "
                                          r"experts .* choose --hsdp in 1 \(or a smaller --ep\)"):
        Layout(dp=2, ep=2).hsdp_sizes(2)
