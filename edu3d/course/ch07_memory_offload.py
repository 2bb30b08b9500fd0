"""Chapter 07's activation offloading: the same step recorded with nothing freed, with the
blocks' saved tensors in host memory, and with recomputation.

After reading this file you should know where the section's curves and numbers come from:

* :func:`sweep` records, in **one** launch of 2 ranks (tiny model, dp=2, as section 9), the
  second step of every setting of :data:`MODES` for each micro-batch count of
  :data:`MICROBATCHES` with the run's memory recorder
  (:func:`edu3d.course.ch07_memory_timeline.record`: ``edu3d train --memory-timeline``'s
  document); then it times the blocks alone, forward and backward, in each mode
  (:func:`edu3d.bench.bench_offload.offload_benchmark`, the ``edu3d bench offload`` rows,
  which refuse to time unless every mode's gradients equal the plain blocks' bit for bit);
* :func:`curves` reads the fullest rank's timeline of one micro-batch count: at each event
  of the step, the activations on the device (what autograd keeps, the offloaded blocks'
  tensors only while their forward runs or once their backward brought them back) and,
  for the offloading modes, the bytes waiting in the host pool;
* :func:`table` puts each mode's measured peaks beside the planner's
  (:func:`edu3d.plan.estimate.estimate`: ``activations`` on the device, ``host`` in the host
  pool), with the bytes copied each way and the blocks' time; :func:`takeaway` says it in
  a sentence.

On a CPU the "host" is a second pool of the same RAM: what is measured is what leaves the
autograd graph's device pool (counted by the offloader, byte for byte), and the time of the
copies (``memcpy``, no PCIe): a floor of what a GPU pays, where the copies cross the host
link on a side stream that overlaps compute. Bytes repeat exactly run to run; times do not.
"""

from __future__ import annotations

from edu3d.bench.bench_offload import offload_benchmark
from edu3d.config.layout import Layout
from edu3d.course.ch07_memory_timeline import fullest, record_many
from edu3d.launch import launch
from edu3d.model.gpt import config_from

BASE = ["--dp", "2", "--global-batch", "8", "--steps", "2"]
#: the modes compared, as ``edu3d train`` flags (the tiny model's last block stays on the
#: device unless ``--offload-last``: its backward comes right after its forward)
MODES = {
    "none": [],
    "offload": ["--offload-activations"],
    "full recompute": ["--recompute", "full"],
    "full + offload": ["--recompute", "full", "--offload-activations"],
}
MICROBATCHES = (1, 2)
#: the bench's row of each mode (the blocks alone: there every block is offloaded)
BENCH_ROWS = {"none": "none", "offload": "offload", "full recompute": "full",
              "full + offload": "full + offload"}


def argv_of(mode: str, microbatches: int) -> list[str]:
    """``edu3d train``'s flags for one mode at ``microbatches`` micro-batches."""
    return BASE + ["--microbatches", str(microbatches)] + MODES[mode]


def record_and_time(mesh, argvs: list[list[str]], reps: int) -> dict | None:
    """Launch target: every setting recorded, then the blocks timed; rank 0 returns both."""
    docs = record_many(mesh, argvs)
    bench = offload_benchmark(mesh, reps=reps, batch=4, config=config_from("tiny"))
    return None if mesh.rank else {"docs": docs, "bench": bench}


def sweep(reps: int = 5, timeout: float = 300) -> dict:
    """Every mode at every micro-batch count, in one launch of 2 ranks: ``{"docs": {(mode,
    microbatches): document}, "bench": edu3d bench offload's report}``."""
    keys = [(mode, m) for m in MICROBATCHES for mode in MODES]
    got = launch(record_and_time, 2, args=([argv_of(*k) for k in keys], reps),
                 timeout=timeout, echo=False, name="offload-timelines",
                 layout=Layout(dp=2)).results[0]
    return {"docs": dict(zip(keys, got["docs"])), "bench": got["bench"]}


def record(microbatches: int, timeout: float = 300) -> dict:
    """Every mode at ``microbatches`` recorded again (the panel's button), 2 ranks:
    ``{(mode, microbatches): document}``."""
    docs = launch(record_many, 2, args=([argv_of(mode, microbatches) for mode in MODES],),
                  timeout=timeout, echo=False, name="offload-timelines",
                  layout=Layout(dp=2)).results[0]
    return {(mode, microbatches): doc for mode, doc in zip(MODES, docs)}


def curves(res: dict, microbatches: int) -> dict[str, dict]:
    """``{mode: {"x", "device", "host", "phase"}}`` of the fullest rank at ``microbatches``:
    the event number, the activations on the device, the host pool's bytes (0 where nothing
    is offloaded), the step's phase at each sample."""
    out = {}
    for mode in MODES:
        samples = fullest(res["docs"][(mode, microbatches)])["samples"]
        out[mode] = {"x": list(range(len(samples))),
                     "device": [s["activations"] for s in samples],
                     "host": [s.get("host", 0) for s in samples],
                     "phase": [s["phase"] for s in samples]}
    return out


def table(res: dict) -> list[dict]:
    """One row per setting: the fullest rank's measured peaks (activations on the device,
    host pool, the whole device) beside the planner's (its ``transient``: the loss's logits
    gradient, or the offloaded blocks brought back for backward, two on a GPU, which
    prefetches), the bytes copied out and back in the step, and the blocks' time over the
    plain blocks' (the bench offloads every block, the last one too)."""
    rows = {r["name"].split(" blocks ", 1)[1]: r for r in res["bench"]["results"]}
    out = []
    for (mode, m), doc in res["docs"].items():
        tl = fullest(doc)
        plan = doc["planner"]["peak"]["per_stage"][tl["coord"][0]]
        moved = tl.get("offload", {})
        bench = rows[BENCH_ROWS[mode]]
        out.append({"mode": mode, "microbatches": m,
                    "activations": tl["peak_of"]["activations"],
                    "planned_activations": plan["activations"],
                    "planned_transient": plan["transient"],
                    "host": moved.get("host_peak", 0), "planned_host": plan["host"],
                    "total": tl["peak"]["total"], "planned_total": plan["total"],
                    "moved_out": moved.get("moved_out", 0), "moved_in": moved.get("moved_in", 0),
                    "slowdown": bench["slowdown"]})
    return out


def takeaway(rows: list[dict], microbatches: int = 1) -> str:
    """One sentence: what offloading and recomputation did to the activations' peak."""
    by = {r["mode"]: r for r in rows if r["microbatches"] == microbatches}
    none, off, full = by["none"], by["offload"], by["full recompute"]
    return (f"Offloading cut the activations' peak from {none['activations'] / 1e6:.2f} MB to "
            f"{off['activations'] / 1e6:.2f} MB by keeping {off['host'] / 1e6:.2f} MB in "
            f"host memory; full recomputation to {full['activations'] / 1e6:.2f} MB by "
            "computing the blocks' forward twice.")
