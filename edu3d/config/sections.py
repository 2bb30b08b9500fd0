"""One run, written down once: a typed :class:`Run` in sections.

After reading this file you should understand what a training run is made of, and that it is
described in exactly one place, whoever reads it:

* **sections**, each a frozen dataclass, as torchtitan's job config is: :class:`Model` (a
  preset with overrides, and its mixture of experts), :class:`~edu3d.config.layout.Layout`
  (the degrees ``dp x cp x tp x pp``, ``vpp`` and ``ep``), :class:`Parallel` (each axis's
  knobs: ZeRO, buckets, the pipeline schedule, the context-parallel attention ...),
  :class:`Batch` (the global batch and how it is cut), :class:`Precision`, :class:`Memory`
  (recomputation, offload, frozen parameters), :class:`Training` (steps, optimizer and its
  schedule), :class:`Checkpoint` and :class:`Launch` (nodes, timeouts, faults, output);
* **one flag, one field**: every ``edu3d train`` flag is one field of one section, under the
  flag's name (``--bucket-mb`` is ``run.parallel.bucket_mb``), except where the section
  already says it (``--model`` is ``run.model.preset``, ``--precision`` is
  ``run.precision.dtype``). :data:`FLAGS` maps each flag to its section; :meth:`Run.of` builds
  a run from flag names (``Run.of(dp=2, zero=1)``), :meth:`Run.replace` changes some, and
  :meth:`Run.flat` gives them back (the JSON a rank receives);
* **every reader takes this run**: the command line is parsed into it once, the pre-flight
  checks it once, the ranks build their mesh from ``run.layout`` and their model from
  ``run.model``, :func:`~edu3d.parallel.parallelize.parallelize` reads ``run.parallel``, and
  the planner weighs a run it is given or candidates it makes with :meth:`Run.replace`: a
  prediction and a measurement describe the same object.

Frozen, so a run can be a dictionary key (the planner caches its estimates by run) and a rank
cannot change what the others were told. No torch, and nothing else of edu3d but the layout:
``edu3d train --help`` and a refused run start without torch.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from edu3d.config.layout import Layout


def flag(name: str) -> dict:
    """Field metadata: the ``edu3d train`` flag (with ``-`` as ``_``) this field is set by,
    where it is not the field's own name."""
    return {"flag": name}


def globs(text) -> tuple[str, ...]:
    """``"tok_emb.*, blocks.0.*"`` (or a list) -> ``("tok_emb.*", "blocks.0.*")``."""
    parts = text.split(",") if isinstance(text, str) else (text or ())
    return tuple(p.strip() for p in parts if p.strip())


@dataclass(frozen=True, slots=True)
class Model:
    """The model: a preset, each override (None: the preset's) replacing one field, and its
    mixture of experts (0 experts: every block keeps its dense MLP)."""

    preset: str = field(default="tiny", metadata=flag("model"))
    layers: int | None = None
    heads: int | None = None
    d_model: int | None = None
    seq: int | None = None
    vocab: int | None = None
    tie: bool | None = None
    vocab_pad: int = 1  # the vocabulary's tables padded to a multiple of this (64 on a GPU)
    experts: int = 0
    topk: int = 2
    moe_every: int = 1  # block i is a mixture of experts when i % moe_every == 0
    shared_experts: int = 0  # always-on experts beside the routed ones (DeepSeek)
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss_coef: float | None = None  # Switch/GShard loss; None: 1e-2, or 0 with bias
    aux_scope: str = "microbatch"  # its tokens: "microbatch", "sequence" or "global"
    z_loss_coef: float = 0.0  # router z-loss
    balance: str = "aux"  # or "bias": DeepSeek-V3's aux-loss-free per-expert bias
    router_dtype: str = "fp32"  # "fp64": parity tests score routers in double (no near-tie flips)


@dataclass(frozen=True, slots=True)
class Parallel:
    """How each axis of the layout does its work."""

    zero: int = 0
    hsdp: int = 1  # replica groups: ZeRO shards within dp*cp/hsdp ranks, all-reduces across
    grad_reduce: str = "per-microbatch"  # or "per-step": ZeRO-2/3 only (ZeRO-1, DDP: per step)
    dp_impl: str = "bucketed"  # or "naive", "flat", "overlap"
    bucket_mb: float = 25.0
    reverse_buckets: bool = True  # False: buckets in forward order (chapter 02's mistake)
    prefetch: bool = False  # ZeRO-3: gather the next unit early
    compress: str | None = None
    sp: bool = False
    tp_overlap: bool = False
    schedule: str = "1f1b"
    partition: str = "uniform"  # or "balanced"; "ends": the planner only (schedules.partition)
    cp_impl: str = "ring"  # or "allgather", "ulysses"
    cp_split: str = "zigzag"  # or "plain" (shows causal attention's imbalance)
    impl: str = "edu3d"  # or "torch": PyTorch's own APIs


@dataclass(frozen=True, slots=True)
class Batch:
    """The global batch (the same tokens whatever the layout) and how it is cut."""

    global_batch: int = 8  # sequences per step
    data: str = "synthetic"  # or "stdlib", "text:PATH": real text as bytes (edu3d.train.text)
    microbatches: int | None = None  # None: 1, or pp for a pipeline (Run.microbatches)
    batching: str = "fixed"  # or "pad", "bucket", "tokens", "pack"
    max_tokens: int | None = None  # tokens: each micro-batch's rows x longest at most this
    doc_mean: float | None = None  # mean document length (None: a quarter of seq_len)
    doc_sigma: float = 0.8  # spread: the standard deviation of the length's logarithm


@dataclass(frozen=True, slots=True)
class Precision:
    """The numbers a step computes in, and how fast (the same numbers)."""

    dtype: str = field(default="fp32", metadata=flag("precision"))  # or "bf16", "fp16", "fp8"
    fp8_scaling: str = "tensorwise"  # fp8: one scale per tensor, or "rowwise" (per row)
    fp8_recipe: str = "current"  # fp8: scales from this tensor, or "delayed" (amax history)
    fp8_history: int = 16  # fp8 delayed: steps of amax history
    attn: str = "sdpa"  # or "explicit": the attention scores as a tensor
    compile: bool = False  # torch.compile each block (inductor)
    no_tf32: bool = False  # keep fp32 matmuls in full fp32 on a GPU (TF32 is on by default)


@dataclass(frozen=True, slots=True)
class Memory:
    """What is kept, where: recomputation, ZeRO's optimizer offload, activation offload,
    frozen parameters."""

    recompute: str = "none"  # or "selective", "full"
    offload: bool = False  # ZeRO: the optimizer state (and its update) on the CPU
    offload_activations: bool = False  # blocks' saved tensors in host memory until backward
    offload_every: int = 1  # ... of every k-th block (0, k, 2k, ...)
    offload_last: bool = False  # ... the model's last block's too (kept on the device by default)
    freeze: tuple[str, ...] = ()  # globs over serial names: no gradient, no optimizer state

    def __post_init__(self):  # "a.*,b.*" or a list: a tuple, so that a run stays hashable
        object.__setattr__(self, "freeze", globs(self.freeze))

    def offloaded(self, n_layers: int) -> tuple[int, ...]:
        """The blocks whose saved tensors ``--offload-activations`` moves to host memory:
        every ``offload_every``-th from block 0, the last one only with ``offload_last`` (its
        backward follows its forward at once: moving it would only cost two copies)."""
        if not self.offload_activations or self.offload_every < 1:
            return ()
        return tuple(i for i in range(0, n_layers, self.offload_every)
                     if i < n_layers - 1 or self.offload_last)


OFFLOAD_HELP = (  # --offload-activations, --offload-every, --offload-last (edu3d train's help)
    "move the tensors each block saves for backward to host memory (pinned, copied on a side "
    "stream on a GPU) and back for its backward: the same numbers, less device memory",
    "with --offload-activations: only every k-th block (0, k, 2k ...)",
    "with --offload-activations: the last block's too (by default it stays on the device: "
    "its backward comes right after its forward)")


@dataclass(frozen=True, slots=True)
class Training:
    """The optimization: steps, seed, the optimizer and its learning-rate schedule."""

    steps: int = 60
    seed: int = 0  # seeds the weights and the data
    lr: float = 3e-3  # the peak learning rate
    warmup: int = 0
    lr_schedule: str = "constant"  # or "cosine" (down to lr/10 at the last step)
    weight_decay: float = 0.1
    clip: float = 1.0  # max global gradient norm; 0 disables
    optimizer: str = "adamw"  # or "sgd"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Sharded checkpoints, and restarts from them."""

    ckpt_dir: str | None = None
    save_every: int | None = None
    keep_last: int | None = None
    resume: bool = False
    resume_step: int | None = None  # continue this step's checkpoint (implies resume)
    async_save: bool = False
    incremental: bool = False  # content-addressed blobs: a save writes only changed tensors
    max_restarts: int = 0


@dataclass(frozen=True, slots=True)
class Fault:
    """``--inject-fault``: rank ``rank`` exits, is killed or hangs at step ``step`` (once), or
    sleeps ``seconds`` before every step from ``step`` on (``kind="slow"``)."""

    rank: int
    step: int = 1
    kind: str = "exit"  # or "kill", "hang", "slow"
    seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Launch:
    """How the ranks are started, watched and heard: nodes, timeouts, faults, output."""

    timeout: float = 600.0
    heartbeat: float | None = None
    oversubscribe: bool = False  # start more ranks than the cores hold (edu3d.launch.cores)
    inject_fault: Fault | None = None
    nnodes: int | None = None  # one edu3d train per node, each running world/nnodes ranks
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None
    json: bool = False
    monitor: bool = False  # a live table of every rank under the output (edu3d.launch.live)
    log_every: int = 1  # read the loss (a host synchronisation) every K steps
    memory_timeline: str | None = None  # write the last step's memory timeline (JSON) here
    attempt: int = 0  # which restart this is (--max-restarts); faults fire in attempt 0 only

    def __post_init__(self):  # a dict (JSON, a chapter) becomes a Fault
        if isinstance(self.inject_fault, dict):
            object.__setattr__(self, "inject_fault", Fault(**self.inject_fault))


SECTIONS = {"model": Model, "layout": Layout, "parallel": Parallel, "batch": Batch,
            "precision": Precision, "memory": Memory, "training": Training,
            "checkpoint": Checkpoint, "launch": Launch}


def _flags() -> dict[str, tuple[str, str]]:
    out = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            out[f.metadata.get("flag", f.name)] = (section, f.name)
    return out


FLAGS = _flags()  # flag name ("bucket_mb") -> (section, field): ("parallel", "bucket_mb")
ALIASES = {"grad_accum": "microbatches"}  # --grad-accum is --microbatches


@dataclass(frozen=True, slots=True)
class Run:
    """One training run: every section, each at ``edu3d train``'s defaults."""

    model: Model = field(default_factory=Model)
    layout: Layout = field(default_factory=Layout)
    parallel: Parallel = field(default_factory=Parallel)
    batch: Batch = field(default_factory=Batch)
    precision: Precision = field(default_factory=Precision)
    memory: Memory = field(default_factory=Memory)
    training: Training = field(default_factory=Training)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    launch: Launch = field(default_factory=Launch)

    # ---- flag names ---------------------------------------------------------------------
    @classmethod
    def of(cls, **flags) -> "Run":
        """A run from flag names, the rest at their defaults: ``Run.of(dp=2, zero=1)``."""
        return cls().replace(**flags)

    def replace(self, **flags) -> "Run":
        """This run with some flags changed: ``run.replace(pp=2, schedule="gpipe")``."""
        for alias, name in ALIASES.items():
            value = flags.pop(alias, None)
            if value is None:
                continue
            if flags.get(name) not in (None, value):
                raise ValueError(f"--{alias.replace('_', '-')} {value} and --{name} "
                                 f"{flags[name]} are the same option; give one of them")
            flags[name] = value
        unknown = sorted(set(flags) - set(FLAGS))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; a run's options are "
                            f"edu3d train's flags: {', '.join(FLAGS)}")
        changed: dict[str, dict] = {}
        for name, value in flags.items():
            section, attr = FLAGS[name]
            changed.setdefault(section, {})[attr] = value
        lay = {**dataclasses.asdict(self.layout), **changed.get("layout", {})}
        if lay["ep"] > 1 and lay["dp"] * lay["cp"] == 1:  # --ep N alone is --dp N --ep N
            changed["layout"] = {**changed["layout"], "dp": lay["ep"]}
        return dataclasses.replace(self, **{s: dataclasses.replace(getattr(self, s), **kw)
                                            for s, kw in changed.items()})

    def flat(self) -> dict:
        """Every flag with its value (a fault as a dict): what JSON carries to a rank, and
        what :meth:`of` takes back."""
        out = {}
        for name, (section, attr) in FLAGS.items():
            value = getattr(getattr(self, section), attr)
            out[name] = dataclasses.asdict(value) if isinstance(value, Fault) else value
        return out

    # ---- what follows from the sections ---------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def microbatches(self) -> int:
        """Micro-batches per step: ``batch.microbatches``, by default 1, or pp for a pipeline."""
        return self.batch.microbatches or self.layout.pp

    @property
    def micro_batch(self) -> int:
        """Sequences in one micro-batch of one data-parallel rank."""
        return self.batch.global_batch // (self.layout.dp * self.microbatches)


def from_flags(argv: list[str]) -> Run:
    """The run of an ``edu3d train`` command line written as data (``"--dp 2 --zero 1"``,
    split), as the course and the benchmarks show a layout; ``--flag`` alone sets a boolean.
    The command itself parses with :mod:`edu3d.commands.train`, which also checks ranges."""
    out, i = {}, 0
    while i < len(argv):
        name = argv[i][2:].replace("-", "_") if argv[i].startswith("--") else None
        name = ALIASES.get(name, name)
        if name not in FLAGS:
            raise ValueError(f"{argv[i]!r}: not an edu3d train option (e.g. --dp 2)")
        section, attr = FLAGS[name]
        hint = typing.get_type_hints(SECTIONS[section])[attr]
        kinds = [k for k in typing.get_args(hint) or (hint,) if k is not type(None)]
        if kinds == [bool]:
            out[name], i = True, i + 1
            continue
        kind = str if typing.get_origin(kinds[0]) is tuple else kinds[0]  # --freeze's globs
        if kind not in (int, float, str):
            raise ValueError(f"{argv[i]}: not written as data; use Run.of({name}=...)")
        if i + 1 == len(argv):
            raise ValueError(f"{argv[i]}: give a value (e.g. {argv[i]} 2)")
        out[name], i = kind(argv[i + 1]), i + 2
    return Run.of(**out)
