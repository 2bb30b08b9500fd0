"""Parameter names matched by globs: what ``--freeze 'tok_emb.*,blocks.0.*'`` selects.

After reading this file you can say which parameters a ``--freeze`` (``edu3d train`` and
``edu3d plan``) names, and why both commands agree on it: the rule lives here, below both the
runtime that freezes (:mod:`edu3d.parallel.freeze`) and the planner that counts what a frozen
parameter costs (:mod:`edu3d.plan.inventory`), so neither can drift from the other.

* the globs match the **serial** model's parameter names (``tok_emb.weight``,
  ``blocks.0.attn.qkv.weight``, ``lm_head.weight``) with :func:`fnmatch.fnmatchcase`: ``*``
  crosses dots, so ``blocks.0.*`` is the whole first block and ``*.bias`` every bias;
* a glob that matches nothing is almost always a typo: :func:`check_patterns` refuses it in
  one line that shows a few real names; freezing every parameter is refused too (nothing
  would train).

Pure string work, no torch: the planner names a model's parameters from its shape alone.
"""

from __future__ import annotations

import fnmatch


def patterns(spec: str | None) -> tuple[str, ...]:
    """``"tok_emb.*, blocks.0.*"`` -> ``("tok_emb.*", "blocks.0.*")`` (empty: nothing)."""
    return tuple(p.strip() for p in (spec or "").split(",") if p.strip())


def frozen(name: str, globs) -> bool:
    """Whether any of ``globs`` matches the serial parameter name ``name``."""
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def matching(names, globs) -> list[str]:
    """The names any of ``globs`` matches, in ``names``' order."""
    return [n for n in names if frozen(n, globs)]


def check_patterns(names: list[str], globs) -> list[str]:
    """The names ``globs`` freeze; ``ValueError`` (one line) for a glob matching nothing, or
    for globs freezing every parameter (nothing would train)."""
    for g in globs:
        if not matching(names, [g]):
            some = ", ".join(dict.fromkeys(names[:2] + names[-2:] + [
                n for n in names if n.startswith("blocks.0.")][:2]))
            raise ValueError(f"--freeze {g!r} matches no parameter (names are the serial "
                             f"model's, e.g. {some}, ...; '*' matches across dots)")
    out = matching(names, globs)
    if len(out) == len(names):
        raise ValueError(f"--freeze {','.join(globs)} freezes all {len(names)} parameters: "
                         "nothing would train; freeze fewer")
    return out
