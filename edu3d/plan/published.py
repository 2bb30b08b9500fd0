"""Published measured training runs: the table a performance model is judged against.

After reading this file you should understand what a published throughput number means and
why it is data, not a constant:

* Each row is one run that a paper or a repository *measured* (Megatron-LM, torchtitan,
  nanotron, llm-foundry, BLOOM, Llama 3), with its citation, its model shape, layout, batch,
  precision and recomputation, and only the numbers the source printed. Nothing is derived:
  a source that printed an iteration time gets ``step_time_s``, not a computed tokens/s.
* "MFU" is not one quantity. Megatron's and Llama 3's MFU divide model FLOPs by the bf16
  peak; Narayanan et al.'s and BLOOM's "TFLOP/s" *count the recomputed forward* (hardware
  FLOPs); torchtitan's MFU uses ``6N + 12·l·h·q·s`` without the embedding; nanotron's and
  llm-foundry's count the LM head and the full (non-causal) attention square. Each row's
  ``notes`` say which; a model should compare tokens/s where it can.
* Where the source left a detail out (micro-batch size, pipeline engine) the field is ``None``
  and ``assumptions`` says so; a framework default is filled in only where the source implies
  it, and then ``assumptions`` cites the default. A detail the source's *text* fixes is
  entered with the derivation in ``assumptions`` (Llama 3's 8 chunks per rank).
* ``layout.partition`` (optional, absent: ``"uniform"``) is ``"ends"`` where the framework cuts
  the pipeline with the embedding and the head each in a layer's place (Llama 3, DeepSpeed's
  ``type:transformer|embedding``).

:func:`load_runs` checks every row (ranges, a known hardware profile, the layout's product
equal to the GPU count, a global batch that is a whole number of micro-batches per
data-parallel rank) and refuses a bad one in one line naming its id and the field.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass
from pathlib import Path

from edu3d.plan.hardware import profiles

RUNS_FILE = Path(__file__).with_name("data") / "published_runs.json"

PRECISIONS = ("bf16", "fp16", "fp8")
RECOMPUTE = ("none", "selective", "full", "op")  # op = torchtitan's op-level selective AC
RECIPES = ("torchtitan", "torchtitan-2025", "megatron", "nanotron", "deepspeed")
SCHEDULES = ("1f1b", "interleaved", "afab", "zbv")
PARTITIONS = ("uniform", "ends")  # edu3d.schedules.partition.uniform; absent: uniform
MLPS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
MEMORY_KINDS = ("max reserved", "max allocated")
FIELDS = ("id", "source", "url", "framework", "hardware", "gpus", "gpus_per_node", "model", "seq_len",
          "layout", "global_batch", "micro_batch", "precision", "recompute", "recipe", "compile",
          "measured", "assumptions", "notes")


class RunError(ValueError):
    """A published-run row that cannot be used; the message names the row and the field."""


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    mlp: str
    norm: str
    tied: bool
    experts: int
    topk: int


@dataclass(frozen=True)
class Layout:
    """Parallel degrees; ``zero`` 0 = DDP, 1, 2, 3 (FSDP full shard = 3). ``vpp``, ``zero``,
    ``sp`` and ``schedule`` are ``None`` where the source does not say."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    vpp: int | None
    zero: int | None
    sp: bool | None
    schedule: str | None
    partition: str = "uniform"  # "ends": the embedding and head each take a layer's place


@dataclass(frozen=True)
class Measured:
    """What the source printed: per-GPU tokens/s, per-GPU TFLOP/s (its own FLOP count),
    MFU as a fraction, iteration time, and peak memory in GiB with how it was read."""

    tokens_per_s_per_gpu: float | None
    tflops_per_gpu: float | None
    mfu: float | None
    step_time_s: float | None
    memory_gib: float | None
    memory_kind: str | None


@dataclass(frozen=True)
class PublishedRun:
    id: str
    source: str
    url: str
    framework: str
    hardware: str
    gpus: int
    gpus_per_node: int
    model: ModelShape
    seq_len: int
    layout: Layout
    global_batch: int
    micro_batch: int | None
    precision: str
    recompute: str | None
    recipe: str | None
    compile: bool
    measured: Measured
    assumptions: str
    notes: str

    @property
    def microbatches(self) -> int | None:
        """Micro-batches per data-parallel rank per step, where the micro-batch is known."""
        if self.micro_batch is None:
            return None
        return self.global_batch // (self.layout.dp * self.micro_batch)


def load_runs(path: str | Path = RUNS_FILE) -> list[PublishedRun]:
    """Every row of the published-runs table, checked; ids are unique."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RunError(f"{path}: cannot read the published-runs JSON ({err})") from None
    if not isinstance(rows, list):
        raise RunError(f"{path}: expected a JSON list of rows, got {type(rows).__name__}")
    known = set(profiles())
    runs, seen = [], set()
    for index, row in enumerate(rows):
        run = run_from_dict(row, known, where=f"row {index}")
        if run.id in seen:
            raise RunError(f"run {run.id}: id appears twice; ids must be unique")
        seen.add(run.id)
        runs.append(run)
    return runs


def run_from_dict(row: dict, known_hardware: set[str], where: str = "row") -> PublishedRun:
    """One checked row; ``known_hardware`` is the set of profile names a row may name."""
    if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not row["id"]:
        raise RunError(f"{where}: a row is an object with a non-empty string 'id'")
    rid = row["id"]
    check = Checker(rid)
    missing = [f for f in FIELDS if f not in row]
    if missing:
        raise RunError(f"run {rid}: missing field(s) {', '.join(missing)} (every field is present, null if unknown)")
    for field in ("source", "url", "framework", "assumptions", "notes"):
        check.text(row, field)
    if not row["url"].startswith("https://"):
        raise RunError(f"run {rid}: url {row['url']!r} must be an https:// link to the source")
    if row["hardware"] not in known_hardware:
        raise RunError(f"run {rid}: unknown hardware profile {row['hardware']!r}; "
                       f"choose one of {', '.join(sorted(known_hardware))}")
    model = model_shape(row["model"], check)
    layout = layout_of(row["layout"], check)
    measured = measured_of(row["measured"], check)
    gpus = check.int_in(row, "gpus", 1, 1_000_000)
    check.int_in(row, "gpus_per_node", 1, 64)
    product = layout.dp * layout.tp * layout.pp * layout.cp
    if product != gpus:
        raise RunError(f"run {rid}: layout dp x tp x pp x cp = {product} but gpus = {gpus}")
    check.int_in(row, "seq_len", 16, 10_000_000)
    global_batch = check.int_in(row, "global_batch", 1, 100_000_000)
    micro_batch = check.int_in(row, "micro_batch", 1, 100_000, nullable=True)
    if global_batch % layout.dp:
        raise RunError(f"run {rid}: global_batch {global_batch} is not a multiple of dp = {layout.dp}")
    if micro_batch is not None and (global_batch // layout.dp) % micro_batch:
        raise RunError(f"run {rid}: global_batch {global_batch} / dp {layout.dp} is not a whole number "
                       f"of micro-batches of {micro_batch}")
    check.choice(row, "precision", PRECISIONS)
    check.choice(row, "recompute", RECOMPUTE, nullable=True)
    check.choice(row, "recipe", RECIPES, nullable=True)
    if not isinstance(row["compile"], bool):
        raise RunError(f"run {rid}: compile must be true or false")
    return PublishedRun(
        id=rid, source=row["source"], url=row["url"], framework=row["framework"], hardware=row["hardware"],
        gpus=gpus, gpus_per_node=row["gpus_per_node"], model=model, seq_len=row["seq_len"], layout=layout,
        global_batch=global_batch, micro_batch=micro_batch, precision=row["precision"],
        recompute=row["recompute"], recipe=row["recipe"], compile=row["compile"], measured=measured,
        assumptions=row["assumptions"], notes=row["notes"])


def model_shape(data: object, check: Checker) -> ModelShape:
    """The row's ``model`` object, checked (heads divide d_model, kv heads divide heads)."""
    node = check.section(data, "model", ModelShape)
    sizes = {f: check.int_in(node, f, 1, 10_000_000, prefix="model.")
             for f in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size")}
    experts = check.int_in(node, "experts", 0, 100_000, prefix="model.")
    topk = check.int_in(node, "topk", 0, 1_000, prefix="model.")
    if sizes["d_model"] % sizes["n_heads"] or sizes["n_heads"] % sizes["n_kv_heads"]:
        check.fail(f"model.n_heads {sizes['n_heads']} must divide d_model {sizes['d_model']} and be a "
                   f"multiple of n_kv_heads {sizes['n_kv_heads']}")
    if (experts == 0) != (topk == 0) or topk > experts:
        check.fail(f"model.topk {topk} must be 0 for a dense model and at most experts {experts}")
    check.text(node, "name", prefix="model.")
    check.choice(node, "mlp", MLPS, prefix="model.")
    check.choice(node, "norm", NORMS, prefix="model.")
    if not isinstance(node["tied"], bool):
        check.fail("model.tied must be true or false")
    return ModelShape(name=node["name"], mlp=node["mlp"], norm=node["norm"], tied=node["tied"],
                      experts=experts, topk=topk, **sizes)


def layout_of(data: object, check: Checker) -> Layout:
    """The row's ``layout`` object, checked."""
    node = check.section(data, "layout", Layout)
    degrees = {f: check.int_in(node, f, 1, 1_000_000, prefix="layout.") for f in ("dp", "tp", "pp", "cp", "ep")}
    vpp = check.int_in(node, "vpp", 1, 1_000, nullable=True, prefix="layout.")
    zero = check.int_in(node, "zero", 0, 3, nullable=True, prefix="layout.")
    if node["sp"] is not None and not isinstance(node["sp"], bool):
        check.fail("layout.sp must be true, false or null")
    check.choice(node, "schedule", SCHEDULES, nullable=True, prefix="layout.")
    if degrees["pp"] == 1 and node["schedule"] is not None:
        check.fail(f"layout.schedule {node['schedule']!r} given but pp = 1; use null")
    part = node.get("partition", "uniform")
    if part not in PARTITIONS:
        check.fail(f"layout.partition {part!r}: choose one of {', '.join(PARTITIONS)} (absent: "
                   "uniform)")
    return Layout(vpp=vpp, zero=zero, sp=node["sp"], schedule=node["schedule"], partition=part,
                  **degrees)


def measured_of(data: object, check: Checker) -> Measured:
    """The row's ``measured`` object: at least one throughput figure, each in range."""
    node = check.section(data, "measured", Measured)
    tps = check.number_in(node, "tokens_per_s_per_gpu", 1.0, 1e7)
    tflops = check.number_in(node, "tflops_per_gpu", 1.0, 1e4)
    mfu = check.number_in(node, "mfu", 0.001, 1.0)
    step = check.number_in(node, "step_time_s", 1e-4, 1e5)
    memory = check.number_in(node, "memory_gib", 0.1, 1e4)
    if all(v is None for v in (tps, tflops, mfu, step)):
        check.fail("measured needs one of tokens_per_s_per_gpu, tflops_per_gpu, mfu or step_time_s")
    check.choice(node, "memory_kind", MEMORY_KINDS, nullable=True, prefix="measured.")
    if memory is None and node["memory_kind"] is not None:
        check.fail("measured.memory_kind is given without memory_gib")
    return Measured(tokens_per_s_per_gpu=tps, tflops_per_gpu=tflops, mfu=mfu, step_time_s=step,
                    memory_gib=memory, memory_kind=node["memory_kind"])


class Checker:
    """Field checks for one row, each failing with ``run <id>: <field> ...``."""

    def __init__(self, rid: str):
        self.rid = rid

    def fail(self, message: str):
        raise RunError(f"run {self.rid}: {message}")

    def section(self, data: object, name: str, shape: type) -> dict:
        fields = list(shape.__dataclass_fields__)
        if not isinstance(data, dict):
            self.fail(f"{name} must be an object with {', '.join(fields)}")
        missing = [f for f, spec in shape.__dataclass_fields__.items()
                   if f not in data and spec.default is MISSING]
        if missing:
            self.fail(f"{name} lacks {', '.join(missing)} (null where unknown)")
        return data

    def text(self, node: dict, field: str, prefix: str = ""):
        if not isinstance(node[field], str) or not node[field].strip():
            self.fail(f"{prefix}{field} must be a non-empty string")

    def choice(self, node: dict, field: str, allowed: tuple, nullable: bool = False, prefix: str = ""):
        value = node[field]
        if value is None and nullable:
            return
        if value not in allowed:
            self.fail(f"{prefix}{field} {value!r} is not one of {', '.join(allowed)}"
                      + (" (or null)" if nullable else ""))

    def int_in(self, node: dict, field: str, low: int, high: int, nullable: bool = False,
               prefix: str = "") -> int | None:
        value = node[field]
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self.fail(f"{prefix}{field} = {value!r} must be a whole number in [{low}, {high}]")
        return value

    def number_in(self, node: dict, field: str, low: float, high: float) -> float | None:
        value = node[field]
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            self.fail(f"measured.{field} = {value!r} must be null or a number in [{low:g}, {high:g}]")
        return float(value)
