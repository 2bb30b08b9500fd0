"""Chapter 03's HSDP section, live: what its cells print is what 4 ranks really did.

One launch of 4 ranks trains two steps of the tiny GPT at ZeRO-3 with ``--hsdp R`` for
R = 1, 2, 4 (:mod:`edu3d.course.ch03_zero_hsdp`). For every R: the losses equal the serial
model's, every rank's bytes per step inside its replica group and across the groups (from
the trace) equal :func:`edu3d.plan.zero_modes.hsdp_wire_bytes` to the byte, the fullest
rank's state equals the planner's, and the groups each rank all-gathered over are the
layout's (the cube's agreement count)."""

from __future__ import annotations

from edu3d.config.layout import Layout
from edu3d.course import ch03_zero_hsdp as hsdp
from edu3d.widgets.mesh3d import agreement, dims_of


def test_every_replica_count_equals_serial_formula_and_planner():
    rows = hsdp.table(hsdp.run(progress=False))
    assert hsdp.agreement(rows) == ("3 runs: every rank's bytes per group equal the "
                                    "formula's in 3")
    for row in rows:
        print(f"\nR = {row['R']}: loss vs serial {row['loss_rel']:.1e}, sent "
              f"{ {g: row[g + '_measured'] for g in hsdp.GROUPS} } formula "
              f"{ {g: row[g] for g in hsdp.GROUPS} }")
        assert row["loss_rel"] < 1e-5, row["R"]
        assert sorted(row["per_rank"]) == [0, 1, 2, 3]
        assert {c: row[f"{c}_measured"] for c in hsdp.STATE} == {c: row[c] for c in hsdp.STATE}
        same, total = agreement(Layout(dp=4), row["reports"], row["R"], dims_of(row["R"],
                                                                                "shard"))
        assert same == total, (row["R"], same, total)
    assert rows[1]["replicate"] > 0 and rows[0]["replicate"] == 0 == rows[2]["shard"]
