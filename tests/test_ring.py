"""edu3d's hand-written collectives agree with torch.distributed, and move exactly the bytes
the formulas say: ring all-reduce 2(N-1)/N·S per rank, reduce-scatter and all-gather
(N-1)/N·S, for every N in 2..8 and sizes not divisible by N (one 8-rank launch; groups of
the first N ranks)."""

import pytest
import torch
import torch.distributed as dist

from edu3d.course import ch01_collectives as ch01
from edu3d.distributed import algorithms as ring, trace
from edu3d.launch import launch

SIZES = (1, 7, 1001, 840)  # 1 element (most ranks get an empty chunk), odd, odd, 840 = lcm(1..8)
TOL = dict(rtol=1e-5, atol=1e-6)


def _data(size, rank, n):
    g = torch.Generator().manual_seed(1000 * n + 10 * rank + size)
    return torch.randn(size, generator=g)


def check_collectives(mesh):
    """Every algorithm on groups of the first n ranks; returns failures (empty = all agree)."""
    rank, rec, failures = dist.get_rank(), trace.current(), []
    for n in range(2, dist.get_world_size() + 1):
        group = dist.new_group(list(range(n)))  # collective: every rank creates it
        if rank >= n:
            continue
        for size in SIZES:
            x = _data(size, rank, n)
            want = x.clone()
            dist.all_reduce(want, group=group)

            def case(algo):
                return rec.context(case=f"{algo}/n{n}/s{size}")

            with case("all_reduce"):
                got = ring.ring_all_reduce(x.clone(), group)
            if not torch.allclose(got, want, **TOL):
                failures.append(f"ring_all_reduce n={n} size={size}")
            with case("reduce_scatter"):
                mine = ring.ring_reduce_scatter(x.clone(), group)
            if not torch.allclose(mine, torch.tensor_split(want, n)[rank], **TOL):
                failures.append(f"ring_reduce_scatter n={n} size={size}")
            slots = torch.zeros(size)
            torch.tensor_split(slots, n)[rank].copy_(torch.tensor_split(x, n)[rank])
            with case("all_gather"):
                ring.ring_all_gather(slots, group)
            full = torch.cat([torch.tensor_split(_data(size, r, n), n)[r] for r in range(n)])
            if not torch.equal(slots, full):
                failures.append(f"ring_all_gather n={n} size={size}")
            root = n - 1
            with case("broadcast"):
                b = ring.tree_broadcast(x.clone(), root, group)
            if not torch.equal(b, _data(size, root, n)):
                failures.append(f"tree_broadcast n={n} size={size}")
            with case("reduce"):
                r = ring.tree_reduce(x.clone(), root, group)
            if rank == root and not torch.allclose(r, want, **TOL):
                failures.append(f"tree_reduce n={n} size={size}")
            for per_node in (2, 3):
                with case(f"hier{per_node}"):
                    h = ring.hierarchical_all_reduce(x.clone(), per_node, group)
                if not torch.allclose(h, want, **TOL):
                    failures.append(f"hierarchical_all_reduce({per_node}) n={n} size={size}")
    return failures


@pytest.fixture(scope="module")
def run8():
    return launch(check_collectives, 8, timeout=240, echo=False)


def test_results_equal_dist_all_reduce(run8):
    assert run8.results == [[]] * 8


def _sent(events, case, rank=None):
    return sum(e["bytes"] for e in events if e["op"] == "send" and e.get("case") == case
               and (rank is None or e["rank"] == rank))


def test_bytes_from_trace_equal_the_formulas(run8):
    events = run8.events()
    for n in range(2, 9):
        for size in SIZES:
            s = size * 4  # fp32
            # summed over ranks exact for any size: each rank skips a different chunk
            assert _sent(events, f"all_reduce/n{n}/s{size}") == 2 * (n - 1) * s
            assert _sent(events, f"reduce_scatter/n{n}/s{size}") == (n - 1) * s
            assert _sent(events, f"all_gather/n{n}/s{size}") == (n - 1) * s
            assert _sent(events, f"broadcast/n{n}/s{size}") == (n - 1) * s
            assert _sent(events, f"reduce/n{n}/s{size}") == (n - 1) * s
            for per_node in (2, 3):
                nodes = ring.node_groups(range(n), per_node)
                inside = sum(len(node) - 1 for node in nodes)
                want = 2 * inside * s + 2 * (len(nodes) - 1) * s
                assert _sent(events, f"hier{per_node}/n{n}/s{size}") == want
        # per rank: exactly 2(N-1)/N·S when N divides S (840 = lcm(1..8)); otherwise each
        # rank skips its own chunk in reduce-scatter and its right neighbour's in all-gather
        for rank in range(n):
            assert _sent(events, f"all_reduce/n{n}/s840", rank) == 2 * (n - 1) * 840 * 4 // n
            assert _sent(events, f"reduce_scatter/n{n}/s840", rank) == (n - 1) * 840 * 4 // n
            chunks = [c.numel() for c in torch.tensor_split(torch.empty(1001), n)]
            sent = _sent(events, f"all_reduce/n{n}/s1001", rank)
            assert sent == 4 * (2 * 1001 - chunks[rank] - chunks[(rank + 1) % n])


def test_plans_are_what_the_docstring_says():
    plan = ring.ring_plan(4)
    assert len(plan) == 2 * 3 * 4
    # after reduce-scatter, position i has received every chunk it owns last: chunk i
    last_rs = [t for t in plan if t.phase == "reduce_scatter" and t.step == 2]
    assert sorted((t.dst, t.chunk) for t in last_rs) == [(i, i) for i in range(4)]
    first_ag = [t for t in plan if t.phase == "all_gather" and t.step == 0]
    assert all(t.chunk == t.src for t in first_ag)
    bcast = ring.tree_plan(8, root=3)
    assert len(bcast) == 7 and {t.dst for t in bcast} == set(range(8)) - {3}
    assert max(t.step for t in bcast) == 2  # log2(8) rounds
    red = ring.tree_plan(5, root=0, phase="reduce")
    assert {t.src for t in red} == {1, 2, 3, 4} and red[-1].dst == 0


def test_replay_of_a_ring_trace_ends_with_every_rank_holding_every_sum():
    from edu3d.widgets.collectives import ring_states

    n, chunk_bytes = 4, 40
    events = [{"op": "send", "algo": "ring_all_reduce", "phase": t.phase, "ring_step": t.step,
               "rank": t.src, "peer": t.dst, "chunk": t.chunk, "bytes": chunk_bytes}
              for t in ring.ring_plan(n)]
    states = ring_states(events, n)
    assert len(states) == 1 + 2 * (n - 1)
    after_rs = states[n - 1]["counts"]
    assert all(after_rs[i][i] == n for i in range(n))  # rank i owns the full sum of chunk i
    assert states[-1]["counts"] == [[n] * n for _ in range(n)]
    assert states[-1]["sent"] == 2 * (n - 1) * n * chunk_bytes


def test_alpha_beta_fit_recovers_a_known_model():
    from edu3d.bench.bench_comm import fit_alpha_beta

    n, alpha, beta = 4, 50e-6, 1e-9
    sizes = [2**k for k in range(10, 27, 2)]
    times = [2 * (n - 1) * alpha + 2 * (n - 1) / n * s * beta for s in sizes]
    a, b = fit_alpha_beta(sizes, times, n)
    assert abs(a / alpha - 1) < 1e-6 and abs(b / beta - 1) < 1e-6


def test_collectives_figures_build_from_run_shaped_data():
    from edu3d.widgets.collectives import bytes_figure, cost_model_figure, gallery_figure

    gallery = [{op: {"before": [10 * r, 10 * r + 1], "after": None if op == "reduce" and r
                     else [r, r + 1]} for op in ch01.GALLERY} for r in range(3)]
    fig = gallery_figure(gallery, "all_gather")
    assert len(fig.layout.updatemenus[0].buttons) == len(ch01.GALLERY)
    assert len(bytes_figure({2: 4000.0, 4: 6000.0}, 4000).data) == 2
    rows = [{"op": "all_reduce", "bytes": s, "edu3d_s": 1e-3, "reference_s": 1e-3,
             "reference": "torch.distributed.all_reduce", "edu3d_alpha_s": 1e-4,
             "edu3d_beta_s_per_byte": 1e-9, "edu3d_model_s": 1e-3, "reference_alpha_s": 1e-4,
             "reference_beta_s_per_byte": 1e-9, "reference_model_s": 1e-3} for s in (1024, 4096)]
    assert len(cost_model_figure({"world_size": 4, "results": rows}).data) == 4
