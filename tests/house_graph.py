"""edu3d's modules and the imports between them, read from the source with `ast`.

Nothing here imports edu3d (or torch): a module is a file, an import is a statement, so the
house rules of tests/test_house.py are checked in well under a second on any checkout.

The resolution rules are those of ../shared/tools/import_cycles.py:
- the files of `edu3d/` are the modules `edu3d.*`, those of `widgets/` are `edu3d.widgets.*`
  (pyproject.toml installs `widgets/` as `edu3d.widgets`); `x/__init__.py` is the module `x`;
- an imported name is resolved to the longest module prefix that exists: `from edu3d.launch
  import worker` imports `edu3d.launch` and `edu3d.launch.worker`; `from edu3d.distributed.mesh import
  Mesh` imports `edu3d.distributed.mesh`;
- a module importing its own parent package's `__init__` (`from edu3d import comm` inside
  `edu3d.distributed`) does not count as importing that `__init__`: Python has run it already;
- top-level and function-level imports count alike (both are dependencies a reader must know).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

# (folder under the project root, the package it is installed as)
SOURCES = (("edu3d", "edu3d"), ("widgets", "edu3d.widgets"))


@dataclass(frozen=True)
class Module:
    name: str         # edu3d.launch.worker
    rel: str          # edu3d/launch/worker.py, relative to the project root, with /
    text: str
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.rel.endswith("/__init__.py")

    @property
    def lines(self) -> int:
        return len(self.text.splitlines())

    @property
    def docstring(self) -> str:
        return ast.get_docstring(self.tree) or ""


@dataclass(frozen=True)
class Import:
    """One import statement, its names made absolute (`from .mesh import Mesh` in edu3d.distributed
    gives `edu3d.distributed.mesh` and `edu3d.distributed.mesh.Mesh`)."""
    module: str                  # the importing module
    line: int
    names: tuple[str, ...]
    local: bool                  # inside a function or method
    node: ast.Import | ast.ImportFrom


@dataclass(frozen=True)
class Edge:
    """`source` imports the edu3d module `target` at `line`."""
    source: str
    target: str
    line: int
    local: bool


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _statements_with_scope(body: list[ast.stmt], in_function: bool = False):
    """Every import statement in `body`, in source order, and whether it sits in a function.
    Only statements are visited: an import is a statement, never part of an expression."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt, in_function
        inner = in_function or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
        blocks = [getattr(stmt, f, []) for f in ("body", "orelse", "finalbody")]
        blocks += [h.body for h in getattr(stmt, "handlers", [])]
        blocks += [c.body for c in getattr(stmt, "cases", [])]
        for block in blocks:
            yield from _statements_with_scope(block, inner)


class House:
    """The modules under `root` (a checkout of edu3d) and their imports."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.modules: dict[str, Module] = {}
        for folder, package in SOURCES:
            for path in sorted((self.root / folder).rglob("*.py")):
                rel = path.relative_to(self.root / folder).with_suffix("")
                if any(part.startswith(".") for part in rel.parts):
                    continue  # .ipynb_checkpoints/ and the like are no modules
                parts = [p for p in rel.parts if p != "__init__"]
                name = ".".join([package, *parts])
                text = path.read_text(encoding="utf-8")
                self.modules[name] = Module(name, path.relative_to(self.root).as_posix(), text,
                                            ast.parse(text, filename=str(path)))

    def resolve(self, name: str) -> str | None:
        """The longest prefix of the dotted `name` that is an edu3d module, or None."""
        while name and name not in self.modules:
            name = name.rpartition(".")[0]
        return name or None

    def package_of(self, module: str) -> str:
        """The package that relative imports in `module` start from."""
        return module if self.modules[module].is_package else module.rpartition(".")[0]

    def imports(self, module: str) -> list[Import]:
        return self._imports[module]

    @cached_property
    def _imports(self) -> dict[str, list[Import]]:
        out = {}
        for m, mod in self.modules.items():
            pkg = self.package_of(m)
            found = []
            for node, local in _statements_with_scope(mod.tree.body):
                if isinstance(node, ast.Import):
                    names = tuple(a.name for a in node.names)
                else:
                    base = node.module or ""
                    if node.level:
                        up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                        base = ".".join(up + ([base] if base else []))
                    names = (base, *(f"{base}.{a.name}" for a in node.names))
                found.append(Import(m, node.lineno, names, local, node))
            out[m] = found
        return out

    @cached_property
    def edges(self) -> list[Edge]:
        """Every import of one edu3d module by another, one per (source, target, line)."""
        seen, out = set(), []
        for m in self.modules:
            for imp in self.imports(m):
                for n in imp.names:
                    r = self.resolve(n)
                    if not r or r == m or (self.modules[r].is_package and m.startswith(r + ".")):
                        continue
                    if (m, r, imp.line) not in seen:
                        seen.add((m, r, imp.line))
                        out.append(Edge(m, r, imp.line, imp.local))
        return out

    @cached_property
    def graph(self) -> dict[str, set[str]]:
        g = {m: set() for m in self.modules}
        for e in self.edges:
            g[e.source].add(e.target)
        return g

    def where(self, module: str, line: int = 1) -> str:
        return f"{self.modules[module].rel}:{line}"

    def cycles(self) -> list[list[str]]:
        """The strongly connected components of more than one module (Tarjan), sorted."""
        return [c for c in self._components if len(c) > 1]

    @cached_property
    def _components(self) -> list[list[str]]:
        g = self.graph
        index, low, stack, on, out = {}, {}, [], set(), []

        def visit(v):
            index[v] = low[v] = len(index)
            stack.append(v)
            on.add(v)
            for w in sorted(g[v]):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))

        for v in sorted(g):
            if v not in index:
                visit(v)
        return out

    def height(self) -> tuple[int, list[str]]:
        """The height of the import graph and its longest chain, top first.

        A module importing no edu3d module is at height 1; any other sits one above the
        highest module it imports. A cycle counts as one step (its modules are shown joined
        by <->), so the height stays defined while a cycle is being broken."""
        comp_of = {m: i for i, c in enumerate(self._components) for m in c}
        succ = {i: set() for i in range(len(self._components))}
        for m, targets in self.graph.items():
            succ[comp_of[m]] |= {comp_of[t] for t in targets} - {comp_of[m]}
        best: dict[int, tuple[int, list[int]]] = {}
        # Tarjan emits components children first, so every successor is already measured
        for i in range(len(self._components)):
            below = max((best[j] for j in succ[i]), key=lambda hc: hc[0], default=(0, []))
            best[i] = (below[0] + 1, [i, *below[1]])
        if not best:
            return 0, []
        h, chain = max(best.values(), key=lambda hc: hc[0])
        return h, [" <-> ".join(self._components[i]) for i in chain]
