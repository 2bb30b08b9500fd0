"""The house rules: the shape of the edu3d package, checked from its source.

A newcomer should guess where a thing lives from the tree alone, read any module top to
bottom in one sitting, and trust that the library never depends on the course built on it.
These rules keep it that way (DESIGN.md, "The shape of the package"):

1. Folders name the concepts: the only loose modules in `edu3d/` are `__init__.py` and
   `cli.py` (and `comm.py`, if it only re-exports `edu3d.distributed`: learners write
   `from edu3d import comm`).
2. Imports go downwards, never round in a circle, and never sideways. The floors, bottom
   to top (a room is a folder of edu3d/, or a loose module; widgets/ is one room):
       F0  config                           what a run is: its layout and every section
       F1  distributed, model, schedules    what every rank uses; the serial reference;
                                            pipeline schedules as data
       F2  parallel, ckpt, plan, launch     the mechanics, each on its own
       F3  train                            one Trainer
       F4  production                       the same layouts on PyTorch's own APIs
       F5  bench                            edu3d timed against production and torch
       F6  course                           what the chapters compute and run
       F7  commands, widgets, edu3d         one module per subcommand; charts and panels;
                                            the package's face (`%load_ext edu3d`)
       F8  cli                              the `edu3d` command's parser and dispatch
   and, named on their own because each is a promise: the core (F1-F3) never imports the
   course, the widgets, production, bench or the commands; `production` is reached only
   through the commands (plus the few readers listed in PRODUCTION_DOORS); a chart never
   imports the course; the course never draws (ranks import it, and they have no plotly).
   The rooms' graph is at most MAX_HEIGHT floors tall (a room sits one floor above the
   highest room it imports), so a reader climbs few floors from a command to a collective.
3. No module reaches into another's private names (`from edu3d.x import _y`, `x._y`).
4. No file is longer than MAX_LINES lines: one concept, read in one go.
5. No file name repeats, so a name in a traceback is unambiguous; the one exception is a
   chapter's `chNN_topic.py` in `edu3d/course/` (numbers) and `widgets/panels/` (knobs),
   and then a notebook `notebooks/NN_topic.ipynb` must exist. An exercise's grader is named
   the same way: in its chapter's `chNN_topic.py`, or `chNN_topic_grade.py` beside it.
6. Imports sit at the top, where a reader looks for a file's dependencies; a module with
   imports inside functions says why in its docstring (the phrase "imports inside
   functions", then the reason, e.g. the launcher starts without importing torch).
7. The core takes typed configuration: no `argparse` and no `getattr(args, ...)` in
   distributed, model, schedules, parallel, train, ckpt, plan or launch (see test_the_core_takes_typed_config
   for the launcher's own entry points).
8. README's table and `edu3d/__init__.py`'s docstring show the real tree (formats in
   test_readme_table_lists_every_module and test_init_docstring_draws_the_tree), the tree
   in lines a screen shows whole.
9. One function cuts a global batch into a rank's micro-batches (`edu3d.train.cut.cut`):
   no other core module imports or calls the cuts it composes.
10. `edu3d train`'s checks run once, in the pre-flight: the command and the rank side import
   none of its `check_*` functions.
11. The launcher never imports the per-rank wrapper (`edu3d/launch/worker.py`; only a warm
   rank's wrapper does): a run folder's names and readers are `edu3d/launch/run_files.py`'s.

Each rule is a test on this checkout, or on another tree named by $EDU3D_HOUSE_ROOT
(`EDU3D_HOUSE_ROOT=/path/to/edu3d python -m pytest tests/test_house.py`), and each checker is
also shown to catch a small synthetic tree that breaks its rule (the `test_meta_*` tests).
Nothing here imports edu3d or torch: tests/house_graph.py reads the files with `ast`.
"""

from __future__ import annotations

import ast
import os
import re
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from tests.house_graph import FUNCTIONS, House

ROOT = Path(os.environ.get("EDU3D_HOUSE_ROOT") or Path(__file__).resolve().parent.parent)

LOOSE_ALLOWED = {"__init__.py", "cli.py"}
LAYERS = {
    "edu3d.config": 0,
    "edu3d.distributed": 1, "edu3d.model": 1, "edu3d.schedules": 1,
    "edu3d.parallel": 2, "edu3d.ckpt": 2, "edu3d.plan": 2, "edu3d.launch": 2,
    "edu3d.train": 3,
    "edu3d.production": 4,
    "edu3d.bench": 5,
    "edu3d.course": 6,
    "edu3d.commands": 7, "edu3d.widgets": 7, "edu3d": 7,
    "edu3d.cli": 8,
}
SIDEWAYS: set = set()  # (importer's package, imported package) allowed within one floor: none
CORE = ("edu3d.config", "edu3d.distributed", "edu3d.model", "edu3d.schedules", "edu3d.parallel", "edu3d.train", "edu3d.ckpt",
        "edu3d.plan", "edu3d.launch")
ABOVE_THE_CORE = ("edu3d.course", "edu3d.widgets", "edu3d.production", "edu3d.bench",
                  "edu3d.commands")
PRODUCTION_DOORS = ("edu3d.commands", "edu3d.production", "edu3d.bench",
                    "edu3d.course.ch09_in_production")
DRAWING = ("plotly", "ipywidgets", "matplotlib")
MAX_HEIGHT = 8
MAX_LINES = 400
LOCAL_IMPORTS_PHRASE = "imports inside functions"
CHAPTER = re.compile(r"ch(\d\d)_(\w+)\.py")


def _within(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def package_of(module: str) -> str:
    """The layer-table package of a module: `edu3d.parallel.tp.ops` -> `edu3d.parallel`.
    The learners' door `edu3d.comm` belongs to `edu3d.distributed`, whose `comm` it
    re-exports."""
    if module == "edu3d.comm":
        return "edu3d.distributed"
    return ".".join(module.split(".")[:2])


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def check(offenders: list[str], rule: str) -> None:
    if offenders:
        pytest.fail(f"{rule}\n" + "\n".join(f"  {o}" for o in offenders), pytrace=False)


@pytest.fixture(scope="module")
def house() -> House:
    return House(ROOT)


# conftest.py warms a pool of ranks for every test file; these tests start no process.
@pytest.fixture(autouse=True, scope="module")
def _warm_ranks_for_the_module():
    yield


@pytest.fixture(autouse=True)
def _warm_ranks():
    yield


def test_the_root_is_an_edu3d_checkout(house):
    """Without this, a mistyped $EDU3D_HOUSE_ROOT would pass every rule on an empty tree."""
    assert "edu3d" in house.modules, f"no edu3d/__init__.py under {ROOT} ($EDU3D_HOUSE_ROOT)"


# ---------------------------------------------------------------- 1. folders name concepts

def _is_dist_reexport(house: House, module: str) -> bool:
    body = house.modules[module].tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    imports = {id(i.node): i for i in house.imports(module)}
    return bool(body) and all(id(s) in imports and _within(imports[id(s)].names[0], "edu3d.distributed")
                              for s in body)


def find_loose_modules(house: House) -> list[str]:
    out = []
    for m, mod in house.modules.items():
        folder, _, name = mod.rel.rpartition("/")
        if folder != "edu3d" or name in LOOSE_ALLOWED:
            continue
        if name == "comm.py" and _is_dist_reexport(house, m):
            continue
        why = (" (comm.py may stay only as a re-export: nothing but imports from edu3d.distributed)"
               if name == "comm.py" else "")
        out.append(f"{mod.rel}:1: loose module; move it into the folder of its concept{why}")
    return out


def test_only_init_and_cli_are_loose(house):
    check(find_loose_modules(house),
          "Only __init__.py and cli.py (and a re-exporting comm.py) may sit directly in edu3d/:")


# ---------------------------------------------------------------- 2. imports go downwards

def _statements(edges):
    """One edge per import statement and package: `from edu3d.course import ch01` imports
    both `edu3d.course` and `edu3d.course.ch01`; a report names only the deeper one."""
    edges = list(edges)
    targets = defaultdict(set)
    for e in edges:
        targets[e.source, e.line].add(e.target)
    return [e for e in edges
            if not any(t.startswith(e.target + ".") for t in targets[e.source, e.line])]


def find_cycles(house: House) -> list[str]:
    out = []
    for comp in house.cycles():
        members = set(comp)
        out.append(" <-> ".join(comp))
        out += [f"    {house.where(e.source, e.line)}: imports {e.target}"
                + (" (inside a function)" if e.local else "")
                for e in house.edges if e.source in members and e.target in members]
    return out


def test_no_import_cycle(house):
    check(find_cycles(house), "Import cycles (top-level and function-level imports alike); "
                              "break each at one of the lines shown:")


def find_packages_without_layer(house: House) -> list[str]:
    first = {}
    for m, mod in house.modules.items():
        loose = mod.rel.count("/") == 1 and mod.rel.startswith("edu3d/") and m != "edu3d"
        if package_of(m) not in LAYERS and not loose:  # loose modules: rule 1
            first.setdefault(package_of(m), mod.rel)
    return [f"{rel}:1: package {p} is in no layer; add it to LAYERS in tests/test_house.py "
            f"(and DESIGN.md) or move its modules" for p, rel in sorted(first.items())]


def test_every_package_sits_in_a_layer(house):
    check(find_packages_without_layer(house), "Packages missing from the layer table:")


def find_upward_imports(house: House) -> list[str]:
    out = []
    for e in _statements(house.edges):
        ps, pt = package_of(e.source), package_of(e.target)
        if ps == pt or ps not in LAYERS or pt not in LAYERS:
            continue
        ls, lt = LAYERS[ps], LAYERS[pt]
        if lt < ls or (lt == ls and (ps, pt) in SIDEWAYS):
            continue
        way = "sideways" if lt == ls else "upwards"
        out.append(f"{house.where(e.source, e.line)}: {e.source} (F{ls}) imports {e.target} "
                   f"(F{lt}), {way}" + (" (inside a function)" if e.local else ""))
    return out


def test_imports_go_only_downwards(house):
    check(find_upward_imports(house),
          "A package imports only lower layers, itself, or an allowed sibling (SIDEWAYS):")


def find_core_importing_above(house: House) -> list[str]:
    return [f"{house.where(e.source, e.line)}: {e.source} imports {e.target}"
            for e in _statements(house.edges)
            if _within(package_of(e.source), *CORE) and _within(e.target, *ABOVE_THE_CORE)]


def test_the_core_never_imports_course_widgets_production_bench_or_commands(house):
    check(find_core_importing_above(house),
          "The library (distributed, model, schedules, parallel, train, ckpt, plan, launch) is built on by the "
          "course, widgets, production, bench and commands, never the other way round:")


def find_production_importers(house: House) -> list[str]:
    return [f"{house.where(e.source, e.line)}: {e.source} imports {e.target}"
            for e in _statements(house.edges)
            if _within(e.target, "edu3d.production") and not _within(e.source, *PRODUCTION_DOORS)]


def test_production_is_reached_only_through_commands(house):
    check(find_production_importers(house),
          f"Only {', '.join(PRODUCTION_DOORS)} may import edu3d.production:")


def _is_chart(module: str) -> bool:
    return _within(module, "edu3d.widgets") and not _within(module, "edu3d.widgets.panels")


def find_charts_importing_course(house: House) -> list[str]:
    return [f"{house.where(e.source, e.line)}: chart {e.source} imports {e.target}"
            for e in _statements(house.edges)
            if _is_chart(e.source) and _within(e.target, "edu3d.course")]


def test_charts_never_import_the_course(house):
    check(find_charts_importing_course(house),
          "A chart takes data and returns a figure; a panel (widgets/panels/) asks the course "
          "for the numbers:")


def find_course_drawing(house: House) -> list[str]:
    out = []
    for m in house.modules:
        if not _within(m, "edu3d.course"):
            continue
        for imp in house.imports(m):
            drawn = [n for n in imp.names if n.split(".")[0] in DRAWING]
            drawn += [n for n in imp.names if _within(house.resolve(n) or "", "edu3d.widgets")]
            if drawn:
                out.append(f"{house.where(m, imp.line)}: {m} imports {drawn[0]}")
    return out


def test_the_course_never_draws(house):
    check(find_course_drawing(house),
          f"edu3d.course computes (ranks import it); it never imports {', '.join(DRAWING)} "
          f"or edu3d.widgets:")


def room_of(module: str) -> str:
    """A room of the house: a top-level folder of edu3d/ (with all its subfolders), a loose
    module, or widgets/ as a whole (`edu3d.widgets.panels.ch06_x` -> `edu3d.widgets`)."""
    return package_of(module)


def room_height(house: House) -> tuple[int, list[str]]:
    """Floors of the rooms' graph: a room importing no other room is on floor 1, any other
    room one floor above the highest room it imports. A cycle of rooms has no height (the
    layer tests name it); it is cut here so the count stays defined."""
    succ: dict[str, set[str]] = defaultdict(set)
    for m, targets in house.graph.items():
        succ[room_of(m)] |= {room_of(t) for t in targets} - {room_of(m)}
    memo: dict[str, tuple[int, list[str]]] = {}

    def floor(room: str, path: tuple[str, ...] = ()) -> tuple[int, list[str]]:
        if room in memo:
            return memo[room]
        below = [floor(r, path + (room,)) for r in sorted(succ[room]) if r not in path]
        best = max(below, key=lambda hc: hc[0], default=(0, []))
        memo[room] = (best[0] + 1, [room, *best[1]])
        return memo[room]

    return max((floor(r) for r in sorted(set(map(room_of, house.graph)))),
               key=lambda hc: hc[0], default=(0, []))


def find_too_tall(house: House) -> list[str]:
    height, chain = room_height(house)
    if height <= MAX_HEIGHT:
        return []
    return [f"{height} floors: " + "\n    -> ".join(chain)]


def test_the_import_graph_is_at_most_8_floors_high(house):
    check(find_too_tall(house), f"The rooms' import graph is over {MAX_HEIGHT} floors tall "
                                f"(a room sits one floor above the highest room it imports):")


# ---------------------------------------------------------------- 3. private names

def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return base and f"{base}.{node.attr}"
    return None


def _own_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of a scope, not entering the functions defined inside it."""
    out, todo = [], list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        out.append(node)
        if not isinstance(node, FUNCTIONS):
            todo.extend(ast.iter_child_nodes(node))
    return out


def _stored_names(fn: ast.AST, nodes: list[ast.AST]) -> set[str]:
    a = fn.args
    names = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x}
    for n in nodes:
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(x.asname or x.name).split(".")[0] for x in n.names}
    return names


def _bound_modules(house: House, imports) -> dict[str, str]:
    """The names these import statements bind to an edu3d module."""
    bound = {}
    for imp in imports:
        if isinstance(imp.node, ast.Import):
            for alias in imp.node.names:
                if _within(alias.name, "edu3d") and alias.name in house.modules:
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound[alias.name.split(".")[0]] = "edu3d"
        else:
            for alias, full in zip(imp.node.names, imp.names[1:]):
                if full in house.modules:
                    bound[alias.asname or alias.name] = full
    return bound


def _private_attributes(house: House, m: str):
    """(line, `module._name`) for each private attribute read from an imported edu3d module,
    following Python's scopes: a function's parameter or assignment hides a module's import."""
    by_node = {id(i.node): i for i in house.imports(m)}
    if not any(_within(n, "edu3d") for i in by_node.values() for n in i.names):
        return

    def visit(nodes, bound):
        for node in nodes:
            if isinstance(node, FUNCTIONS):
                inner = _own_nodes(node)
                kept = {k: v for k, v in bound.items() if k not in _stored_names(node, inner)}
                own = [by_node[id(n)] for n in inner if id(n) in by_node]
                yield from visit(inner, kept | _bound_modules(house, own))
            elif isinstance(node, ast.Attribute) and _is_private(node.attr):
                owner = _dotted(node.value)
                root, _, rest = (owner or "").partition(".")
                if root in bound and ".".join(filter(None, [bound[root], rest])) in house.modules:
                    yield node.lineno, f"{owner}.{node.attr}"

    top = _own_nodes(house.modules[m].tree)
    yield from sorted(visit(top, _bound_modules(house, [by_node[id(n)] for n in top
                                                         if id(n) in by_node])))


def find_private_reaches(house: House) -> list[str]:
    out = []
    for m in house.modules:
        for imp in house.imports(m):
            if isinstance(imp.node, ast.ImportFrom):
                if not _within(imp.names[0], "edu3d"):
                    continue
                names = [*imp.names[0].split("."), *(a.name for a in imp.node.names)]
            else:
                names = [p for a in imp.node.names if _within(a.name, "edu3d")
                         for p in a.name.split(".")]
            private = [n for n in names if _is_private(n)]
            if private:
                out.append(f"{house.where(m, imp.line)}: imports the private name {private[0]} "
                           f"(from {imp.names[0]})")
        out += [f"{house.where(m, line)}: reads the private {name}"
                for line, name in _private_attributes(house, m)]
    return out


def test_no_private_name_crosses_a_module(house):
    check(find_private_reaches(house),
          "A private name (_x) is its module's own business; make it public (and document it) "
          "or move the code that needs it:")


# ---------------------------------------------------------------- 4. short files

def find_long_files(house: House) -> list[str]:
    return [f"{mod.rel}:{MAX_LINES + 1}: {mod.lines} lines" for mod in house.modules.values()
            if mod.lines > MAX_LINES]


def test_no_file_is_over_400_lines(house):
    check(find_long_files(house), f"Files over {MAX_LINES} lines (split by concept):")


# ---------------------------------------------------------------- 5. file names never repeat

def find_repeated_names(house: House) -> list[str]:
    by_name = defaultdict(list)
    for mod in house.modules.values():
        if not mod.is_package:
            by_name[mod.rel.rpartition("/")[2]].append(mod.rel)
    out = []
    for name, rels in sorted(by_name.items()):
        chapter = CHAPTER.fullmatch(name) and sorted(rels) == [f"edu3d/course/{name}",
                                                               f"widgets/panels/{name}"]
        door = (sorted(rels) == ["edu3d/comm.py", "edu3d/distributed/comm.py"]
                and _is_dist_reexport(house, "edu3d.comm"))
        if len(rels) > 1 and not (chapter or door):
            out.append(f"{name}: " + ", ".join(f"{r}:1" for r in sorted(rels)))
    return out


def test_no_file_name_repeats(house):
    check(find_repeated_names(house),
          "File names repeated (only a chapter's chNN_topic.py may be in both edu3d/course/ "
          "and widgets/panels/, and the learners' door edu3d/comm.py may re-export "
          "edu3d/distributed/comm.py):")


def find_chapters_without_notebook(house: House) -> list[str]:
    """A panel is named exactly like its notebook (`widgets/panels/ch06_3d_parallelism.py` for
    `notebooks/06_3d_parallelism.ipynb`); a course module is too; either adds a part after it
    when the chapter needs two files (`edu3d/course/ch10_performance_hangs.py`, the FP8
    section's `edu3d/course/ch07_memory_fp8.py` and its panel `widgets/panels/ch07_memory_fp8.py`)."""
    notebooks = {p.stem for p in (house.root / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    out = []
    for mod in house.modules.values():
        folder, _, name = mod.rel.rpartition("/")
        match = CHAPTER.fullmatch(name)
        if folder not in ("edu3d/course", "widgets/panels") or not match:
            continue
        stem = f"{match[1]}_{match[2]}"
        ok = stem in notebooks or any(stem.startswith(nb + "_") for nb in notebooks)
        if not ok:
            whose = [nb for nb in sorted(notebooks) if nb.startswith(match[1] + "_")]
            out.append(f"{mod.rel}:1: no notebooks/{stem}.ipynb"
                       + (f" (chapter {match[1]} is notebooks/{whose[0]}.ipynb)" if whose else ""))
    return out


def test_chapter_modules_are_named_after_their_notebook(house):
    check(find_chapters_without_notebook(house),
          "edu3d/course/chNN_topic[_part].py and widgets/panels/chNN_topic[_part].py serve "
          "notebooks/NN_topic.ipynb:")


def find_graders_not_named_by_chapter(house: House) -> list[str]:
    """An exercise's grader is named after its chapter, one way: it sits in the chapter's
    course module, or, a module of its own, in `edu3d/course/chNN_topic_grade.py` beside that
    chapter's `chNN_topic.py`; never in a module named by topic (`grade_moe.py`)."""
    out = []
    for mod in house.modules.values():
        folder, _, name = mod.rel.rpartition("/")
        if folder != "edu3d/course":
            continue
        if name.startswith("grade_"):
            out.append(f"{mod.rel}:1: a grader named by its topic; name it after its chapter, "
                       f"edu3d/course/chNN_topic_grade.py")
        elif name.endswith("_grade.py"):
            chapter = name[:-len("_grade.py")] + ".py"
            module = f"edu3d.course.{chapter[:-3]}"
            if not CHAPTER.fullmatch(chapter) or module not in house.modules:
                out.append(f"{mod.rel}:1: no chapter module edu3d/course/{chapter} beside it")
    return sorted(out)


def test_graders_are_named_after_their_chapter(house):
    check(find_graders_not_named_by_chapter(house),
          "An exercise's grader lives in its chapter's module or in chNN_topic_grade.py:")


# ---------------------------------------------------------------- 6. imports at the top

def find_unexplained_local_imports(house: House) -> list[str]:
    out = []
    for m, mod in house.modules.items():
        lines = [str(i.line) for i in house.imports(m) if i.local]
        if lines and LOCAL_IMPORTS_PHRASE not in " ".join(mod.docstring.split()).lower():
            out.append(f"{mod.rel}:{lines[0]}: imports inside functions at lines "
                       f"{', '.join(lines)}")
    return out


def test_local_imports_are_explained(house):
    check(find_unexplained_local_imports(house),
          f"Move these imports to the top, or say why in the module docstring "
          f"(\"{LOCAL_IMPORTS_PHRASE} ...\" and the reason):")


# ---------------------------------------------------------------- 7. typed configuration

def _has_own_main(mod) -> bool:
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
               and (n.name == "main" or n.name.endswith("_main")) for n in mod.tree.body)


def find_namespace_config(house: House) -> list[str]:
    out = []
    for m, mod in house.modules.items():
        if not _within(package_of(m), *CORE):
            continue
        entry_point = _within(m, "edu3d.launch") and _has_own_main(mod)
        for imp in house.imports(m):
            modules = imp.names[:1] if isinstance(imp.node, ast.ImportFrom) else imp.names
            if any(_within(n, "argparse") for n in modules) and not entry_point:
                out.append(f"{house.where(m, imp.line)}: imports argparse")
        lines = {n.lineno for n in ast.walk(mod.tree)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                 and n.func.id == "getattr" and n.args and isinstance(n.args[0], ast.Name)
                 and n.args[0].id == "args"}
        out += [f"{house.where(m, line)}: getattr(args, ...)" for line in sorted(lines)]
    return out


def test_the_core_takes_typed_config(house):
    """The core (distributed, model, schedules, parallel, train, ckpt, plan, launch) takes dataclasses; the
    command converts its `argparse.Namespace` once. So no core module imports `argparse`
    or calls `getattr(args, ...)` (a `getattr` whose first argument is the name `args`).

    One exception: a module under `edu3d/launch/` that is itself a `python -m` entry point
    (the agent, the zygote) parses its own argv, so it may import argparse if it defines a
    module-level function named `main` or ending in `_main`. `getattr(args, ...)` stays
    banned there too: its own parser's attributes are known, read them as `args.name`."""
    check(find_namespace_config(house),
          "The core takes typed configuration, not an argparse.Namespace:")


# ---------------------------------------------------------------- 9. one batch cutter

BATCH_CUTTER = "edu3d.train.cut"
BATCH_CUTS = ("split_batch", "shard_rows", "microbatches")


def find_batch_cuts_outside_the_cutter(house: House) -> list[str]:
    """In the core, one module cuts a global batch (dp rows, cp pieces, micro-batches):
    edu3d/train/cut.py. No other core module imports or calls the cuts it composes
    (`split_batch`, `shard_rows`, `microbatches`); above the core, a course or production
    module may (it shows one cut on its own, or cuts for PyTorch's classes)."""
    out = []
    for m, mod in house.modules.items():
        if m == BATCH_CUTTER or not _within(m, *CORE) or mod.is_package:
            continue  # a package's __init__ re-exports its modules' names; it cuts nothing
        for imp in house.imports(m):
            cut = [n for n in imp.names if _within(n, "edu3d")
                   and n.rpartition(".")[2] in BATCH_CUTS]
            if cut:
                out.append(f"{house.where(m, imp.line)}: imports {cut[0]}")
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in BATCH_CUTS[:2]:
                out.append(f"{house.where(m, node.lineno)}: calls .{node.func.attr}")
    return out


def test_one_function_cuts_a_batch(house):
    check(find_batch_cuts_outside_the_cutter(house),
          f"Cut a batch with {BATCH_CUTTER}.cut (or move the new cut there):")


# ---------------------------------------------------------------- 10. one pre-flight

PREFLIGHT = ("edu3d.train.preflight", "edu3d.train.axis_rules", "edu3d.train.pipeline_rules")
PREFLIGHT_CALLERS = ("edu3d.commands", "edu3d.train.loop", "edu3d.train.trainer")


def find_checks_outside_the_preflight(house: House) -> list[str]:
    """`edu3d train`'s checks run once, before launch: the command and the rank side
    (edu3d/commands/, train/loop.py, train/trainer.py) call `preflight()` and trust the
    checked run it returns; none of them imports one of its `check_*` functions."""
    out = []
    for m in house.modules:
        if not _within(m, *PREFLIGHT_CALLERS):
            continue
        for imp in house.imports(m):
            checks = [n for n in imp.names if _within(n, *PREFLIGHT)
                      and n.rpartition(".")[2].startswith("check_")]
            if checks:
                out.append(f"{house.where(m, imp.line)}: imports {checks[0]}")
        for node in ast.walk(house.modules[m].tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("check_") \
                    and isinstance(node.value, ast.Name) and node.value.id == "preflight":
                out.append(f"{house.where(m, node.lineno)}: reads preflight.{node.attr}")
    return sorted(out)


def test_the_checks_run_once_in_the_preflight(house):
    check(find_checks_outside_the_preflight(house),
          "Call edu3d.train.preflight.preflight(run) once, before launch, and trust the checked "
          "run; no second check on the command or the rank side:")


# ---------------------------------------------------------------- 11. the run folder's rules

RANK_WRAPPER = "edu3d.launch.worker"
WARM_WRAPPER = "edu3d.launch.warm.rank"  # a warm rank runs each job as the cold wrapper does


def find_imports_of_the_rank_wrapper(house: House) -> list[str]:
    """The per-rank wrapper (edu3d/launch/worker.py) is what each rank runs, not a library:
    the launcher and everyone else take a run folder's names and readers from
    edu3d/launch/run_files.py, so only the other rank-side wrapper (a warm rank,
    edu3d/launch/warm/rank.py) imports it."""
    return sorted(f"{house.where(m, imp.line)}: imports {RANK_WRAPPER}"
                  for m in house.modules if m not in (RANK_WRAPPER, WARM_WRAPPER)
                  for imp in house.imports(m)
                  if any(_within(n, RANK_WRAPPER) for n in imp.names))


def test_only_the_ranks_import_the_rank_wrapper(house):
    check(find_imports_of_the_rank_wrapper(house),
          "Take a run folder's names and readers from edu3d.launch.run_files, not from the "
          "per-rank wrapper:")


# ---------------------------------------------------------------- 8. the map equals the land

def tree_listing(house: House) -> dict[str, set[str]]:
    """{folder/: {file.py, ...}} of every folder holding modules, `__init__.py` left out."""
    out = defaultdict(set)
    for mod in house.modules.values():
        folder, _, name = mod.rel.rpartition("/")
        out[folder + "/"]  # a folder with only an __init__.py is listed, empty
        if name != "__init__.py":
            out[folder + "/"].add(name)
    return dict(out)


def _compare(listed: dict[str, set[str]], where: dict[str, str], tree: dict[str, set[str]],
             doc: str) -> list[str]:
    out = []
    for folder, files in sorted(tree.items()):
        if folder not in listed:
            out.append(f"{folder}__init__.py:1: the folder {folder} is not in {doc}")
            continue
        out += [f"{folder}{f}:1: not in {doc}" for f in sorted(files - listed[folder])]
    for folder, files in sorted(listed.items()):
        if folder not in tree:
            out.append(f"{where[folder]}: {doc} lists {folder}, which holds no module")
            continue
        out += [f"{where[folder + f]}: {doc} lists {folder}{f}, which does not exist"
                for f in sorted(files - tree[folder] - {"__init__.py"})]
    return out


def readme_listing(root: Path) -> tuple[dict[str, set[str]], dict[str, str]] | None:
    readme = root / "README.md"
    lines = readme.read_text(encoding="utf-8").splitlines() if readme.is_file() else []
    start = next((i for i, line in enumerate(lines) if re.match(r"#+\s", line)
                  and re.search(r"how the package is organi[sz]ed", line, re.I)), None)
    if start is None:
        return None
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    listed, where = defaultdict(set), {}
    for i in range(start + 1, len(lines)):
        heading = re.match(r"(#+)\s", lines[i])
        if heading and len(heading[1]) <= level:
            break
        if not lines[i].lstrip().startswith("|"):
            continue
        cells = lines[i].strip().strip("|").split("|")
        for path in re.findall(r"`([^`]+)`", cells[0]):
            if not path.startswith(("edu3d/", "widgets/")):
                continue
            spot = f"README.md:{i + 1}"
            if path.endswith("/"):
                where.setdefault(path, spot)
                for f in re.findall(r"`(\w+\.py)`", cells[1] if len(cells) > 1 else ""):
                    listed[path].add(f)
                    where.setdefault(path + f, spot)
            else:
                folder, _, f = path.rpartition("/")
                listed[folder + "/"].add(f)
                where.setdefault(folder + "/", spot)
                where.setdefault(path, spot)
    return dict(listed), where


def find_readme_differences(house: House) -> list[str]:
    found = readme_listing(house.root)
    if found is None:
        return ["README.md:1: no section headed \"How the package is organised\""]
    return _compare(*found, tree_listing(house), "README.md's table")


def test_readme_table_lists_every_module(house):
    """README.md has a section headed "How the package is organised" with a table, one row
    per folder of edu3d/ and widgets/:

        | Folder | Modules | What it holds |
        |---|---|---|
        | `edu3d/` | `__init__.py` `cli.py` | torch-free; the `edu3d` command |
        | `edu3d/distributed/` | `mesh.py` `runtime.py` `comm.py` | what every rank uses |
        | `edu3d/launch/warm/` | `pool.py` `zygote.py` `rank.py` | warm pools |
        | `widgets/panels/` | `panel.py` `ch01_collectives.py` | knobs |

    The first column holds the folder's path, backticked, ending in `/`; the second column
    its modules' file names, each backticked (`__init__.py` may be named or not). A module
    may instead have a row of its own, its full path in the first column
    (`` `edu3d/distributed/comm.py` ``). Rows for other paths (notebooks/, tests/) are ignored.
    Every module must be listed, and everything listed must exist."""
    check(find_readme_differences(house), "README.md's table differs from the tree:")


def docstring_listing(house: House) -> tuple[dict[str, set[str]], dict[str, str], list[str]]:
    if "edu3d" not in house.modules:
        return {}, {}, ["edu3d/__init__.py:1: missing"]
    init = house.modules["edu3d"]
    first = init.tree.body[0] if init.tree.body else None
    if not init.docstring:
        return {}, {}, [f"{init.rel}:1: no docstring"]
    listed, where, bad, stack = defaultdict(set), {}, [], []
    stems_at = None  # (column, folder) of the stems a next line may continue
    for k, line in enumerate(first.value.value.splitlines()):
        spot = f"{init.rel}:{first.lineno + k}"
        m = re.match(r"(\s*)((?:\w+/)+)(?:\s+(.*))?$", line)
        more = re.match(r"(\s*)(\S.*)$", line)
        if m:
            indent, word, rest = len(m[1]), m[2], (m[3] or "").strip()
            while stack and stack[-1][0] >= indent:
                stack.pop()
            if word.startswith(("edu3d/", "widgets/")):
                folder = word
            else:
                folder = (stack[-1][1] if stack else "edu3d/") + word
            stack.append((indent, folder))
            where.setdefault(folder, spot)
            listed[folder]  # a folder named without modules is still named
            stems_at = (m.start(3), folder) if m[3] else None
        elif more and stems_at and len(more[1]) == stems_at[0]:  # the stems go on
            folder, rest = stems_at[1], more[2].strip()
        else:
            stems_at = None
            continue
        if re.search(r"\s{2,}", rest):
            stems_at = None  # a description ends the stems
        for stem in re.split(r"\s{2,}", rest, maxsplit=1)[0].split():
            if not re.fullmatch(r"\w+(\.py)?", stem):
                bad.append(f"{spot}: `{stem}` is not a module stem (stems, then two spaces, "
                           f"then the description)")
                continue
            f = stem.removesuffix(".py") + ".py"
            listed[folder].add(f)
            where.setdefault(folder + f, spot)
    if not listed:
        bad.append(f"{init.rel}:1: the docstring draws no tree of folders")
    return dict(listed), where, bad


def find_docstring_differences(house: House) -> list[str]:
    listed, where, bad = docstring_listing(house)
    return bad + (_compare(listed, where, tree_listing(house), "edu3d/__init__.py's tree")
                  if listed else [])


def test_init_docstring_draws_the_tree(house):
    """`edu3d/__init__.py`'s docstring draws the same folders and modules as an indented
    tree, one line per folder: the folder (ending in `/`), its module stems separated by
    single spaces (`__init__` optional), then two or more spaces and a description:

        edu3d/       cli                          torch-free; `%load_ext edu3d`; the command
          distributed/      mesh runtime comm            what every rank uses
          launch/    api agent supervise          start, watch and end ranks
            warm/    pool zygote rank             ranks forked warm
        widgets/     style collectives            charts: data in, a figure out
          panels/    panel ch01_collectives       knobs

    A folder line indented under another is its subfolder; a line at the outermost level
    is under `edu3d/` unless it starts with `edu3d/` or `widgets/` (so a flat list of
    `distributed/`, `launch/warm/`, `widgets/panels/` works too). Only lines whose first word ends
    in `/` are read, and the lines that go on with their stems: a line that starts exactly at
    the column where the stems above it started (and the stems did not end in a
    description). The rest of the docstring is prose."""
    check(find_docstring_differences(house), "edu3d/__init__.py's tree differs from the tree:")


MAP_WIDTH = 100


def find_wide_map_lines(house: House) -> list[str]:
    """The tree in edu3d/__init__.py's docstring is read on a screen: no line wider than
    MAP_WIDTH characters (a folder's stems go on under the first stem)."""
    init = house.modules.get("edu3d")
    if init is None or not init.tree.body:
        return []
    first = init.tree.body[0]
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return []
    return [f"{init.rel}:{first.lineno + k}: {len(line)} characters"
            for k, line in enumerate(first.value.value.splitlines()) if len(line) > MAP_WIDTH]


def test_the_tree_fits_the_screen(house):
    check(find_wide_map_lines(house),
          f"edu3d/__init__.py's tree has lines over {MAP_WIDTH} characters (wrap the stems):")


# ====================================================================== meta-tests
# A small tree that keeps every rule, then one break per rule: each checker must flag it.

GOOD = {
    "edu3d/__init__.py": '''
        """A toy edu3d.

            edu3d/        cli comm            the face, the command, the learners' door
              distributed/       comm                what every rank uses
              model/      gpt                 the serial reference
              parallel/   dp                  data parallelism
              plan/       formulas            memory formulas
              ckpt/       format              checkpoints
              launch/     agent               starts ranks
                warm/     pool                warm ranks
              train/      trainer             one Trainer
              production/ torch_impl          PyTorch's own APIs
              bench/      bench_dp            measures
              course/     ch01_collectives ch09_in_production   the chapters' numbers
              commands/   train               edu3d train
            widgets/      style collectives   charts
              panels/     panel ch01_collectives   knobs

        It has imports inside functions: `%load_ext edu3d` must not import torch.
        """


        def load_ipython_extension(ipython):
            from edu3d.launch import agent
            return agent
        ''',
    "edu3d/cli.py": "from edu3d.commands import train\n",
    "edu3d/comm.py": '"""The learners\' door."""\nfrom edu3d.distributed.comm import *  # noqa\n',
    "edu3d/distributed/__init__.py": "",
    "edu3d/distributed/comm.py": "def all_reduce(x):\n    return x\n",
    "edu3d/model/__init__.py": "",
    "edu3d/model/gpt.py": "class GPT:\n    pass\n",
    "edu3d/parallel/__init__.py": "",
    "edu3d/parallel/dp.py": "from edu3d.distributed import comm\nfrom edu3d.model import gpt\n",
    "edu3d/plan/__init__.py": "",
    "edu3d/plan/formulas.py": "def memory(n):\n    return 16 * n\n",
    "edu3d/ckpt/__init__.py": "",
    "edu3d/ckpt/format.py": "from edu3d.distributed import comm\n",
    "edu3d/launch/__init__.py": "",
    "edu3d/launch/agent.py": '''
        """The agent. Its imports inside functions keep its start torch-free."""
        import argparse


        def main(argv=None):
            import json
            return json.dumps(vars(argparse.ArgumentParser().parse_args(argv)))
        ''',
    "edu3d/launch/warm/__init__.py": "",
    "edu3d/launch/warm/pool.py": "from edu3d.launch import agent\n\n\ndef start(agent):\n"
                                 "    return agent._private\n",
    "edu3d/train/__init__.py": "",
    "edu3d/train/trainer.py": "from edu3d.parallel import dp\n",
    "edu3d/production/__init__.py": "",
    "edu3d/production/torch_impl.py": "from edu3d.train import trainer\n",
    "edu3d/bench/__init__.py": "",
    "edu3d/bench/bench_dp.py": "from edu3d.production import torch_impl\n",
    "edu3d/course/__init__.py": "",
    "edu3d/course/ch01_collectives.py": "from edu3d.train import trainer\n",
    "edu3d/course/ch09_in_production.py": "from edu3d.production import torch_impl\n",
    "edu3d/commands/__init__.py": "",
    "edu3d/commands/train.py": "from edu3d.production import torch_impl\n",
    "widgets/__init__.py": "",
    "widgets/style.py": "COLORS = ['red']\n",
    "widgets/collectives.py": "import plotly.graph_objects as go\n\nfrom . import style\n",
    "widgets/panels/__init__.py": "",
    "widgets/panels/panel.py": "class Panel:\n    pass\n",
    "widgets/panels/ch01_collectives.py": "from edu3d.course import ch01_collectives\n"
                                          "from ..collectives import go\n",
    "notebooks/01_collectives.ipynb": "{}",
    "notebooks/09_in_production.ipynb": "{}",
    "README.md": '''
        # toy

        ## How the package is organised

        | Folder | Modules | What it holds |
        |---|---|---|
        | `edu3d/` | `__init__.py` `cli.py` | the face |
        | `edu3d/comm.py` | | the learners' door |
        | `edu3d/distributed/` | `comm.py` | every rank |
        | `edu3d/model/` | `gpt.py` | the reference |
        | `edu3d/parallel/` | `dp.py` | data parallel |
        | `edu3d/plan/` | `formulas.py` | formulas |
        | `edu3d/ckpt/` | `format.py` | checkpoints |
        | `edu3d/launch/` | `agent.py` | starts ranks |
        | `edu3d/launch/warm/` | `pool.py` | warm ranks |
        | `edu3d/train/` | `trainer.py` | one Trainer |
        | `edu3d/production/` | `torch_impl.py` | PyTorch's APIs |
        | `edu3d/bench/` | `bench_dp.py` | measures |
        | `edu3d/course/` | `ch01_collectives.py` `ch09_in_production.py` | numbers |
        | `edu3d/commands/` | `train.py` | edu3d train |
        | `widgets/` | `style.py` `collectives.py` | charts |
        | `widgets/panels/` | `panel.py` `ch01_collectives.py` | knobs, e.g. `ch01.py` |
        | `notebooks/` | `00_x.ipynb` | ignored |

        ## Next
        ''',
    "pyproject.toml": '''
        [tool.setuptools]
        packages = ["edu3d", "edu3d.distributed", "edu3d.model", "edu3d.parallel", "edu3d.plan",
                    "edu3d.ckpt", "edu3d.launch", "edu3d.launch.warm", "edu3d.train",
                    "edu3d.production", "edu3d.bench", "edu3d.course", "edu3d.commands",
                    "edu3d.widgets", "edu3d.widgets.panels"]

        [tool.setuptools.package-dir]
        "edu3d.widgets" = "widgets"
        ''',
}

FINDERS = [find_loose_modules, find_cycles, find_packages_without_layer, find_upward_imports,
           find_core_importing_above, find_production_importers, find_charts_importing_course,
           find_course_drawing, find_too_tall, find_private_reaches, find_long_files,
           find_repeated_names, find_chapters_without_notebook, find_unexplained_local_imports,
           find_namespace_config, find_readme_differences, find_docstring_differences,
           find_graders_not_named_by_chapter, find_batch_cuts_outside_the_cutter,
           find_wide_map_lines, find_checks_outside_the_preflight,
           find_imports_of_the_rank_wrapper]




def toy(tmp_path: Path, changes: dict[str, str | None] | None = None) -> House:
    """GOOD written under tmp_path with `changes` ({path: new text, or None to leave it out})."""
    for path, text in (GOOD | (changes or {})).items():
        if text is not None:
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(textwrap.dedent(text).lstrip("\n"))
    return House(tmp_path)


@pytest.mark.parametrize("finder", FINDERS, ids=lambda f: f.__name__)
def test_meta_the_good_toy_keeps_every_rule(tmp_path, finder):
    assert finder(toy(tmp_path)) == []


def test_meta_loose_modules(tmp_path):
    h = toy(tmp_path, {"edu3d/mesh.py": "X = 1\n",
                       "edu3d/comm.py": "from edu3d.distributed.comm import *\nX = 1\n"})
    found = find_loose_modules(h)
    assert len(found) == 2
    assert found[0].startswith("edu3d/comm.py:1: loose module") and "re-export" in found[0]
    assert found[1].startswith("edu3d/mesh.py:1: loose module")
    assert find_repeated_names(h) == ["comm.py: edu3d/comm.py:1, edu3d/distributed/comm.py:1"]
    assert find_repeated_names(toy(tmp_path / "good")) == []  # the re-export is no repeat


def test_meta_hidden_folders_hold_no_modules(tmp_path):
    h = toy(tmp_path, {"edu3d/.ipynb_checkpoints/mesh-checkpoint.py": "import os\n"})
    assert not any("checkpoint" in m for m in h.modules)


def test_meta_cycles_count_function_level_imports(tmp_path):
    h = toy(tmp_path, {"edu3d/plan/formulas.py": "def f():\n    from edu3d.ckpt import format\n",
                       "edu3d/ckpt/format.py": "from edu3d.plan import formulas\n"})
    assert find_cycles(h) == [
        "edu3d.ckpt.format <-> edu3d.plan.formulas",
        "    edu3d/ckpt/format.py:1: imports edu3d.plan.formulas",
        "    edu3d/plan/formulas.py:2: imports edu3d.ckpt.format (inside a function)"]


def test_meta_importing_the_parent_init_is_no_cycle(tmp_path):
    h = toy(tmp_path, {"edu3d/launch/__init__.py": "from edu3d.launch.warm import pool\n"})
    assert find_cycles(h) == []


def test_meta_packages_without_layer(tmp_path):
    h = toy(tmp_path, {"edu3d/tools/__init__.py": "", "edu3d/tools/x.py": "",
                       "edu3d/mesh.py": ""})
    assert find_packages_without_layer(h) == [
        "edu3d/tools/__init__.py:1: package edu3d.tools is in no layer; add it to LAYERS in "
        "tests/test_house.py (and DESIGN.md) or move its modules"]


def test_meta_upward_and_sideways_imports(tmp_path):
    h = toy(tmp_path, {"edu3d/distributed/comm.py": "def f():\n    from edu3d.train import trainer\n",
                       "edu3d/model/gpt.py": "from ..distributed import comm\n",
                       "edu3d/commands/train.py": "from edu3d import cli\n"})
    assert find_upward_imports(h) == [
        "edu3d/commands/train.py:1: edu3d.commands.train (F7) imports edu3d.cli (F8), "
        "upwards",
        "edu3d/distributed/comm.py:2: edu3d.distributed.comm (F1) imports edu3d.train.trainer (F3), "
        "upwards (inside a function)",
        "edu3d/model/gpt.py:1: edu3d.model.gpt (F1) imports edu3d.distributed.comm (F1), sideways"]


def test_meta_core_importing_above_it(tmp_path):
    h = toy(tmp_path, {
        "edu3d/train/trainer.py": "from edu3d.course import ch01_collectives\n",
        "edu3d/comm.py": "from edu3d.distributed.comm import *\nfrom edu3d import bench\n"})
    assert find_core_importing_above(h) == [
        "edu3d/comm.py:2: edu3d.comm imports edu3d.bench",
        "edu3d/train/trainer.py:1: edu3d.train.trainer imports edu3d.course.ch01_collectives"]


def test_meta_production_doors(tmp_path):
    h = toy(tmp_path, {
        "edu3d/course/ch01_collectives.py": "from edu3d.production import torch_impl\n",
        "widgets/panels/panel.py": "def f():\n    import edu3d.production.torch_impl\n",
        "edu3d/cli.py": "from edu3d import production\n"})
    assert find_production_importers(h) == [
        "edu3d/cli.py:1: edu3d.cli imports edu3d.production",
        "edu3d/course/ch01_collectives.py:1: edu3d.course.ch01_collectives imports "
        "edu3d.production.torch_impl",
        "widgets/panels/panel.py:2: edu3d.widgets.panels.panel imports "
        "edu3d.production.torch_impl"]


def test_meta_charts_never_import_the_course(tmp_path):
    h = toy(tmp_path, {"widgets/style.py": "from edu3d.course.ch01_collectives import X\n"})
    assert find_charts_importing_course(h) == [
        "widgets/style.py:1: chart edu3d.widgets.style imports edu3d.course.ch01_collectives"]


def test_meta_the_course_never_draws(tmp_path):
    h = toy(tmp_path, {
        "edu3d/course/ch01_collectives.py":
            "from ..widgets import style\n\n\ndef f():\n    import matplotlib.pyplot as plt\n",
        "edu3d/course/__init__.py": "from plotly import graph_objects\n"})
    assert find_course_drawing(h) == [
        "edu3d/course/__init__.py:1: edu3d.course imports plotly",
        "edu3d/course/ch01_collectives.py:1: edu3d.course.ch01_collectives imports "
        "edu3d.widgets",
        "edu3d/course/ch01_collectives.py:5: edu3d.course.ch01_collectives imports "
        "matplotlib.pyplot"]


def _chain(n: int) -> dict[str, str]:
    """edu3d.distributed.m1 <- m2 <- ... <- mn, each importing the one below."""
    return {f"edu3d/distributed/m{i}.py": f"from edu3d.distributed import m{i - 1}\n" if i > 1 else ""
            for i in range(1, n + 1)}


def _rooms(n: int) -> dict[str, str]:
    """Rooms edu3d.r1 <- r2 <- ... <- rn, each a folder whose module imports the room below;
    a second module in r1 imports nothing, so rooms (not modules) are what is counted."""
    files = {f"edu3d/r{i}/m.py": f"from edu3d.r{i - 1} import m\n" if i > 1 else ""
             for i in range(1, n + 1)}
    files["edu3d/r1/deep.py"] = "from edu3d.r1 import m\n"
    return files


def test_meta_height(tmp_path):
    h = toy(tmp_path / "9", _rooms(9))
    assert room_height(h) == (9, [f"edu3d.r{i}" for i in range(9, 0, -1)])
    found = find_too_tall(h)
    assert len(found) == 1 and found[0].startswith("9 floors: edu3d.r9\n    -> edu3d.r8")
    assert find_too_tall(toy(tmp_path / "8", _rooms(8))) == []


def test_meta_height_counts_a_cycle_as_one_step(tmp_path):
    h = toy(tmp_path, {"edu3d/distributed/a.py": "from edu3d.distributed import b\n",
                       "edu3d/distributed/b.py": "def f():\n    from edu3d.distributed import a\n",
                       "edu3d/model/gpt.py": "from edu3d.distributed import a\n"})
    height, chain = h.height()
    # cli -> commands.train -> production.torch_impl -> trainer -> dp -> gpt -> a <-> b
    assert height == 7 and chain[0] == "edu3d.cli" and chain[-1] == "edu3d.distributed.a <-> edu3d.distributed.b"


def test_meta_private_names(tmp_path):
    h = toy(tmp_path, {"edu3d/train/trainer.py": '''
        import edu3d.launch.agent
        import edu3d.plan.formulas as f
        from torch import _C
        from edu3d.launch.agent import _helper, __doc__
        from edu3d.launch import agent
        from edu3d.model.gpt import GPT
        from edu3d.launch.warm import _secret


        def run(formulas):
            edu3d.launch.agent._write()
            agent._write(f._x, formulas._y, GPT._z, agent.__name__, _C._w)


        def local():
            from edu3d.plan import formulas
            return formulas._x


        def shadowed(agent):
            return agent._fine
        '''})
    assert find_private_reaches(h) == [
        "edu3d/train/trainer.py:4: imports the private name _helper (from edu3d.launch.agent)",
        "edu3d/train/trainer.py:7: imports the private name _secret (from edu3d.launch.warm)",
        "edu3d/train/trainer.py:11: reads the private edu3d.launch.agent._write",
        "edu3d/train/trainer.py:12: reads the private agent._write",
        "edu3d/train/trainer.py:12: reads the private f._x",
        "edu3d/train/trainer.py:17: reads the private formulas._x"]


def test_meta_long_files(tmp_path):
    h = toy(tmp_path, {"edu3d/plan/formulas.py": "x = 1\n" * 401,
                       "edu3d/plan/search.py": "x = 1\n" * 400})
    assert find_long_files(h) == ["edu3d/plan/formulas.py:401: 401 lines"]


def test_meta_repeated_names(tmp_path):
    h = toy(tmp_path, {"edu3d/bench/dp.py": "", "edu3d/bench/ch01_collectives.py": "",
                       "widgets/panels/ch02_other.py": "", "edu3d/course/ch02_other.py": ""})
    assert find_repeated_names(h) == [
        "ch01_collectives.py: edu3d/bench/ch01_collectives.py:1, "
        "edu3d/course/ch01_collectives.py:1, widgets/panels/ch01_collectives.py:1",
        "dp.py: edu3d/bench/dp.py:1, edu3d/parallel/dp.py:1"]
    assert find_chapters_without_notebook(h) == [
        "edu3d/course/ch02_other.py:1: no notebooks/02_other.ipynb",
        "widgets/panels/ch02_other.py:1: no notebooks/02_other.ipynb"]
    parts = toy(tmp_path / "parts", {"edu3d/course/ch01_collectives_gallery.py": "",
                                     "widgets/panels/ch01_collectives_gallery.py": "",
                                     "widgets/panels/ch01_gallery.py": ""})
    assert find_chapters_without_notebook(parts) == [
        "widgets/panels/ch01_gallery.py:1: no "
        "notebooks/01_gallery.ipynb (chapter 01 is notebooks/01_collectives.ipynb)"]


def test_meta_local_imports(tmp_path):
    h = toy(tmp_path, {"edu3d/plan/formulas.py": '''
        """Formulas (the imports inside
        FUNCTIONS keep this one torch-free)."""


        def f():
            import torch
        ''', "edu3d/plan/search.py": '''
        """Search."""
        from __future__ import annotations
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from edu3d.plan import formulas


        class Search:
            import math

            def run(self):
                import json
                def inner():
                    from edu3d.plan import formulas
        '''})
    assert find_unexplained_local_imports(h) == [
        "edu3d/plan/search.py:12: imports inside functions at lines 12, 14"]


def test_meta_typed_config(tmp_path):
    h = toy(tmp_path, {
        "edu3d/train/trainer.py":
            "import argparse\n\n\ndef f(args):\n    return getattr(args, 'lr', 0.1)\n",
        "edu3d/launch/warm/pool.py": "from argparse import Namespace\n",
        "edu3d/commands/train.py":
            "import argparse\n\n\ndef f(args):\n    return getattr(args, 'lr')\n",
        "edu3d/parallel/dp.py": "def f(self):\n    return getattr(self.args, 'x')\n"})
    assert find_namespace_config(h) == [
        "edu3d/launch/warm/pool.py:1: imports argparse",
        "edu3d/train/trainer.py:1: imports argparse",
        "edu3d/train/trainer.py:5: getattr(args, ...)"]


def test_meta_readme_table(tmp_path):
    readme = GOOD["README.md"].replace("| `edu3d/ckpt/` | `format.py` | checkpoints |\n", "")
    readme = readme.replace("`gpt.py`", "`gpt.py` `shapes.py`")
    h = toy(tmp_path, {"README.md": readme, "edu3d/plan/search.py": "",
                       "edu3d/tools/x.py": None})
    assert find_readme_differences(h) == [
        "edu3d/ckpt/__init__.py:1: the folder edu3d/ckpt/ is not in README.md's table",
        "edu3d/plan/search.py:1: not in README.md's table",
        "README.md:10: README.md's table lists edu3d/model/shapes.py, which does not exist"]
    (tmp_path / "README.md").write_text("# toy\n")
    assert find_readme_differences(h) == [
        'README.md:1: no section headed "How the package is organised"']


def test_meta_init_docstring_tree(tmp_path):
    init = GOOD["edu3d/__init__.py"]
    init = init.replace("warm/     pool ", "warm/     pool rank")
    init = init.replace("distributed/       comm    ", "distributed/       comm x-y")
    init = init.replace("commands/   train", "tools/      x                   none\n"
                                            "              commands/   train")
    h = toy(tmp_path, {"edu3d/__init__.py": init, "widgets/panels/ch02_x.py": ""})
    assert find_docstring_differences(h) == [
        "edu3d/__init__.py:4: `x-y` is not a module stem (stems, then two spaces, then the "
        "description)",
        "widgets/panels/ch02_x.py:1: not in edu3d/__init__.py's tree",
        "edu3d/__init__.py:10: edu3d/__init__.py's tree lists edu3d/launch/warm/rank.py, "
        "which does not exist",
        "edu3d/__init__.py:15: edu3d/__init__.py's tree lists edu3d/tools/, which holds no "
        "module"]


def test_meta_init_docstring_flat_tree(tmp_path):
    flat = '''
        """Flat, in the order a reader meets it; prose lines are not read.

            edu3d/            cli comm        the face
            distributed/             comm            every rank
            model/            gpt             reference
            parallel/         dp              dp
            plan/             formulas        formulas
            ckpt/             format          checkpoints
            launch/           agent           ranks
            launch/warm/      pool            warm
            train/            trainer         Trainer
            production/       torch_impl      APIs
            bench/            bench_dp        measures
            course/           ch01_collectives ch09_in_production   numbers
            commands/         train           commands
            widgets/          style collectives   charts
            widgets/panels/   panel ch01_collectives   knobs
        """
        '''
    assert find_docstring_differences(toy(tmp_path, {"edu3d/__init__.py": flat})) == []


def test_meta_graders_named_after_their_chapter(tmp_path):
    h = toy(tmp_path, {"edu3d/course/grade_moe.py": "", "edu3d/course/grading.py": "",
                       "edu3d/course/ch01_collectives_grade.py": "",
                       "edu3d/course/ch07_memory_grade.py": ""})
    assert find_graders_not_named_by_chapter(h) == [
        "edu3d/course/ch07_memory_grade.py:1: no chapter module edu3d/course/ch07_memory.py "
        "beside it",
        "edu3d/course/grade_moe.py:1: a grader named by its topic; name it after its chapter, "
        "edu3d/course/chNN_topic_grade.py"]


def test_meta_batch_cuts_outside_the_cutter(tmp_path):
    h = toy(tmp_path, {
        "edu3d/train/cut.py": "from edu3d.parallel.cp.sequence import split_batch\n",
        "edu3d/train/trainer.py": "from edu3d.train.cut import shard_rows\n"
                                  "from edu3d.parallel import cp\n\n\n"
                                  "def step(x, y):\n    return cp.split_batch(x, y, 2, 0)\n",
        "edu3d/parallel/cp/__init__.py": "from edu3d.parallel.cp.sequence import split_batch\n",
        "edu3d/parallel/cp/sequence.py": "def split_batch(x, y, cp, r):\n    return x, y\n",
        "edu3d/course/ch01_collectives.py": "from edu3d.train.cut import shard_rows\n"})
    assert find_batch_cuts_outside_the_cutter(h) == [
        "edu3d/train/trainer.py:1: imports edu3d.train.cut.shard_rows",
        "edu3d/train/trainer.py:6: calls .split_batch"]


def test_meta_wide_map_lines(tmp_path):
    wide = '"""The tree.\n\n    edu3d/    cli ' + "x" * 90 + '   the face\n"""\n'
    assert find_wide_map_lines(toy(tmp_path, {"edu3d/__init__.py": wide})) == [
        "edu3d/__init__.py:3: 119 characters"]


def test_meta_checks_outside_the_preflight(tmp_path):
    h = toy(tmp_path, {
        "edu3d/train/preflight.py": "def preflight(run):\n    return run\n\n\n"
                                    "def check_args(run):\n    return run\n",
        "edu3d/train/loop.py": "from edu3d.train.preflight import check_args, preflight\n",
        "edu3d/commands/train.py": "from edu3d.train import preflight\n"
                                   "from edu3d.train.preflight import check_args\n\n\n"
                                   "def main(run):\n    preflight.check_args(run)\n",
        "edu3d/course/ch01_collectives.py": "from edu3d.train.preflight import check_args\n"})
    assert find_checks_outside_the_preflight(h) == [
        "edu3d/commands/train.py:2: imports edu3d.train.preflight.check_args",
        "edu3d/commands/train.py:6: reads preflight.check_args",
        "edu3d/train/loop.py:1: imports edu3d.train.preflight.check_args"]


def test_meta_imports_of_the_rank_wrapper(tmp_path):
    h = toy(tmp_path, {"edu3d/launch/worker.py": "PREFIX = '[rank {}] '\n",
                       "edu3d/launch/agent.py": "from edu3d.launch.worker import PREFIX\n",
                       "edu3d/launch/live.py": "import edu3d.launch.worker\n",
                       "edu3d/launch/warm/rank.py": "from edu3d.launch import worker\n"})
    assert find_imports_of_the_rank_wrapper(h) == [
        "edu3d/launch/agent.py:1: imports edu3d.launch.worker",
        "edu3d/launch/live.py:1: imports edu3d.launch.worker"]
