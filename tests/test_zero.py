"""ZeRO equals the serial model, and its memory and traffic are what the paper says.

One launch per world size (2, 4, 8) runs stages 1, 2 and 3 (3 also with prefetch), with and
without gradient accumulation, on a model whose unit sizes are odd (padding on every unit):

* gradients after one SGD step and weights after 3 AdamW steps within 1e-5 relative;
* measured bytes of params + grads + optimizer state per rank within 2% of
  ``zero_bytes`` (fp32: stage 1 ``8Ψ + 8Ψ/N``, stage 2 ``4Ψ + 12Ψ/N``, stage 3 ``16Ψ/N``);
* with ``offload`` the optimizer state leaves the device: 4Ψ + 4Ψ/N there (stage 2) and
  16Ψ/N bytes in host memory;
* bytes moved per step, summed from the trace (all-reduce 2S, all-gather and reduce-scatter
  S, the paper's count), equal ``2Ψ`` for stages 1-2 and ``3Ψ`` for stage 3 within 1%; and
  ``2Ψ`` for plain DP. With K micro-batches and ``--grad-reduce per-step`` the same:
  gradients accumulate locally and are reduced once, after the last backward, and stage 3
  gathers once for the forwards and once for the backwards (the price is memory: full
  gradients during the step). Per micro-batch (the default) stage 2 moves ``(K + 1)Ψ`` and
  stage 3 ``3KΨ`` (tests/test_zero_grad_reduce.py checks the memory it saves).

At 8 ranks only the accumulating configurations run (2 and 4 cover K = 1), to keep CI short.
"""

import functools

import pytest

from edu3d.launch import launch
from edu3d.plan.formulas import zero_bytes
from tests.test_dp import ADAM_STEPS, parity_worker, report_and_check, serial_reference

CONFIGS = [{"name": f"zero{s}/k{k}", "zero": s, "grad_accum": k, "grad_reduce": "per-step"}
           for s in (1, 2, 3) for k in (1, 2)] + [
    {"name": f"zero{s}-per-microbatch/k2", "zero": s, "grad_accum": 2} for s in (2, 3)] + [
    {"name": "zero3-prefetch/k2", "zero": 3, "grad_accum": 2, "prefetch": True,
     "grad_reduce": "per-step"},
    {"name": "zero2-offload/k2", "zero": 2, "grad_accum": 2, "offload": True,
     "grad_reduce": "per-step"},
    {"name": "dp/k1", "zero": 0, "grad_accum": 1},
    {"name": "dp/k2", "zero": 0, "grad_accum": 2}]  # no_sync: still 2Ψ with 2 micro-batches


def configs_for(world: int) -> list[dict]:
    return [c for c in CONFIGS if world < 8 or c["grad_accum"] > 1]


def expected_traffic(stage: int, k: int, mode: str = "per-step") -> int:
    """Elements per rank per step, in units of Ψ: per step the same with ``k`` accumulated
    micro-batches as with one (gradients are reduced once, after the last backward; ZeRO-3
    gathers once for the forwards and once for the backwards); per micro-batch stage 2
    reduce-scatters ``k`` times and stage 3 also gathers twice per micro-batch."""
    if mode == "per-microbatch" and stage > 1:
        return k + 1 if stage == 2 else 3 * k
    return {0: 2, 1: 2, 2: 2, 3: 3}[stage]
PAPER_COUNT = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


def traffic_elements(events, case: str, rank: int, step: int = 1) -> float:
    """Elements moved by one rank in one step, in the ZeRO paper's count."""
    return sum(PAPER_COUNT.get(e["op"], 0) * e["bytes"] / 4 for e in events
               if e.get("case") == case and e["rank"] == rank and e.get("step") == step
               and e["lane"] == "comm")


@functools.lru_cache(maxsize=None)
def run_all(world: int):
    """Every configuration of ``world`` ranks in one launch (shared by the tests below)."""
    return launch(parity_worker, world, args=(configs_for(world), serial_reference()),
                  timeout=240, echo=False)


# 8 first: the 4- and 2-rank launches then run on its idle warm pool (edu3d.launch.warm.pool: a larger
# idle pool runs a smaller job) instead of starting pools of their own
@pytest.mark.parametrize("world", [pytest.param(8, marks=pytest.mark.slow), 4, 2])
def test_zero_stages_equal_serial_with_formula_memory_and_traffic(world):
    result = run_all(world)
    summary = result.results[0]
    report_and_check(world, summary)
    events = result.events()
    for cfg in configs_for(world):
        name, stage = cfg["name"], cfg["zero"]
        for rank, per_rank in enumerate(result.results):
            entry = per_rank[name]
            psi = entry["psi"]
            measured = entry["memory"]["total"]
            offload = cfg.get("offload", False)
            predicted = zero_bytes(psi, world, stage, optimizer_bytes=0 if offload else 8)["total"]
            if offload:  # master shard + its gradient + two moments in host memory: 16Ψ/N
                assert abs(entry["memory"]["host"] / (16 * psi / world) - 1) < 0.02
            print(f"world {world} {name} rank {rank}: memory {measured / predicted:.4f} of "
                  f"formula", end="; ")
            assert abs(measured / predicted - 1) < 0.02, (name, rank, entry["memory"])
            moved = traffic_elements(events, f"{name}/adamw", rank)
            want = expected_traffic(stage, cfg["grad_accum"],
                                    cfg.get("grad_reduce", "per-microbatch")) * psi
            print(f"traffic {moved / psi:.4f} psi")
            assert abs(moved / want - 1) < 0.01, (name, rank, moved / psi)


def test_zero3_holds_at_most_two_gathered_units_and_frees_them():
    """From the ``mem`` events ZeRO-3 records on every gather and free: during a step a rank
    holds its shards plus at most two full units (the one computing and the next one, whose
    backward hook can fire first), and after the step only its shards."""
    world, name = 2, "zero3/k1"
    result = run_all(world)  # the 2-rank launch of the test above, zero3/k1 among its configs
    for rank in range(world):
        mem = [e for e in result.events() if e["lane"] == "mem" and e["rank"] == rank
               and e.get("case") == f"{name}/adamw" and e.get("step") == ADAM_STEPS
               and e["op"] == "params"]  # (the engine's mem events count activations)
        resident = [e["mem"]["params"] for e in mem]
        psi = result.results[rank][name]["psi"]
        units = [3159, 9099, 9099, 2781]  # embed, 2 blocks, head of the test model (d=27)
        assert sum(units) == psi
        shards = sum(-(-u // world) for u in units) * 4
        assert resident[-1] == shards
        assert max(resident) <= shards + 4 * 2 * max(units)
        assert max(resident) < shards + 4 * psi  # never everything at once


def test_zero_figures_build_from_run_shaped_data():
    from edu3d.plan.formulas import zero_bytes
    from edu3d.widgets.zero import memory_bars_figure, resident_params_figure, sharding_map_figure

    fig = sharding_map_figure([("embed", 10, 12), ("block0", 30, 32)], 4, stage=2)
    params, grads, _ = fig.data
    assert list(params.x) == [44] * 4  # stage 2: every rank holds all parameters
    assert list(grads.x) == [3, 8] * 4 and list(grads.base[:2]) == [0, 12]  # ... a grad shard
    measured = {s: zero_bytes(1000, 4, s) for s in range(4)}
    assert "1.0000" in memory_bars_figure(measured, 1000, 4).layout.title.text
    events = [{"rank": 0, "lane": "mem", "op": "params", "t0": t, "t1": t, "step": 1,
               "mem": {"params": b}} for t, b in ((0, 100), (5, 400), (9, 100))]
    # the last level is held a little past the last record, so the final free shows
    assert list(resident_params_figure(events, 100, 4, 1).data[0].y) == [1e-4, 4e-4, 1e-4, 1e-4]
