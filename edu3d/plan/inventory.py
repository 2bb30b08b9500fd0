"""What one rank holds, tensor by tensor: the planner's inventory, by the serial model's names.

After reading this file you can list the parameters any rank of a layout holds, grouped as
ZeRO groups them, and say what ``--freeze`` takes out of that list:

* **units**: a pipeline rank holds the blocks of its stage(s), the first stage the
  embeddings, the last the final norm and the head, and with tied weights both the shared
  matrix, each cut by tensor parallelism (matrices split, norms and row biases whole). They
  come grouped in ZeRO's units and order (:func:`edu3d.parallel.zero.units.model_units`):
  ``tied``, ``embed``, ``block0`` ..., ``head``; a MoE block's routed experts are a list of
  their own (``experts=True``: ``E/ep`` whole experts, sharded over the expert-data-parallel
  ranks);
* **serial names**: every tensor carries the name it has in the serial GPT
  (``blocks.3.attn.qkv.weight``; :func:`serial_names` lists the whole model in
  ``named_parameters`` order, without torch). Tensor parallelism keeps these names on every
  tp rank, so a glob means the same parameters in every layout;
* **frozen** (``Setup.freeze``, the globs of ``--freeze``, matched by
  :mod:`edu3d.model.param_globs`, the rule the runtime uses): a frozen parameter belongs to
  no unit. It keeps its weights, whole on every dp rank even under ZeRO-3 (nothing shards
  it), and has no gradient and no optimizer state. So :func:`units` and :func:`held` count
  the trainable tensors only (what is reduced, sharded and stepped; ZeRO pads each unit's
  flat buffer without the frozen ones), and :func:`frozen_held` the frozen elements a rank
  keeps beside them. A unit left empty disappears, as in the runtime.

A routed expert is named by its index on ep rank 0 (``blocks.i.mlp.experts.0`` ...): a glob
that freezes some experts but not others counts ep rank 0's. Lists returned here are cached:
read them, never change them. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from edu3d.config.sections import Run
from edu3d.model.param_globs import check_patterns, frozen
from edu3d.model.shapes import ModelSpec
from edu3d.plan.formulas import as_moe
from edu3d.schedules.actions import chunks, placement, stages_of
from edu3d.schedules.partition import uniform

LEAF = {"w": "weight", "b": "bias"}
MLP = {"fc": "mlp.fc", "fc2": "mlp.proj", "gate": "mlp.gate", "up": "mlp.up", "down": "mlp.down"}


@dataclass(frozen=True)
class Shape:
    """What a rank's inventory depends on (a :class:`~edu3d.config.sections.Run` less the
    batch and the recipe): the cache key of every list here."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    schedule: str = "1f1b"
    ep: int = 1
    freeze: tuple[str, ...] = ()
    ends: bool = False  # the embedding and head take a layer's place in the cut (partition)


def shape_of(run: Run | Shape) -> Shape:
    """The :class:`Shape` of a run: all that its list of tensors depends on (a shape is its
    own)."""
    if isinstance(run, Shape):
        return run
    lay = run.layout
    return Shape(lay.tp, lay.pp, lay.vpp, run.parallel.schedule, lay.ep, run.memory.freeze,
                 run.parallel.partition == "ends")


def block_name(i: int, short: str) -> str:
    """The serial name of block ``i``'s tensor ``short`` (the planner's name in
    :meth:`~edu3d.model.shapes.ModelSpec.layer_tensors`): ``qkv.w`` -> ``blocks.i.attn.qkv.
    weight``, ``fc2.b`` -> ``blocks.i.mlp.proj.bias``, ``shared0.fc.w`` -> ``blocks.i.mlp.
    shared.0.fc.weight``, ``expert3.fc.w`` -> ``blocks.i.mlp.experts.3.fc.weight``."""
    stem, leaf = short.rsplit(".", 1)
    head, _, rest = stem.partition(".")
    for kind, where in (("shared", "shared"), ("expert", "experts")):
        if rest and head.startswith(kind):
            return f"blocks.{i}.mlp.{where}.{head[len(kind):]}.{MLP[rest][4:]}.{LEAF[leaf]}"
    if stem in ("ln1", "ln2"):
        path = stem
    elif stem == "router":
        path = "mlp.router"
    else:
        path = MLP.get(stem, f"attn.{stem}")
    return f"blocks.{i}.{path}.{LEAF[leaf]}"


@lru_cache(maxsize=64)
def serial_names(spec: ModelSpec) -> tuple[str, ...]:
    """Every parameter name of the serial model, in ``named_parameters`` order (a tied head
    is ``tok_emb.weight`` only): what ``--freeze`` globs are matched against."""
    spec = as_moe(spec)
    out = ["tok_emb.weight"] + (["pos_emb.weight"] if spec.learned_pos else [])
    for i in range(spec.n_layers):
        block = [n for n, _, _ in spec.block_tensors(i)]
        routed = [n for n, _, _ in spec.expert_tensors()] if spec.is_moe(i) else []
        shared = sum(n.startswith("shared") for n in block)
        block = block[:len(block) - shared] + routed + block[len(block) - shared:]
        out += [block_name(i, n) for n in block]
    out += ["ln_f.weight"] + (["ln_f.bias"] if spec.norm == "layernorm" else [])
    return tuple(out + ([] if spec.tied else ["lm_head.weight"]))


def check_freeze(spec: ModelSpec, freeze) -> None:
    """``ValueError`` (one line, :func:`edu3d.model.param_globs.check_patterns`) for a glob
    that matches no parameter of ``spec``, or globs that freeze every one."""
    if freeze:
        _check(spec, tuple(freeze))


@lru_cache(maxsize=256)  # a search estimates thousands of layouts of one model
def _check(spec: ModelSpec, freeze: tuple) -> None:
    check_patterns(list(serial_names(spec)), freeze)


def named_units(spec: ModelSpec, st, pp_rank: int, experts: bool = False) -> list[tuple]:
    """``(unit, [(serial name, elements on one tp rank, is a matrix)])`` of pipeline rank
    ``pp_rank``, frozen tensors included (the rank holds them all)."""
    shape = shape_of(st)
    return [(unit, _named(spec, shape.tp, shape.ep, key))
            for unit, key in _walk(spec, shape, pp_rank, experts)]


def units(spec: ModelSpec, st, pp_rank: int, experts: bool = False) -> list[tuple]:
    """``(unit, [(elements, is a matrix)])``: the trainable tensors of :func:`named_units`,
    in ZeRO's order (``experts``: each MoE block's ``E/ep`` routed experts instead)."""
    return _split(spec, shape_of(st), pp_rank, experts)[0]


def held(spec: ModelSpec, st, pp_rank: int, experts: bool = False) -> int:
    """Trainable elements of :func:`units` (one tp rank's, pipeline rank ``pp_rank``)."""
    return _split(spec, shape_of(st), pp_rank, experts)[1]


def frozen_held(spec: ModelSpec, st, pp_rank: int, experts: bool = False) -> int:
    """Frozen elements pipeline rank ``pp_rank`` holds on one tp rank: weights only."""
    return _split(spec, shape_of(st), pp_rank, experts)[2]


def frozen_params(spec: ModelSpec, freeze) -> int:
    """Parameters of the whole serial model that ``freeze`` freezes (every expert counted)."""
    whole = Shape(freeze=tuple(freeze))
    return frozen_held(spec, whole, 0) + frozen_held(spec, whole, 0, experts=True)


@lru_cache(maxsize=256)
def frozen_active(spec: ModelSpec, freeze: tuple) -> float:
    """Frozen parameters among the ``N`` of ``6N`` FLOPs per token (the blocks' tensors; a
    routed expert weighs ``k/E``, the share of tokens it serves): those a token computes no
    weight gradient for."""
    spec, freeze = as_moe(spec), tuple(freeze)
    if not freeze:
        return 0.0
    cold = _frozen_names(spec, freeze)
    dense = sum(k for i in range(spec.n_layers) for n, k, _ in spec.block_tensors(i)
                if block_name(i, n) in cold)
    routed = sum(k for i in range(spec.n_layers) if spec.is_moe(i)
                 for n, k, _ in spec.expert_tensors() if block_name(i, n) in cold)
    return dense + (routed * spec.topk / spec.experts if spec.experts else 0.0)


@lru_cache(maxsize=4096)
def frozen_share(spec: ModelSpec, freeze: tuple, i: int) -> float:
    """The fraction of block ``i``'s parameters (its routed experts left out) that ``freeze``
    freezes: the share of its weight-gradient work a step skips."""
    spec = as_moe(spec)
    if not freeze:
        return 0.0
    cold = _frozen_names(spec, tuple(freeze))
    tensors = spec.block_tensors(i)
    total = sum(k for _, k, _ in tensors)
    return sum(k for n, k, _ in tensors if block_name(i, n) in cold) / total if total else 0.0


@lru_cache(maxsize=4096)
def _split(spec: ModelSpec, shape: Shape, pp_rank: int, experts: bool) -> tuple:
    """(trainable units, their elements, frozen elements) of a rank: a sum of per-unit
    pieces, each cached, so that a search's thousands of layouts build each block once."""
    out, warm, cold = [], 0, 0
    for unit, key in _walk(spec, shape, pp_rank, experts):
        if key[0] == "experts" and not shape.freeze:
            key = ("experts", -1)  # every block's experts alike: one list object for all
        kept, n_warm, n_cold = _piece(spec, shape.tp, shape.ep, shape.freeze, key)
        warm, cold = warm + n_warm, cold + n_cold
        if kept:
            out.append((unit, kept))
    return out, warm, cold


@lru_cache(maxsize=65536)
def _piece(spec: ModelSpec, t: int, ep: int, freeze: tuple, key: tuple) -> tuple:
    """One unit's trainable ``[(elements, matrix)]``, their elements, and its frozen ones."""
    cold = _frozen_names(spec, freeze) if freeze else frozenset()
    named = _named(spec, t, ep, key)
    kept = _same(tuple((k, m) for n, k, m in named if n not in cold))
    return kept, sum(k for k, _ in kept), sum(k for n, k, _ in named if n in cold)


@lru_cache(maxsize=65536)
def _same(kept: tuple) -> list:  # equal lists are one object: the ZeRO count weighs it once
    return list(kept)


@lru_cache(maxsize=256)
def _frozen_names(spec: ModelSpec, freeze: tuple) -> frozenset:
    return frozenset(n for n in serial_names(spec) if frozen(n, freeze))


@lru_cache(maxsize=65536)
def _named(spec: ModelSpec, t: int, ep: int, key: tuple) -> list:
    kind, what = key
    spec = as_moe(spec)
    if kind == "tensors":
        return list(what)
    listed = spec.block_tensors(what, t) if kind == "block" else spec.expert_tensors(ep)
    return [(block_name(max(what, 0), n), k, m) for n, k, m in listed]


def _walk(spec: ModelSpec, st: Shape, pp_rank: int, experts: bool) -> list[tuple]:
    """The units of pipeline rank ``pp_rank``, each as ``(unit, key)``: ``("block", i)``,
    ``("experts", i)`` (block ``i``'s routed experts) or ``("tensors", ((name, elements,
    matrix), ...))`` for the embeddings and the head."""
    spec = as_moe(spec)
    parts = uniform(spec.n_layers, st.pp * chunks(st.schedule, st.vpp), ends=st.ends)
    n_stages, h = len(parts), spec.d_model
    tok = ("tok_emb.weight", spec.vocab_rows(st.tp) * h, True)
    norm = (("ln_f.weight", h, False),) + ((("ln_f.bias", h, False),)
                                           if spec.norm == "layernorm" else ())
    out = []
    for s in stages_of(pp_rank, st.pp, n_stages, placement(st.schedule)):
        if experts:
            out += [(f"block{i}.experts", ("experts", i)) for i in range(*parts[s])
                    if spec.is_moe(i)]
            continue
        first, last = s == 0, s == n_stages - 1
        tied = ("tied", ("tensors", (tok,)))
        if spec.tied and (first or last) and tied not in out:  # once: a V holds both ends
            out.append(tied)
        if first:
            emb = (() if spec.tied else (tok,)) + (
                (("pos_emb.weight", spec.seq_len * h, True),) if spec.learned_pos else ())
            if emb:
                out.append(("embed", ("tensors", emb)))
        out += [(f"block{i}", ("block", i)) for i in range(*parts[s])]
        if last:
            out.append(("head", ("tensors", norm + (
                () if spec.tied else (("lm_head.weight", tok[1], True),)))))
    return out
